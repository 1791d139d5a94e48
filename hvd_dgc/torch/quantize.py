"""Quantising compressors: EF-SignSGD (1 bit), TernGrad, QSGD and bfloat16.

All run with error feedback through hvd_dgc's memory (what quantisation loses
stays in the residual, momentum correction included with SGD). Layouts and
byte counts: hvd_dgc/packing.py.

Horovod 0.28.1's torch allreduce has kernels for float16/32/64 and int32/64
only (no int8, no bfloat16), which decides how each one travels:

- sign, QSGD, bf16: packed payloads, allgathered; every rank decodes and
  averages them all (bytes per rank grow with N, as for sparse DGC).
- TernGrad: summable. The ternaries {-1, 0, 1} are summed by allreduce in a
  float16 carrier, exact for sums up to 2048 ranks (the narrowest summable
  type Horovod has: int32 would cost twice as much).
"""

import math
from typing import NamedTuple

import torch

from hvd_dgc.aggregation import sign_rows
from hvd_dgc.packing import SCALE_BYTES, check_qsgd, check_sign_collective, exchange_bytes, \
    level_bits, num_buckets, plane_bytes, qsgd_payload_bytes, sign_payload_bytes, sign_reduces, \
    sign_shares
from hvd_dgc.torch.collective import Exchange, ExchangeCompressor, GatherCompressor, Max, Sum

__all__ = ["SignCompressor", "TernGradCompressor", "QSGDCompressor", "BF16Compressor",
           "pack_planes", "unpack_planes"]

_SHIFTS = torch.arange(8, dtype=torch.uint8)


def pack_planes(codes, width):
    """uint8 codes of ``width`` bits -> ``width`` bit planes of ceil(n/8) bytes."""
    n = codes.numel()
    padded = torch.zeros(plane_bytes(n) * 8, dtype=torch.uint8, device=codes.device)
    padded[:n] = codes.reshape(-1)
    shifts = _SHIFTS.to(codes.device)
    planes = [(((padded >> j) & 1).view(-1, 8) << shifts).sum(1, dtype=torch.uint8)
              for j in range(width)]
    return torch.cat(planes)


def unpack_planes(packed, width, n):
    """Inverse of ``pack_planes``: the first ``n`` codes as uint8."""
    shifts = _SHIFTS.to(packed.device)
    bits = (packed.reshape(width, -1, 1) >> shifts) & 1  # plane, byte, bit
    bits = bits.reshape(width, -1)[:, :n]
    codes = bits[0].clone()
    for j in range(1, width):
        codes |= bits[j] << j
    return codes


def _float_bytes(t):
    return t.to(torch.float32).reshape(-1).view(torch.uint8)


def _floats(raw):
    return raw.clone().view(torch.float32)  # clone: the slice may sit at any byte offset


class SignCompressor(GatherCompressor):
    """EF-SignSGD / 1-bit SGD (Seide et al. 2014; Karimireddy et al., ICML 2019).

    Sends sign(p) at 1 bit per element, packed 8 to a byte, and the scale
    ||p||_1 / n; decodes to scale * sign(p). Without error feedback sign
    compression can diverge; the residual p - scale * sign(p) makes it
    converge.

    Two ways to average (``collective``; hvd_dgc/packing.py ``sign_reduces``):

    - "allgather": every rank's packed bits and scale to every rank, each rank decoding
      and averaging them all (no majority vote: that would drop the scales, which error
      feedback needs). A rank receives (N-1) n/8 bytes: it grows with N.
    - "allreduce": the compressed allreduce of 1-bit Adam (Tang et al., ICML 2021): a
      step's tensors one after the other in N chunks, as DeepSpeed's flat buffer, each
      chunk with a scale per tensor it holds part of (hvd_dgc.aggregation.sign_rows),
      chunk c to rank c (an alltoall); rank c averages the N chunks it got, adds its
      server error (what its earlier averages lost), signs the sum again and sends it
      to every rank (an allgather), keeping what that lost as its new server error. A
      rank receives about 2 (N-1)/N n/8 bytes, whatever N. The server errors are this
      rank's state (``state_dict``); on another world, or where a tensor's part of
      this rank's chunk moved, they start afresh.
    - "auto" (the default): the allreduce from 3 ranks, the allgather below.
    """

    name = "sign"

    def __init__(self, seed=0, collective="auto"):
        self.seed = int(seed)
        self.collective = check_sign_collective(collective)
        self._errors, self._errors_of = {}, None  # key -> (start, server error), for
        #                                           (world, rank)
        self._rows = {}  # (numels, world, device) -> _RowsOn

    def _options(self):
        return {"seed": self.seed, "collective": self.collective}

    def payload_bytes(self, numel):
        return sign_payload_bytes(numel)

    def wire_bytes(self, shape, world=1):
        return exchange_bytes(self, math.prod(shape), world)[0]

    def wire_shares(self, shapes, world=1):
        """The compressed allreduce's bytes of a launch's tensors (one payload for all
        of them), each tensor's share; the allgather's, tensor by tensor."""
        if not sign_reduces(self.collective, world):
            return super().wire_shares(shapes, world)
        return sign_shares([math.prod(shape) for shape in shapes], world)

    @property
    def stateful(self):
        """Keeps state between steps (the server errors), which a skipped step restores."""
        return self.collective != "allgather"

    def encode(self, flat, rank=0):
        scale = flat.abs().mean().reshape(1)
        return torch.cat([_float_bytes(scale), pack_planes((flat >= 0).to(torch.uint8), 1)])

    def decode(self, payload, numel, dtype):
        scale = _floats(payload[:SCALE_BYTES]).to(dtype)
        signs = unpack_planes(payload[SCALE_BYTES:], 1, numel).to(dtype).mul_(2).sub_(1)
        return signs.mul_(scale)

    # -- the compressed allreduce ----------------------------------------------------
    def launch(self, residuals, keys, name, comm):
        """Round 1: the tensors one after the other in N chunks (aggregation.sign_rows),
        each chunk signed with a scale per tensor it holds part of, chunk c to rank c."""
        world = comm.size()
        if not sign_reduces(self.collective, world):
            return super().launch(residuals, keys, name, comm)
        if self._errors_of != (world, comm.rank()):  # another world: other chunks
            self._errors, self._errors_of = {}, (world, comm.rank())
        ex = Exchange(comm, name, residuals, keys)
        numels = [v.numel() for v in residuals]
        ex.rows = rows = self._rows_of(tuple(numels), world, residuals[0].device)
        flat = torch.cat([v.reshape(-1).float() for v in residuals]
                         + [residuals[0].new_zeros(1, dtype=torch.float32)])
        payloads, arrived = _sign_rows(flat[rows.gather], rows.segment, rows.segment_lengths)
        ex.sent = [piece.to(v.dtype) for piece, v in
                   zip(arrived.reshape(-1)[rows.scatter].split(numels), residuals)]
        self.keep_residual(ex)
        ex.width = payloads.shape[1]
        ex.handle = comm.alltoall_async(payloads.reshape(-1), [ex.width] * world,
                                        name + ".owners")
        return ex

    def advance(self, ex):
        """Round 2: this rank's chunk averaged, its server error added, signed again and
        sent to every rank."""
        if not hasattr(ex, "rows") or ex.round != 1:
            return
        world, rank, rows = ex.comm.size(), ex.comm.rank(), ex.rows
        got = ex.comm.wait(ex.handle)[0].view(world, -1)
        count = rows.counts[rank]
        segment = rows.segment[rank:rank + 1]
        arrived = _unsign_rows(got, rows.length, segment.expand(world, -1))
        average = (arrived.double().sum(0) / world).float()[:count]
        average += self._server_error(ex.keys, rows.spans[rank], average)
        padded = average.new_zeros(1, rows.length)
        padded[0, :count] = average
        payload, resigned = _sign_rows(padded, segment, rows.segment_lengths[rank:rank + 1])
        self._keep_server_error(ex.keys, rows.spans[rank], average - resigned[0, :count])
        ex.handle = ex.comm.allgather_async(payload.reshape(-1), ex.name + ".gather")
        ex.round = 2

    def collect(self, ex):
        if not hasattr(ex, "rows"):
            return super().collect(ex)
        self.advance(ex)
        world, rows = ex.comm.size(), ex.rows
        gathered = ex.comm.wait(ex.handle).view(world, -1)
        flat = _unsign_rows(gathered, rows.length, rows.segment).reshape(-1)[rows.scatter]
        return [piece.to(v.dtype) for piece, v in
                zip(flat.split([v.numel() for v in ex.residuals]), ex.residuals)]

    def _rows_of(self, numels, world, device):
        key = (numels, world, str(device))
        rows = self._rows.get(key)
        if rows is None:
            rows = self._rows[key] = _rows_on(numels, world, device)
        return rows

    def _server_error(self, keys, spans, like):
        """This rank's chunk's server error: each segment's, where this rank kept one for
        that part of that tensor (the group or the world may have moved: else zeros)."""
        out = torch.zeros_like(like)
        at = 0
        for t, lo, hi in spans:
            kept = self._errors.get(keys[t])
            if kept is not None and kept[0] == lo and kept[1].numel() == hi - lo:
                out[at:at + hi - lo] = kept[1].to(out.device)
            at += hi - lo
        return out

    def _keep_server_error(self, keys, spans, error):
        at = 0
        for t, lo, hi in spans:
            self._errors[keys[t]] = (lo, error[at:at + hi - lo].clone())
            at += hi - lo

    # -- checkpoint: the server errors, this rank's -----------------------------------
    def state_dict(self):
        """``{"server_errors": {tensor: (start, error)}, "of": (world, rank)}``: the part
        of each tensor this rank averages, from ``start``, and what its sign lost."""
        return {"server_errors": {k: (lo, e.clone()) for k, (lo, e) in self._errors.items()},
                "of": self._errors_of}

    def load_state_dict(self, state, rank=0):
        self._errors = {k: (int(kept[0]), kept[1].clone())
                        for k, kept in state.get("server_errors", {}).items()
                        if isinstance(kept, tuple)}  # (an older layout's: dropped)
        self._errors_of = state.get("of")
        if self._errors_of is not None and self._errors_of[1] != rank:
            self._errors, self._errors_of = {}, None  # another rank's chunks


class _RowsOn(NamedTuple):
    """hvd_dgc.aggregation.SignRows on the device (``counts``: the chunks' lengths, and
    ``spans``, on the host)."""

    length: int
    gather: torch.Tensor
    scatter: torch.Tensor
    segment: torch.Tensor
    segment_lengths: torch.Tensor
    counts: tuple
    spans: tuple


def _rows_on(numels, world, device):
    rows = sign_rows(numels, world)
    on = [torch.from_numpy(a).to(device) for a in
          (rows.gather, rows.scatter, rows.segment, rows.segment_lengths)]
    return _RowsOn(rows.length, *on, tuple(rows.lengths.tolist()), rows.spans)


def _sign_rows(rows, segment, segment_lengths):
    """Rows of chunks (zero past each one's length) signed as packing.sign_chunk_bytes
    lays them out: ``(payloads [rows, 4 S + ceil(length / 8)] uint8, the rows as they
    arrive)``. A segment's scale is its mean |x|, summed in float64."""
    sums = torch.zeros(segment_lengths.shape, dtype=torch.float64, device=rows.device)
    sums.scatter_add_(1, segment, rows.abs().double())
    scale = (sums / segment_lengths.clamp(min=1)).float()  # [rows, S]
    positive = rows >= 0  # (the padding too: 1 bits)
    width = plane_bytes(rows.shape[1])
    bits = torch.ones(rows.shape[0], width * 8, dtype=torch.uint8, device=rows.device)
    bits[:, :rows.shape[1]] = positive
    packed = (bits.view(rows.shape[0], width, 8) << _SHIFTS.to(rows.device)).sum(
        2, dtype=torch.uint8)
    payloads = torch.cat([scale.view(torch.uint8), packed], dim=1)
    each = scale.gather(1, segment)
    return payloads, torch.where(positive, each, -each)


def _unsign_rows(payloads, length, segment):
    """Inverse of ``_sign_rows``: the rows as they arrive, from their payloads
    (``segment``: each row element's segment, as the rows were signed)."""
    scales = payloads.shape[1] - plane_bytes(length)  # bytes: S float32s
    scale = payloads[:, :scales].contiguous().view(torch.float32)  # [rows, S]
    bits = (payloads[:, scales:].unsqueeze(2) >> _SHIFTS.to(payloads.device)) & 1
    positive = bits.reshape(payloads.shape[0], -1)[:, :length].bool()
    each = scale.gather(1, segment)
    return torch.where(positive, each, -each)


class QSGDCompressor(GatherCompressor):
    """QSGD (Alistarh et al., NeurIPS 2017): unbiased stochastic quantisation.

    Per bucket of ``bucket_size`` elements: the L2 norm, and for every element
    its sign and a level l in 0..``levels`` with E[l] = levels * |v_i| / norm
    (stochastic rounding), so E[decoded] = v. Buckets bound the variance:
    per element at most norm^2 / (4 levels^2). Not summable (norms differ per
    rank): allgathered.

    Error feedback needs a contraction, E||C(x) - x||^2 < ||x||^2: measured on
    Gaussian data the ratio is 1.6 at the paper's 512-element buckets with 7
    levels (the residual grows: training diverged on digits) and 0.44 at the
    default 128 (4 bits + 1/4 bit of norm per element: 7.5x smaller than fp32).
    """

    name = "qsgd"
    random = True

    def __init__(self, levels=7, bucket_size=128, seed=0):
        check_qsgd(levels, bucket_size)
        self.levels, self.bucket_size, self.seed = levels, bucket_size, int(seed)

    def _options(self):
        return {"levels": self.levels, "bucket_size": self.bucket_size, "seed": self.seed}

    def payload_bytes(self, numel):
        return qsgd_payload_bytes(numel, self.levels, self.bucket_size)

    def _buckets(self, flat):
        rows = num_buckets(flat.numel(), self.bucket_size)
        padded = flat.new_zeros(rows * self.bucket_size)
        padded[:flat.numel()] = flat
        return padded.view(rows, self.bucket_size)

    def encode(self, flat, rank=0):
        x = self._buckets(flat.to(torch.float32))
        norms = torch.linalg.vector_norm(x, dim=1)
        per_level = torch.where(norms > 0, self.levels / norms, torch.zeros_like(norms))
        noise = torch.rand(x.shape, generator=self.generator(x.device, rank), device=x.device)
        level = (x.abs() * per_level[:, None]).add_(noise).floor_().clamp_(0, self.levels)
        bits = level_bits(self.levels)
        codes = level.to(torch.uint8) | ((x < 0).to(torch.uint8) << bits)
        return torch.cat([_float_bytes(norms),
                          pack_planes(codes.reshape(-1)[:flat.numel()], 1 + bits)])

    def decode(self, payload, numel, dtype):
        rows = num_buckets(numel, self.bucket_size)
        norms = _floats(payload[:rows * SCALE_BYTES])
        bits = level_bits(self.levels)
        codes = unpack_planes(payload[rows * SCALE_BYTES:], 1 + bits, numel)
        level = (codes & ((1 << bits) - 1)).to(torch.float32)
        sign = 1.0 - 2.0 * (codes >> bits).to(torch.float32)
        step = (norms / self.levels).repeat_interleave(self.bucket_size)[:numel]
        return (level * sign * step).to(dtype)


class BF16Compressor(GatherCompressor):
    """bfloat16 next to Horovod's float16: fp32's range, 8 bits of mantissa, 2 bytes.

    Summable in principle, but Horovod 0.28.1's torch allreduce has no bfloat16
    kernel, so it is allgathered (2 bytes per element and per rank: at N > 2
    ranks Horovod's fp16 allreduce moves fewer bytes). The rounding error stays
    in the residual. Horovod's own optimizer cannot carry it: a clear error.
    """

    name = "bf16"
    summable_why = ("Horovod 0.28.1's torch allreduce has no bfloat16 kernel (it sums "
                    "float16/32/64 and int32/64 only); use Compression.fp16 there")

    def __init__(self, seed=0):
        self.seed = int(seed)

    def _options(self):
        return {"seed": self.seed}

    def payload_bytes(self, numel):
        return 2 * numel

    def encode(self, flat, rank=0):
        return flat.to(torch.bfloat16).view(torch.uint8)

    def decode(self, payload, numel, dtype):
        return payload.clone().view(torch.bfloat16).to(dtype)


class TernGradCompressor(ExchangeCompressor):
    """TernGrad (Wen et al., NeurIPS 2017): g -> s * sign(g) * b, b ~ Bernoulli(|g| / s).

    Clips each tensor at ``clip_sigma`` standard deviations first (the paper's
    2.5), which shrinks s and so the variance. s = max |g| over all ranks (an
    allreduce with op=Max), so the ternaries of every rank share one scale and
    their sum is the sum of the gradients: they go over allreduce (see the
    module doc for the carrier type). Unbiased for the clipped gradient;
    clipping and ternarisation errors stay in the residual. Two rounds (max,
    then sum), so delayed averaging cannot use it.
    """

    name = "terngrad"
    random = True
    sent_at_launch = False
    summable_why = ("its ternaries are summable only with one scale shared by every rank, "
                    "an allreduce(op=Max) before the sum, which compress/decompress cannot "
                    "do (and Horovod 0.28.1 has no int8 allreduce)")

    def __init__(self, clip_sigma=2.5, seed=0):
        if clip_sigma is not None and not clip_sigma > 0:
            raise ValueError(f"TernGrad clip_sigma must be > 0 or None, got {clip_sigma!r}")
        self.clip_sigma = None if clip_sigma is None else float(clip_sigma)
        self.seed = int(seed)

    def _options(self):
        return {"clip_sigma": self.clip_sigma, "seed": self.seed}

    def wire_bytes(self, shape, world=1):
        return 2 * math.prod(shape) + SCALE_BYTES

    def clip(self, flat):
        if self.clip_sigma is None:
            return flat.clone()
        limit = self.clip_sigma * flat.std(correction=0)
        return torch.maximum(torch.minimum(flat, limit), -limit)

    def launch(self, residuals, keys, name, comm):
        ex = Exchange(comm, name, residuals, keys)
        ex.clipped = [self.clip(v.view(-1)) for v in residuals]
        # an overflowed tensor (inf/nan) must make the shared scale non-finite everywhere
        maxima = torch.stack([c.abs().max().nan_to_num(nan=float("inf")) for c in ex.clipped])
        ex.handle = comm.allreduce_async(maxima.to(torch.float32), name + ".max", Max)
        return ex

    def ternarize(self, clipped, scale, rank):
        """{-1, 0, 1} with E[scale * t] = clipped."""
        prob = clipped.abs() / scale if scale > 0 else torch.zeros_like(clipped)
        noise = torch.rand(clipped.shape, generator=self.generator(clipped.device, rank),
                           device=clipped.device, dtype=clipped.dtype)
        return torch.sign(clipped) * (noise < prob).to(clipped.dtype)

    def advance(self, ex):
        if ex.round != 1:
            return
        ex.scales = ex.comm.wait(ex.handle).tolist()
        ternaries = [self.ternarize(c, s, ex.comm.rank()) for c, s in zip(ex.clipped, ex.scales)]
        ex.sent = [t * s for t, s in zip(ternaries, ex.scales)]
        self.keep_residual(ex)
        carrier = torch.float16 if ex.comm.size() <= 2048 else torch.float32
        ex.handle = ex.comm.allreduce_async(torch.cat(ternaries).to(carrier), name=ex.name + ".sum",
                                            op=Sum)
        ex.round, ex.clipped = 2, None

    def collect(self, ex):
        self.advance(ex)
        sums = ex.comm.wait(ex.handle)
        averages, offset, n = [], 0, ex.comm.size()
        for v, s in zip(ex.residuals, ex.scales):
            averages.append(sums[offset:offset + v.numel()].to(v.dtype) * (s / n))
            offset += v.numel()
        return averages
