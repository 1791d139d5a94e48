"""DGC's selection on a CPU: every tensor of a launch at once, over its flat memory.

The rule is DGC's (Lin et al., ICLR 2018, Sec. 3.1, and the window and rounds of its
reference code; tests/reference.py ``dgc_adapt`` is its NumPy form), per tensor:

  1. sample   |v| at runs of RUN elements, at a prime stride from a random start
  2. estimate the threshold that ``window[1] * k`` coordinates would pass, from the sample
  3. scan     the coordinates with |v| >= threshold: more than k: the exact top-k of
              them; at least ``window[0] * k``: all of them; fewer: lower the threshold
              by ``threshold_decay`` and scan again, at most ``max_adapt_rounds`` times,
              then an exact top-k of the whole tensor

Here each stage is a fixed number of operations for all of a launch's tensors: one
gather and one top-k over a [tensors, samples] matrix for the thresholds, and per round
one scan of the block maxima (``memory.BLOCK`` elements each, computed by the memory's
update on its way) and of the few blocks that pass. Where the kernel library is built
(hvd_dgc/torch/csrc) the thresholds are one call and the scan with all its rounds is one
more: a tensor's rounds follow each other on one thread, with no trip back to Python.
Per-tensor work made a ResNet-50 step a few thousand operations
(bench/results/step_overhead.md); this is a few dozen.

The sampling start of each tensor comes from (seed, rank, step, tensor), not from a
generator's stream: the same draw whichever tensors share the launch, and nothing to
save or restore when a step is skipped or resumed from a checkpoint.
"""

import functools
import math
import zlib
from itertools import accumulate
from typing import NamedTuple

import numpy as np
import torch

from hvd_dgc.torch.gpu_select import RUN, prime_at_least
from hvd_dgc.torch.memory import BLOCK, _fused

__all__ = ["Picked", "SampleLayout", "select_block", "adapt_block", "draw", "RUN"]

_MASK64 = (1 << 64) - 1


def draw(seed, rank, step, key):
    """A uniform number in [0, 1) from its four coordinates (splitmix64): the same in
    every process (``key``: an int, or a name). One of ``draws``."""
    return float(draws(seed, rank, step, (key,))[0])


def draws(seed, rank, step, keys):
    """``[draw(seed, rank, step, key) for key in keys]`` as a float64 array, in one pass of
    NumPy's wrapping uint64 arithmetic: a launch draws for every tensor each step, and a
    Python loop over 76 keys took ~50 us of the host's time (``keys``: a tuple; the
    scalar definition is tests/reference.py's ``draw``)."""
    x = np.uint64((seed * 0x9E3779B97F4A7C15 + rank * 0xBF58476D1CE4E5B9
                   + step * 0x94D049BB133111EB) & _MASK64) + _key_codes(keys)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)


@functools.lru_cache(maxsize=256)
def _key_codes(keys):
    return np.array([(k if isinstance(k, int) else zlib.crc32(str(k).encode())) & _MASK64
                     for k in keys], dtype=np.uint64)


class Picked(NamedTuple):
    """What a launch's sparse tensors send: ``positions`` in the flat buffer (grouped by
    tensor, in order; int64), per tensor ``counts`` (host ints), and ``values`` there
    when the selection decided them (a GPU's: 0 in a padding slot, where a position
    repeats); None: the memory's values at the positions (``FlatMemory.take``)."""

    positions: torch.Tensor
    values: object
    counts: tuple


class SampleLayout:
    """Where the thresholds' samples are read, for a set of segments of a flat buffer
    (``offsets``, ``numels``, with the sampling options). Built once per launch layout.

    A tensor of ``n`` elements is sampled at ``max(min_sample, n * sample_ratio)`` places
    (all of it when that is ``n``, or ``n < 8 RUN``): whole runs of RUN consecutive
    elements (one cache line), ``rows`` of them at a prime ``stride`` (so the runs walk
    through every residue of the inner dimensions: 3x3 kernels, power-of-two channels),
    from a start drawn in ``[0, starts)`` runs. The samples are gathered compactly, then
    laid out one row per segment for one top-k."""

    def __init__(self, offsets, numels, sample_ratio, min_sample, device):
        self.numels = tuple(numels)
        bases, self.sizes, self.starts, self.steps = [], [], [], []
        for o, n in zip(offsets, numels):
            wanted = min(n, max(min_sample, int(math.ceil(n * sample_ratio))))
            if wanted >= n or n < 8 * RUN:
                base, starts, step = torch.arange(n) + o, 1, 0
            else:
                runs = n // RUN
                stride = prime_at_least(runs * RUN // wanted)
                rows = max(1, runs // stride)
                starts = max(1, min(stride, runs - (rows - 1) * stride))
                base = (o + torch.arange(rows)[:, None] * (stride * RUN)
                        + torch.arange(RUN)[None, :]).reshape(-1)
                step = RUN
            bases.append(base)
            self.sizes.append(base.numel())
            self.starts.append(starts)
            self.steps.append(step)
        # each segment's sampling start: draw x starts (whole runs) x steps, every step
        self.starts = np.array(self.starts, dtype=np.float64)
        self.steps = np.array(self.steps, dtype=np.int64)
        width = max(self.sizes)
        sizes = torch.tensor(self.sizes)
        rows = torch.arange(len(bases)).repeat_interleave(sizes)
        cols = torch.cat([torch.arange(n) for n in self.sizes])
        self.base = torch.cat(bases).to(device)
        self.cell = (rows * width + cols).to(device)  # where each sample goes in the matrix
        self.sizes_t = sizes.to(device)
        self.shape = (len(bases), width)
        self.device = device

    def thresholds(self, v, ks, aim, keys, seed, rank, step):
        """Per segment, the |v| that ``aim * k`` of its coordinates would pass, estimated
        from its sample: its k-th largest sampled |v|, k in proportion (the kernel
        library's partial sorts where it is built, else one top-k over a matrix with a
        row per segment)."""
        shift = (draws(seed, rank, step, tuple(keys)) * self.starts).astype(np.int64) * self.steps
        shift = torch.from_numpy(shift).to(self.device)
        kth = torch.tensor([min(size, max(1, int(math.ceil(size * aim * k / n)))) - 1
                            for size, k, n in zip(self.sizes, ks, self.numels)],
                           dtype=torch.long, device=self.device)
        if _fused(v):
            return torch.ops.hvd_dgc.thresholds(v, self.base, self.sizes_t, shift, kth)
        at = self.base + shift.repeat_interleave(self.sizes_t, output_size=self.base.numel())
        matrix = torch.full(self.shape, -1.0, dtype=v.dtype, device=self.device)
        matrix.view(-1).index_copy_(0, self.cell, v.index_select(0, at).abs_())
        best = torch.topk(matrix, int(kth.max()) + 1, dim=1).values  # largest first
        return best.gather(1, kth[:, None]).view(-1)


@functools.lru_cache(maxsize=64)
def sample_layout(offsets, numels, sample_ratio, min_sample, device):
    return SampleLayout(offsets, numels, sample_ratio, min_sample, device)


class _Blocks(NamedTuple):
    """The blocks of a flat range [lo, hi) and the segment each belongs to."""

    lo: int
    segment: torch.Tensor   # per block of the range
    starts: torch.Tensor    # per segment, its first position
    numels: torch.Tensor    # per segment


@functools.lru_cache(maxsize=64)
def _blocks(offsets, numels, device):
    lo, hi = offsets[0], offsets[-1] + -(-numels[-1] // BLOCK) * BLOCK
    segment = torch.zeros((hi - lo) // BLOCK, dtype=torch.long)
    for i, o in enumerate(offsets):
        segment[(o - lo) // BLOCK:] = i
    to = functools.partial(torch.tensor, dtype=torch.long, device=device)
    return _Blocks(lo, segment.to(device), to(list(offsets)), to(list(numels)))


#: candidates of the "too many" branch sorted together at most (beyond: per tensor
#: top-k, whose partial selection beats one sort of millions: warm-up densities)
_SORT_LIMIT = 1 << 20


def adapt_block(v, block_max, offsets, numels, ks, thresholds, window=(0.8, 1.3),
                decay=0.8, rounds=10):
    """DGC's rule from a first threshold per segment (module doc, stage 3), for all the
    segments ``(offsets, numels)`` of the flat ``v`` at once. ``block_max``: max |v| of
    every BLOCK elements of v (segments start at multiples of BLOCK). Returns the chosen
    positions grouped by segment, and their counts; one kernel call for every round
    (else a fixed number of operations per round), whatever the number of segments."""
    offsets, numels, ks = tuple(offsets), tuple(numels), tuple(ks)
    layout = _blocks(offsets, numels, str(v.device))
    device, count = v.device, len(ks)
    t = thresholds.to(v.dtype).clone()
    k_t = torch.tensor(ks, dtype=torch.long, device=device)
    pending = [i for i, (n, k) in enumerate(zip(numels, ks)) if k < n]
    if _fused(v, block_max):  # every round of every segment in one call
        skipped = len(pending) < count  # (k covers the segment: an infinite threshold)
        if skipped:
            active = torch.zeros(count, dtype=torch.bool, device=device)
            active[pending] = True
            t = torch.where(active, t, torch.tensor(math.inf, dtype=t.dtype, device=device))
        found, counts, short = torch.ops.hvd_dgc.scan(
            v, block_max, layout.starts, layout.numels, t.float(), k_t, float(window[0]),
            float(decay), int(rounds))
        final = counts.tolist()
        pending = [i for i, s in enumerate(short.tolist()) if s]
        if not pending and not skipped:  # DGC's final density: every segment decided
            return found, tuple(final)
        groups = [(found, torch.arange(count, device=device).repeat_interleave(
            counts, output_size=found.numel()))]
    else:
        final, groups, pending = _rounds(v, block_max, layout, t, k_t, ks, pending, window,
                                         decay, rounds)
    return _merged(v, groups, pending, offsets, numels, ks, final)


def _rounds(v, block_max, layout, t, k_t, ks, pending, window, decay, rounds):
    """adapt_block's rounds in torch operations, one scan of every pending segment a
    round: ``(counts, groups, still pending)``; groups: per round (positions, their
    segments), grouped by segment."""
    device, count = v.device, len(ks)
    inf = torch.tensor(math.inf, dtype=t.dtype, device=device)
    low = [window[0] * k for k in ks]
    final = [0] * count
    groups = []
    for _ in range(rounds + 1):
        if not pending:
            break
        active = torch.zeros(count, dtype=torch.bool, device=device)
        active[pending] = True
        found, counts = _scan(v, block_max, layout, torch.where(active, t, inf), k_t)
        seg = torch.arange(count, device=device).repeat_interleave(
            counts, output_size=found.numel())
        counts = counts.tolist()
        # more than k: already the exact top-k of them (the scan trims); at least the
        # window's low end: kept as found; fewer: lower the threshold and look again
        still = [i for i in pending if counts[i] < low[i]]
        if len(still) < len(pending):
            if still:
                keep = torch.ones(count, dtype=torch.bool, device=device)
                keep[still] = False
                keep = keep[seg]
                found, seg = found[keep], seg[keep]
            groups.append((found, seg))
            for i in pending:
                if counts[i] >= low[i]:
                    final[i] = counts[i]
        pending = still
        if pending:
            lower = torch.zeros(count, dtype=torch.bool, device=device)
            lower[pending] = True
            t = torch.where(lower, t * decay, t)
    return final, groups, pending


def _merged(v, groups, pending, offsets, numels, ks, final):
    """The positions of ``groups`` and, for the segments still ``pending`` and those
    whose k covers them, the exact top-k (every coordinate), each segment's at its
    place."""
    device = v.device
    for i in pending + [i for i, (n, k) in enumerate(zip(numels, ks)) if k >= n]:
        a, n = offsets[i], numels[i]  # every coordinate, or nothing in the window after
        top = torch.arange(n, device=device) if ks[i] >= n else \
            torch.topk(v[a:a + n].abs(), ks[i], sorted=False).indices  # every round
        groups.append((a + top, torch.full((top.numel(),), i, dtype=torch.long,
                                          device=device)))
        final[i] = top.numel()
    if len(groups) == 1:
        return groups[0][0], tuple(final)
    # each segment was decided in one group: place each group's positions at its
    # segments' places in the result
    starts = torch.tensor((0,) + tuple(accumulate(final))[:-1], dtype=torch.long,
                          device=device)
    out = torch.empty(sum(final), dtype=torch.long, device=device)
    for found, seg in groups:
        rank = torch.arange(found.numel(), device=device) - torch.searchsorted(seg, seg)
        out[starts[seg] + rank] = found
    return out, tuple(final)


def _scan(v, block_max, layout, thresholds, ks):
    """Per segment, the positions with |v| >= its threshold (an infinite one: none), in
    increasing order, the ``ks[s]`` largest where there are more, and their counts, in
    torch operations (the kernel library's ``scan`` does this and the rounds)."""
    lo = layout.lo
    hi = lo + layout.segment.numel() * BLOCK
    blocks = v[lo:hi].view(-1, BLOCK)
    at = thresholds[layout.segment]
    hit = torch.nonzero(block_max[lo // BLOCK:hi // BLOCK] >= at).view(-1)
    seg = layout.segment[hit]
    inside = torch.nonzero(blocks.index_select(0, hit).abs() >= at[hit][:, None])
    seg = seg[inside[:, 0]]
    found = lo + hit[inside[:, 0]] * BLOCK + inside[:, 1]
    real = found - layout.starts[seg] < layout.numels[seg]  # not the zeros between
    found, seg = found[real], seg[real]
    counts = torch.bincount(seg, minlength=len(ks))
    over = counts > ks
    if bool(over.any()):  # the exact top-k of those with too many, in position order
        many = over[seg]
        top, top_seg = _top_of_each(v, found[many], seg[many], ks, len(ks))
        found = torch.cat([found[~many], top])
        seg = torch.cat([seg[~many], top_seg])
        order = torch.sort(found).indices  # segments lie in increasing positions
        found, seg = found[order], seg[order]
        counts = torch.bincount(seg, minlength=len(ks))
    return found, counts


def _top_of_each(v, found, seg, k, count):
    """``(positions, segments)``: the ``k[s]`` largest |v| among each segment's
    candidates ``found`` (grouped by segment)."""
    if found.numel() <= _SORT_LIMIT:  # one sort, by segment and then |v| descending
        bits = v[found].abs().float().view(torch.int32).long()
        order = torch.sort(seg * 2 ** 31 + (2 ** 31 - 1 - bits)).indices
        found, seg = found[order], seg[order]
        first = torch.searchsorted(seg, torch.arange(count, device=seg.device))
        rank = torch.arange(seg.numel(), device=seg.device) - first[seg]
        keep = rank < k[seg]
        return found[keep], seg[keep]
    sizes = torch.bincount(seg, minlength=count).tolist()  # warm-up densities: many
    parts, segs = [], []
    for i, part in enumerate(found.split(sizes)):
        if part.numel():
            top = torch.topk(v[part].abs(), int(k[i]), sorted=False).indices
            parts.append(part[top])
            segs.append(torch.full((top.numel(),), i, dtype=torch.long, device=seg.device))
    return torch.cat(parts), torch.cat(segs)


def select_block(v, block_max, offsets, numels, ks, keys, options, rank, step):
    """``Picked`` for the segments of flat ``v``: DGC's sampled threshold, then its rule.
    ``options``: the DGC compressor (sample_ratio, min_sample, window, threshold_decay,
    max_adapt_rounds, seed)."""
    layout = sample_layout(tuple(offsets), tuple(numels), options.sample_ratio,
                           options.min_sample, str(v.device))
    thresholds = layout.thresholds(v, ks, options.window[1], keys, options.seed, rank, step)
    positions, counts = adapt_block(v, block_max, offsets, numels, ks, thresholds,
                                    options.window, options.threshold_decay,
                                    options.max_adapt_rounds)
    return Picked(positions, None, counts)
