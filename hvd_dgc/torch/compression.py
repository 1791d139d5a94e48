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

The optimizer asks once per launch (``pick``), for all of its sparse tensors over
their flat memory: a fixed number of operations whatever the number of tensors
(cpu_select.py). On a GPU nothing on this path may wait for the device either:
there the selection is decided on the device (gpu_select.py), always exactly ``k``
records per tensor; slots that no coordinate fills repeat a sent index with value
0, which adds nothing.
"""

import math
from typing import NamedTuple

import torch
from horovod.torch.compression import Compressor, FP16Compressor, NoneCompressor

from hvd_dgc._guard import called_from_horovod_allreduce, sparse_under_allreduce_error
from hvd_dgc.packing import check_value_bits
from hvd_dgc.sampling import DGCSampling
from hvd_dgc.schedule import check_density, num_selected
from hvd_dgc.torch.cpu_select import Picked, adapt_block, draws, select_block
from hvd_dgc.torch.gpu_select import Selection, select_span, slot_offsets
from hvd_dgc.torch.memory import aligned_size, block_abs_max
from hvd_dgc.torch.options import Options
from hvd_dgc.torch.powersgd import PowerSGDCompressor
from hvd_dgc.torch.quantize import BF16Compressor, QSGDCompressor, SignCompressor, \
    TernGradCompressor

__all__ = ["Compression", "Picked", "Selected", "Selection", "SparseCompressor", "DGCCompressor",
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


def add_in_order(out, positions, values):
    """``out[positions] += values`` (flat), duplicates added in record order on every
    device. CUDA's index_add_ adds duplicates with atomics, in any order: ranks would
    round differently. index_put_ sorts the indices (stably) and adds them in record
    order, so every rank computes the same sum."""
    if on_accelerator(out):
        return out.index_put_((positions,), values, accumulate=True)
    return out.index_add_(0, positions, values)


def coalesce_in_order(t):
    """``t.coalesce()`` with repeated rows summed in record order on every device: CUDA's
    coalesce sorts unstably, so the order, and the rounding, of a repeated row's sum
    would differ between ranks holding the same records."""
    return coalesce_sorted(t) if on_accelerator(t) else t.coalesce()


def coalesce_sorted(t):
    """A sparse COO tensor's rows, each once, summed by a stable sort and index_put_
    (add_in_order's sum): one read-back (the number of distinct rows)."""
    dims = t.shape[:t.sparse_dim()]
    indices, values = t._indices(), t._values()
    linear = torch.zeros(indices.shape[1], dtype=torch.long, device=indices.device)
    for d, size in enumerate(dims):
        linear = linear * size + indices[d]
    rows, inverse = torch.unique(linear, sorted=True, return_inverse=True)
    summed = values.new_zeros((rows.numel(),) + tuple(values.shape[1:]))
    summed.index_put_((inverse,), values, accumulate=True)
    out_indices = torch.empty((len(dims), rows.numel()), dtype=torch.long,
                              device=indices.device)
    rest = rows
    for d in range(len(dims) - 1, -1, -1):
        out_indices[d] = rest % dims[d]
        rest = rest // dims[d]
    return torch.sparse_coo_tensor(out_indices, summed, t.shape, is_coalesced=True)


class SparseCompressor(Options, Compressor):
    """Base of the top-k style compressors: ``select`` differs, packing is shared.

    Args:
        density: fraction kept by the standalone ``compress``; hvd_dgc's
            optimizer passes ``k`` itself, from its density schedule.
        fp16_values: send values as float16 (6-byte records instead of 8).
        seed: seed of this compressor's own generator (the global RNG is never
            touched); ranks offset it by their rank.
        value_bits: bits of each value the optimizer's allgather sends: 8 (float8
            e4m3 and a float32 scale per tensor, what the rounding loses kept in the
            memory), 16 or 32; at most 16 with ``fp16_values``. The paths that add
            records up in flight (region, hierarchical) send fp32 (fp16 with
            ``fp16_values``).
    """

    sparse = True
    name = "sparse"
    uses_block_max = False  # does select() want memory.block_abs_max(flat)?
    codes_positions = True  # the allgather path codes its positions (positions.py)
    codes_regions = True    # and region reduce its blocks' (region.py)

    def __init__(self, density=0.001, fp16_values=False, seed=0, value_bits=8):
        self.density = check_density(density)
        self.fp16_values = bool(fp16_values)
        self.seed = int(seed)
        self.value_bits = check_value_bits(value_bits)

    def _options(self):
        return {"density": self.density, "fp16_values": self.fp16_values, "seed": self.seed,
                "value_bits": self.value_bits}

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
        """Does ``pick`` on ``device`` scan the memory's block maxima (CPU DGC only)?"""
        return self.uses_block_max and device.type == "cpu"

    # -- the three steps of the sparse path -------------------------------
    def pick(self, v, block_max, offsets, numels, ks, keys, rank, step):
        """``Picked``: what a launch's sparse tensors send of the flat memory ``v``, whose
        tensors start at ``offsets`` (``numels`` long, ``ks[i]`` records at most; ``keys``
        name them). ``block_max``: max |v| of every memory.BLOCK elements, if computed.
        Here one tensor after the other (top-k and random-k, the baselines)."""
        parts = [self.select(v[o:o + n], k, rank) + o
                 for o, n, k in zip(offsets, numels, ks)]
        positions = torch.cat(parts) if len(parts) > 1 else parts[0]
        return Picked(positions, None, tuple(p.numel() for p in parts))

    def select(self, flat, k, rank=0, block_max=None):
        """Indices (int64, distinct) of the ``k`` coordinates to send from a flat tensor."""
        raise NotImplementedError

    def sparsify(self, flat, k, rank=0, block_max=None):
        """``Selected(indices, values)``: what is sent of one flat tensor."""
        indices = self.select(flat, k, rank, block_max)
        return Selected(indices, flat.index_select(0, indices))

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
        return add_in_order(out, indices.long(), values)

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
    random = True

    def select(self, flat, k, rank=0, block_max=None):
        n = flat.numel()
        if k >= n:
            return torch.arange(n, device=flat.device)
        gen = self.generator(flat.device, rank)
        return torch.randperm(n, generator=gen, device=flat.device)[:k]


class DGCCompressor(SparseCompressor, DGCSampling):
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
                 window=(0.8, 1.3), threshold_decay=0.8, max_adapt_rounds=10, min_sample=2048,
                 value_bits=8):
        SparseCompressor.__init__(self, density=density, fp16_values=fp16_values, seed=seed,
                                  value_bits=value_bits)
        DGCSampling.__init__(self, sample_ratio, window, threshold_decay, max_adapt_rounds,
                             min_sample)

    def _options(self):
        return dict(SparseCompressor._options(self), **self.sampling_options())

    def pick(self, v, block_max, offsets, numels, ks, keys, rank, step):
        """On a CPU, cpu_select.py: the rule above for every tensor at once over the flat
        memory. On an accelerator, gpu_select.py: exactly ``k`` records per tensor,
        decided on the device."""
        if v.device.type == "cpu":
            return select_block(v, block_max, offsets, numels, ks, keys, self, rank, step)
        ks = tuple(ks)
        sel = select_span(v, tuple(offsets), tuple(numels), ks,
                          draws(self.seed, rank, step, tuple(keys)), self.sample_ratio,
                          self.min_sample)
        return Picked(sel.indices, sel.values, ks)

    def select(self, flat, k, rank=0, block_max=None):
        """One tensor (standalone use): its indices, as ``pick`` chooses them. On an
        accelerator a slot no coordinate fills repeats a sent index: ``sparsify`` gives
        it the value 0, so a sum of what is sent counts each coordinate once."""
        return self._pick_one(flat, k, rank).positions

    def sparsify(self, flat, k, rank=0, block_max=None):
        picked = self._pick_one(flat, k, rank)
        values = picked.values if picked.values is not None else \
            flat.index_select(0, picked.positions)
        return Selected(picked.positions, values)

    def _pick_one(self, flat, k, rank):
        n = flat.numel()
        if k >= n:
            return Picked(torch.arange(n, device=flat.device), None, (n,))
        step = self.__dict__.get("_calls", 0)
        self.__dict__["_calls"] = step + 1
        v = _padded(flat)
        return self.pick(v, block_abs_max(v), (0,), (n,), (k,), (0,), rank, step)

    def adapt(self, flat, k, threshold, block_max=None):
        """Indices of ``flat`` (CPU) chosen from a first ``threshold``: the rounds of
        lowering, the window and the fallbacks of the class docstring (TensorFlow's
        ``DGCCompressor.adapt`` follows the same rule)."""
        v = _padded(flat)
        positions, _ = adapt_block(v, block_abs_max(v), (0,), (flat.numel(),), (k,),
                                   torch.as_tensor(threshold).reshape(1), self.window,
                                   self.threshold_decay, self.max_adapt_rounds)
        return positions


def _padded(flat):
    """``flat`` in a buffer of whole memory blocks (zeros after it), as the memory's."""
    out = flat.new_zeros(aligned_size(flat.numel()))
    out[:flat.numel()] = flat
    return out


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
