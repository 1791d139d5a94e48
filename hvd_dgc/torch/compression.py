"""Compressors for PyTorch: what to send. (What stays behind is in memory.py.)

Sparse compressors choose ``k`` coordinates of a flat tensor and pack them as
one uint8 buffer of fixed-size records ``[int32 index | value]``, so each
tensor costs a single allgather and the receiver needs no per-rank sizes:
concatenated records are still records.

They subclass Horovod's ``Compressor`` and keep its ``compress``/``decompress``
contract for standalone use, but Horovod's stock DistributedOptimizer cannot
use them (it would sum the payloads); that is detected and refused with the fix.

``Compression.dgc``, ``Compression.topk`` and ``Compression.randomk`` are
ready instances; call one to change its options, e.g.
``Compression.dgc(sample_ratio=0.001, fp16_values=True)``.

On a GPU nothing on this path may wait for the device, and kernel launches, not
bytes, bound the work: there a step's tensors are selected together
(``sparsify_many``, gpu_select.py), always exactly ``k`` records per tensor,
decided on the device; slots that no coordinate fills repeat a sent index with
value 0, which adds nothing.
"""

import math
from typing import NamedTuple

import torch
from horovod.torch.compression import Compressor, FP16Compressor, NoneCompressor

from hvd_dgc._guard import called_from_horovod_allreduce, sparse_under_allreduce_error
from hvd_dgc.schedule import check_density, num_selected
from hvd_dgc.torch.gpu_select import RUN as _RUN, Selection, prime_at_least as _prime_at_least, \
    select_many, slot_offsets
from hvd_dgc.torch.memory import BLOCK, _fused, _fused_memory, block_abs_max
from hvd_dgc.torch.options import Options
from hvd_dgc.torch.powersgd import PowerSGDCompressor
from hvd_dgc.torch.quantize import BF16Compressor, QSGDCompressor, SignCompressor, \
    TernGradCompressor

__all__ = ["Compression", "Selected", "Selection", "SparseCompressor", "DGCCompressor",
           "TopKCompressor", "RandomKCompressor", "PowerSGDCompressor", "SignCompressor",
           "TernGradCompressor", "QSGDCompressor", "BF16Compressor"]

INDEX_BYTES = 4


class Selected(NamedTuple):
    """What one worker sends of a flat tensor: ``values[i]`` at ``indices[i]`` (int64).
    An index may repeat only with value 0 (padding of the fixed-size GPU form)."""

    indices: torch.Tensor
    values: torch.Tensor


def on_accelerator(t):
    return t.device.type != "cpu"


class SparseCompressor(Options, Compressor):
    """Base of the top-k style compressors: ``select`` differs, packing is shared.

    Args:
        density: fraction kept by the standalone ``compress``; hvd_dgc's
            optimizer passes ``k`` itself, from its density schedule.
        fp16_values: send values as float16 (6-byte records instead of 8).
        seed: seed of this compressor's own generator (the global RNG is never
            touched); ranks offset it by their rank.
    """

    sparse = True
    name = "sparse"
    uses_block_max = False  # does select() want memory.block_abs_max(flat)?

    def __init__(self, density=0.001, fp16_values=False, seed=0):
        self.density = check_density(density)
        self.fp16_values = bool(fp16_values)
        self.seed = int(seed)

    def _options(self):
        return {"density": self.density, "fp16_values": self.fp16_values, "seed": self.seed}

    @property
    def value_dtype(self):
        return torch.float16 if self.fp16_values else torch.float32

    @property
    def value_bytes(self):
        return 2 if self.fp16_values else 4

    @property
    def record_bytes(self):
        return INDEX_BYTES + self.value_bytes

    def wants_block_max(self, device):
        """Does ``sparsify`` on ``device`` use ``memory.block_abs_max`` (CPU DGC only)?"""
        return self.uses_block_max and device.type == "cpu"

    # -- the three steps of the sparse path -------------------------------
    def select(self, flat, k, rank=0, block_max=None):
        """Indices (int64, distinct) of the ``k`` coordinates to send from a flat tensor.

        ``block_max``: ``memory.block_abs_max(flat)`` if the caller already has it
        (the fused memory update computes it on the way); only DGC's selection uses it.
        """
        raise NotImplementedError

    def sparsify(self, flat, k, rank=0, block_max=None):
        """``Selected(indices, values)``: what the optimizer sends of ``flat``."""
        indices = self.select(flat, k, rank, block_max)
        return Selected(indices, flat.index_select(0, indices))

    def sparsify_many(self, flats, ks, rank=0, block_maxes=None):
        """``Selection`` of ``ks[i]`` records (at most) from each of ``flats``, concatenated
        in order: what one launch sends. Here one tensor after the other."""
        block_maxes = block_maxes or [None] * len(flats)
        picked = [self.sparsify(f, k, rank, b) for f, k, b in zip(flats, ks, block_maxes)]
        ks = tuple(sel.indices.numel() for sel in picked)
        if len(picked) == 1:
            return Selection(picked[0].indices, picked[0].values, ks)
        return Selection(torch.cat([sel.indices for sel in picked]),
                         torch.cat([sel.values for sel in picked]), ks)

    def pack(self, values, indices):
        """One uint8 buffer of records ``[int32 index | value]``, shape ``(k, record_bytes)``."""
        idx = indices.to(torch.int32).view(torch.uint8).view(-1, INDEX_BYTES)
        val = values.to(self.value_dtype).view(torch.uint8).view(-1, self.value_bytes)
        return torch.cat([idx, val], dim=1)

    def unpack(self, records):
        """Inverse of ``pack`` for any number of concatenated records."""
        records = records.view(-1, self.record_bytes)
        indices = records[:, :INDEX_BYTES].contiguous().view(torch.int32).view(-1)
        values = records[:, INDEX_BYTES:].contiguous().view(self.value_dtype).view(-1)
        return values, indices

    def scatter_sum_many(self, records, sizes, ks, dtype=torch.float32, scale=1.0):
        """``scatter_sum`` of a launch whose records carry several tensors: every rank's
        block holds ``ks[i]`` records of tensor ``i`` (of ``sizes[i]`` elements), in
        order. One scatter for them all; returns the dense flat update of each."""
        if len(sizes) == 1:
            return [self.scatter_sum(records, sizes[0], dtype, scale)]
        values, indices = self.unpack(records)
        offsets = slot_offsets(sizes, ks, str(records.device))
        indices = (indices.view(-1, sum(ks)) + offsets).view(-1)
        return list(self._sum_records(values, indices, sum(sizes), dtype, scale).split(sizes))

    def scatter_sum(self, records, numel, dtype=torch.float32, scale=1.0):
        """``scale`` x the sum of every rank's records, as a dense flat tensor (duplicates
        add up). Scaling the k values, not the n-element result, saves a pass."""
        values, indices = self.unpack(records)
        return self._sum_records(values, indices, numel, dtype, scale)

    @staticmethod
    def _sum_records(values, indices, numel, dtype, scale):
        values = values.to(dtype)
        if scale != 1.0:
            values = values * scale
        out = torch.zeros(numel, dtype=dtype, device=values.device)
        if on_accelerator(out):
            # CUDA's index_add_ adds duplicates with atomics, in any order: ranks would
            # round differently. index_put_ sorts the indices (stably) and adds them in
            # record order, so every rank computes the same sum.
            return out.index_put_((indices.long(),), values, accumulate=True)
        return out.index_add_(0, indices.long(), values)

    # -- Horovod's Compressor API ------------------------------------------
    def compress(self, tensor):
        """Standalone use: select ``density`` of ``tensor`` and pack it; allgather the
        result (never allreduce it) and pass it to ``decompress``."""
        if called_from_horovod_allreduce():
            raise sparse_under_allreduce_error(repr(self), "torch")
        flat = tensor.detach().reshape(-1)
        sel = self.sparsify(flat, num_selected(flat.numel(), self.density))
        return self.pack(sel.values, sel.indices), (tensor.shape, tensor.dtype)

    def decompress(self, tensor, ctx):
        """Dense sum of the gathered records, in the original shape and dtype."""
        if called_from_horovod_allreduce():
            raise sparse_under_allreduce_error(repr(self), "torch")
        shape, dtype = ctx
        return self.scatter_sum(tensor, math.prod(shape)).view(shape).to(dtype)


class TopKCompressor(SparseCompressor):
    """Exact top-k by magnitude (``torch.topk``): the accuracy reference, slower than DGC's."""

    name = "topk"

    def select(self, flat, k, rank=0, block_max=None):
        if k >= flat.numel():
            return torch.arange(flat.numel(), device=flat.device)
        return torch.topk(flat.abs(), k, sorted=False).indices


class RandomKCompressor(SparseCompressor):
    """k coordinates chosen uniformly at random (a baseline: unbiased only with scaling,
    which error feedback makes unnecessary)."""

    name = "randomk"

    def select(self, flat, k, rank=0, block_max=None):
        n = flat.numel()
        if k >= n:
            return torch.arange(n, device=flat.device)
        gen = self.generator(flat.device, rank)
        return torch.randperm(n, generator=gen, device=flat.device)[:k]


class DGCCompressor(SparseCompressor):
    """DGC's sampled-threshold top-k (Lin et al., ICLR 2018, Sec. 3.1 and its reference code).

    An exact top-k over millions of elements is slow; DGC estimates the k-th
    largest magnitude from a random sample of ``sample_ratio`` of the tensor,
    then adapts: if more than ``k`` pass the threshold it takes an exact top-k
    of those candidates only (a small set); if fewer than ``window[0]*k`` pass
    it lowers the threshold by ``threshold_decay``, at most
    ``max_adapt_rounds`` times, then falls back to an exact top-k. The result
    holds between ``window[0]*k`` and ``k`` coordinates: never more bytes than
    an exact top-k.

    The estimate aims at ``window[1]*k`` rather than ``k``: overshooting costs a
    top-k of a few candidates, undershooting another scan of the tensor.

    On a GPU the rounds of lowering would each wait for a count, so there the
    selection is decided on the device, for all of a step's tensors at once
    (gpu_select.py): exactly ``k`` records per tensor, the exact top-k whenever
    at least ``k`` pass a threshold aimed at ``2k``. ``window``,
    ``threshold_decay`` and ``max_adapt_rounds`` apply to the CPU form.

    Args:
        sample_ratio: fraction of the tensor sampled (paper: 0.1%-1%).
        window: (lowest count accepted, count the estimate aims at), as
            fractions of k.
        threshold_decay: factor applied to a threshold that selects too few.
        max_adapt_rounds: rounds of lowering before the exact fallback.
        min_sample: at least this many samples (small tensors sample all).
    """

    name = "dgc"
    uses_block_max = True

    def __init__(self, density=0.001, fp16_values=False, seed=0, sample_ratio=0.01,
                 window=(0.8, 1.3), threshold_decay=0.8, max_adapt_rounds=10, min_sample=2048):
        super().__init__(density=density, fp16_values=fp16_values, seed=seed)
        if not 0.0 < sample_ratio <= 1.0:
            raise ValueError(f"sample_ratio must be in (0, 1], got {sample_ratio!r}")
        lo, hi = window
        if not 0.0 < lo <= 1.0 <= hi:
            raise ValueError(f"window must be (low, high) with 0 < low <= 1 <= high, got {window!r}")
        if not 0.0 < threshold_decay < 1.0:
            raise ValueError(f"threshold_decay must be in (0, 1), got {threshold_decay!r}")
        self.sample_ratio = float(sample_ratio)
        self.window = (float(lo), float(hi))
        self.threshold_decay = float(threshold_decay)
        self.max_adapt_rounds = int(max_adapt_rounds)
        self.min_sample = int(min_sample)

    def _options(self):
        opts = super()._options()
        opts.update(sample_ratio=self.sample_ratio, window=self.window,
                    threshold_decay=self.threshold_decay,
                    max_adapt_rounds=self.max_adapt_rounds, min_sample=self.min_sample)
        return opts

    def _sample(self, flat, num_samples, rank):
        """|flat| at about ``num_samples`` places spread over the whole tensor.

        Runs of RUN consecutive elements (one cache line) at a strided distance from
        a random start: a random gather costs as much as a pass over the whole tensor,
        and even one element per line reads 1/RUN of it. The stride is prime so the
        runs walk through every residue of the tensor's inner dimensions (3x3 kernels,
        power-of-two channels) instead of aliasing onto one of them."""
        n = flat.numel()
        if num_samples >= n or n < 8 * _RUN:
            return flat.abs()
        runs = flat[:n // _RUN * _RUN].view(-1, _RUN)
        stride = _prime_at_least(runs.shape[0] * _RUN // num_samples)
        start = int(torch.randint(0, min(stride, runs.shape[0]), (1,),
                                  generator=self.generator("cpu", rank)))
        return runs[start::stride].abs().view(-1)

    def sparsify(self, flat, k, rank=0, block_max=None):
        if on_accelerator(flat) and k < flat.numel():
            indices, values, _ = self.sparsify_many([flat], [k], rank)
            return Selected(indices, values)
        return super().sparsify(flat, k, rank, block_max)

    def sparsify_many(self, flats, ks, rank=0, block_maxes=None):
        if not on_accelerator(flats[0]):
            return super().sparsify_many(flats, ks, rank, block_maxes)
        return select_many(flats, ks, self.generator("cpu", rank), self.sample_ratio,
                           self.min_sample)

    def select(self, flat, k, rank=0, block_max=None):
        n = flat.numel()
        if k >= n:
            return torch.arange(n, device=flat.device)
        if on_accelerator(flat):  # distinct indices: one count read back (not the hot path)
            sel = self.sparsify(flat, k, rank)
            return torch.unique(sel.indices[sel.values != 0])
        num_samples = min(n, max(self.min_sample, int(math.ceil(n * self.sample_ratio))))
        sample = self._sample(flat, num_samples, rank)
        count = self.window[1] * k
        k_sample = min(sample.numel(), max(1, int(math.ceil(sample.numel() * count / n))))
        threshold = torch.topk(sample, k_sample, sorted=False).values.min()
        return self.adapt(flat, k, threshold, block_max)

    def adapt(self, flat, k, threshold, block_max=None):
        """Indices of ``flat`` (CPU) chosen from a first ``threshold``: the rounds of
        lowering, the window and the fallbacks of the class docstring (TensorFlow's
        ``DGCCompressor.adapt`` follows the same rule)."""
        low = self.window[0] * k
        scan = _BlockScan(flat, block_max)
        for _ in range(self.max_adapt_rounds + 1):
            candidates = scan.at_least(threshold)
            count = candidates.numel()
            if count > k:
                # Too many: exact top-k among the candidates only (a small set).
                top = torch.topk(flat.index_select(0, candidates).abs(), k, sorted=False).indices
                return candidates[top]
            if count >= low:
                return candidates
            threshold = threshold * self.threshold_decay
        return torch.topk(flat.abs(), k, sorted=False).indices


class _BlockScan:
    """Indices where ``|flat| >= threshold``, for thresholds that pass ~0.1% of it.

    A full ``nonzero`` over a boolean mask is the slowest step of selection. Block
    maxima of ``|flat|`` are computed once (or come from the fused memory update);
    each threshold tried then scans only them and the few blocks that pass, so the
    adaptation rounds cost almost nothing.
    """

    BLOCK = BLOCK

    def __init__(self, flat, block_max=None):
        self.flat = flat
        self.full = flat.numel() // self.BLOCK * self.BLOCK
        self.blocks = flat[:self.full].view(-1, self.BLOCK)
        self.block_max = block_abs_max(flat) if block_max is None else block_max

    def at_least(self, threshold):
        if _fused(self.flat, self.block_max):
            return _fused_memory.indices_at_least(self.flat, self.block_max, float(threshold))
        hit = torch.nonzero(self.block_max >= threshold).view(-1)
        inside = torch.nonzero(self.blocks.index_select(0, hit).abs() >= threshold)
        found = hit[inside[:, 0]] * self.BLOCK + inside[:, 1]
        if self.full < self.flat.numel():
            tail = self.flat[self.full:].abs()
            found = torch.cat([found, torch.nonzero(tail >= threshold).view(-1) + self.full])
        return found


class Compression:
    """Horovod's compressors next to hvd_dgc's (use with hvd_dgc's DistributedOptimizer).

    ``none`` and ``fp16`` are Horovod's own classes: dense, summable, and they
    keep working with Horovod's stock optimizer too. ``dgc``, ``topk`` and
    ``randomk`` sparsify (allgather of records); ``powersgd``, ``sign``,
    ``terngrad``, ``qsgd`` and ``bf16`` run their own collectives
    (collective.py), all with error feedback through hvd_dgc's memory.
    """

    none = NoneCompressor
    fp16 = FP16Compressor
    dgc = DGCCompressor()
    topk = TopKCompressor()
    randomk = RandomKCompressor()
    powersgd = PowerSGDCompressor()
    sign = SignCompressor()
    terngrad = TernGradCompressor()
    qsgd = QSGDCompressor()
    bf16 = BF16Compressor()


def is_sparse(compression):
    return getattr(compression, "sparse", False)
