"""DGC's selection on an accelerator: many tensors at once, nothing read back.

On a GPU the selection is bound by kernel launches, not bytes. ResNet-50 has 76
tensors worth sparsifying; a per-tensor selection of ~20 small kernels took 35-90
ms a step on an H100, 3-7 times ``torch.topk`` per tensor and more than the
forward and backward passes themselves. Here the selection of a whole group of
tensors is a fixed number of kernels over their concatenation, whatever the
number of tensors:

  1. sample   |v| at fixed runs of 16 elements per tensor, from a random start
              (one gather; the starts are drawn on the host, sent without waiting)
  2. estimate each tensor's threshold: the value ``aim = 2k`` coordinates of it
              would pass, read off its sample (one top-k over a padded
              [tensors, sample] matrix); the sample holds ~32 values above it
  3. compact  every coordinate at or above its tensor's threshold into one
              buffer of ``4 * sum(k)`` (``nonzero_static``: no count read back)
  4. top-k    per tensor, the ``k`` largest of its candidates (one stable sort by
              tensor, then |v|), written into its ``k`` slots

Measured on an H100 (bench/gpu_dgc.py): 0.68 ms for ResNet-50's 76 tensors, select
and pack, replayed as one CUDA graph over the memory's own buffer with no per-tensor
host work (``select_span``; 18x faster than ``torch.topk`` per tensor on that machine,
less than one per-tensor copy of them).

Exactly ``k`` records per tensor leave, so the collective's size is known on the
host. They are the exact top-k whenever at least ``k`` coordinates pass (aimed at
``2k``, with a spread of ~1/sqrt(32): fewer pass in ~0.3% of draws); then every
candidate goes and the rest stays in the memory, as always with DGC. Slots no
candidate fills repeat the tensor's largest record with value 0: that adds
nothing at the receiver, and the memory zeroes a coordinate that is sent anyway.
If candidates ever overflow the buffer, the tensors at its end send fewer
records that step (again kept in the memory, never lost).

The same code runs on CPU tensors (tests/torch/test_single_process.py checks it against an exact
top-k there); on CPUs the optimizer uses the adaptive selection in
compression.py instead, which reads its counts back and sends no padding.
"""

import functools
import math
import os
import warnings
from collections import OrderedDict
from typing import NamedTuple

import numpy as np
import torch

# Elements compared against one threshold: tensors are padded to whole blocks, as the
# memory lays out its sparse tensors (memory.MemoryBlock), so its buffer is read in place.
from hvd_dgc.torch.memory import BLOCK

__all__ = ["Selection", "select_many", "select_span", "slot_offsets", "slot_starts",
           "counts_on", "on_device", "upload", "prime_at_least", "AIM", "MIN_HITS", "CAPACITY",
           "RUN", "BLOCK"]

RUN = 16       # sampled elements read together: 64 bytes of float32
AIM = 2        # each threshold aims at this many times k candidates
MIN_HITS = 32  # sampled values expected above a threshold estimate
CAPACITY = 4   # candidates kept, as a multiple of sum(k)


class Selection(NamedTuple):
    """What a group of flat tensors sends: ``ks[i]`` records for tensor ``i``, in order.

    ``indices`` are local to their tensor (int64); ``values`` are ``v`` there, or 0 in a
    padding slot, whose index repeats one of the tensor's sent indices."""

    indices: torch.Tensor
    values: torch.Tensor
    ks: tuple

    def split(self):
        """Per tensor ``(indices, values)`` views."""
        return list(zip(self.indices.split(self.ks), self.values.split(self.ks)))


def _sample(n, k, sample_ratio, min_sample):
    """A tensor of ``n`` elements' sample for its threshold (``k`` to select):
    ``(positions, start range, step, kth)``: every element where the sample would be all
    of it or the tensor is small, else runs of RUN consecutive elements (one cache line) at a prime stride, so
    the runs walk through every residue of the inner dimensions; each step's draw starts
    the runs within ``start range`` and moves them by ``step``; ``kth``: the sample's
    order statistic that estimates the threshold."""
    aim = AIM * k
    hits = math.ceil(MIN_HITS * n / aim)
    wanted = min(n, max(min_sample, math.ceil(n * sample_ratio), hits))
    if wanted >= n or n < 8 * RUN:
        pos, start_range, step = torch.arange(n), 1, 0
    else:
        runs = n // RUN
        stride = prime_at_least(runs * RUN // wanted)
        count = max(1, runs // stride)
        start_range = max(1, min(stride, runs - (count - 1) * stride))
        pos = (torch.arange(count)[:, None] * (stride * RUN)
               + torch.arange(RUN)[None, :]).reshape(-1)
        step = RUN
    return pos, start_range, step, min(pos.numel(), max(1, math.ceil(pos.numel() * aim / n))) - 1


class _Plan:
    """What a group's selection keeps from step to step: it depends only on the tensors'
    sizes, their k and the sampling options, so it is built once per warm-up stage.

    The tensors are laid out in blocks of ``BLOCK`` elements, each tensor padded with
    zeros to a whole number of blocks (zeros never pass a threshold), as the memory keeps
    them: then each block compares against one threshold, and no per-element threshold
    is ever built (torch's ``repeat_interleave`` to 25 M elements took 1.4 ms on an H100,
    more than the rest)."""

    def __init__(self, sizes, ks, device, sample_ratio, min_sample):
        self.key = (sizes, ks, device, sample_ratio, min_sample)
        self.ks = ks
        self.k_total = sum(ks)
        padded = [-(-n // BLOCK) * BLOCK for n in sizes]
        self.pads = [p - n for p, n in zip(padded, sizes)]
        offsets = [0]
        for n in padded:
            offsets.append(offsets[-1] + n)
        self.total = offsets[-1]
        self.offsets = tuple(offsets[:-1])
        positions, ranges, steps, kth = [], [], [], []
        for i, (n, k) in enumerate(zip(sizes, ks)):
            pos, start_range, step, kth_i = _sample(n, k, sample_ratio, min_sample)
            positions.append(pos + offsets[i])
            ranges.append(start_range)
            steps.append(step)
            kth.append(kth_i)
        width = max(p.numel() for p in positions)
        pad = torch.zeros(len(sizes), width, dtype=torch.long)
        used = torch.zeros(len(sizes), width, dtype=torch.bool)
        for i, pos in enumerate(positions):
            pad[i, :pos.numel()] = pos
            used[i, :pos.numel()] = True
        self.ranges = np.array(ranges, dtype=np.float64)
        self.steps = np.array(steps, dtype=np.int64)
        self.top = max(kth) + 1
        ks_t = torch.tensor(ks, dtype=torch.long)
        starts = torch.tensor(offsets[:-1], dtype=torch.long)
        slot_tensor = torch.arange(len(sizes)).repeat_interleave(ks_t)
        to = functools.partial(upload, device=device)
        self.sample_at = to(pad)
        self.sample_pad = to(~used)
        self.kth = to(torch.tensor(kth, dtype=torch.long)[:, None])
        self.block_tensor = to(torch.arange(len(sizes)).repeat_interleave(
            torch.tensor(padded) // BLOCK))
        self.bounds = to(starts[1:])
        self.ids = to(torch.arange(len(sizes) + 1))
        self.k_ext = to(torch.cat([ks_t, torch.zeros(1, dtype=torch.long)]))
        self.slot_start_ext = to(torch.cat([torch.cumsum(ks_t, 0) - ks_t,
                                            torch.tensor([self.k_total])]))
        self.starts = to(starts)
        self.sizes = to(torch.tensor(sizes, dtype=torch.long))
        # a tensor whose k covers it (density 1) sends every coordinate: its threshold is
        # 0, so all of it passes, its zeros too (its padding is no candidate: _select)
        self.everything = to(torch.tensor([k >= n for n, k in zip(sizes, ks)]))
        self.any_everything = any(k >= n for n, k in zip(sizes, ks))
        self.slot_tensor = to(slot_tensor)
        self.slot_start = to(starts[slot_tensor])
        self.capacity = min(self.total, CAPACITY * self.k_total)
        self.positions = to(torch.arange(self.capacity))
        self.zeros = torch.zeros(BLOCK, device=device)


@functools.lru_cache(maxsize=32)
def _plan(sizes, ks, device, sample_ratio, min_sample):
    return _Plan(sizes, ks, device, sample_ratio, min_sample)


def select_many(flats, ks, draws, sample_ratio=0.001, min_sample=1000):
    """``Selection`` of ``ks[i]`` records from each flat tensor of ``flats`` (one device,
    one dtype). ``draws``: per tensor a number in [0, 1) placing its sampling start
    (cpu_select.draws: from seed, rank, step and tensor, as on the CPU path).

    On a CUDA device the selection's ~40 kernels are captured once as a CUDA graph and
    replayed (``_Graphed``): launched one by one they are bound by the host, not the GPU
    (1.27 ms for ResNet-50 on an H200, host time equal to GPU time)."""
    device, dtype = flats[0].device, flats[0].dtype
    sizes = tuple(int(f.numel()) for f in flats)
    ks = tuple(int(k) for k in ks)
    plan = _plan(sizes, ks, str(device), float(sample_ratio), int(min_sample))
    shift = _shift(plan, draws, device)
    if device.type == "cuda" and graphs_enabled():
        graphed = _graphed(plan, flats, dtype)
        if graphed is not None:
            return graphed(shift)
    return _select(plan, flats, shift, ks)


def select_span(buffer, offsets, numels, ks, draws, sample_ratio=0.001, min_sample=1000):
    """``select_many`` of the tensors lying in the flat ``buffer`` at ``offsets`` (``numels``
    long; all tuples), whose ``Selection.indices`` are positions in ``buffer``: a launch's
    selection, every step. Once its graph is captured, a step's host work is one lookup,
    the sampling shift's copy and the replay: building the tensors' views, their sizes,
    addresses and plan each step took ~0.15 ms of the host's time for ResNet-50, and the
    GPU waited for it."""
    key = (buffer.data_ptr(), buffer.dtype, offsets, numels, ks, sample_ratio, min_sample)
    span = _SPANS.get(key)
    if span is not None and graphs_enabled():
        graphed, starts = span
        _SPANS.move_to_end(key)
        out = graphed.replay(_shift(graphed.plan, draws, buffer.device))
        return Selection(out.indices + starts, out.values.clone(), ks)
    flats = [buffer[o:o + n] for o, n in zip(offsets, numels)]
    sel = select_many(flats, ks, draws, sample_ratio, min_sample)
    starts = slot_starts(offsets, ks, str(buffer.device))
    if buffer.device.type == "cuda" and graphs_enabled():
        plan = _plan(numels, ks, str(buffer.device), float(sample_ratio), int(min_sample))
        graphed = _GRAPHS.get(_graph_key(plan, flats, buffer.dtype))
        if isinstance(graphed, _Graphed):  # captured (from the second call on)
            _SPANS[key] = (graphed, starts)
            while len(_SPANS) > _GRAPHS_KEPT:
                _SPANS.popitem(last=False)
    return Selection(sel.indices + starts, sel.values, ks)


def _shift(plan, draws, device):
    """Each tensor's sampling start on ``device`` (``draws``: per tensor in [0, 1))."""
    shift = (np.asarray(draws, dtype=np.float64) * plan.ranges).astype(np.int64) * plan.steps
    return upload(torch.from_numpy(shift), device)


def _joined(plan, flats):
    """The tensors padded to whole blocks, one after another: where they already lie so
    in one buffer (the memory's aligned layout, memory.MemoryBlock: zeros between) that
    buffer's span, else a concatenation. The copy it saves passes over every element
    twice (0.21 ms of a 0.98 ms selection of ResNet-50 on an H100)."""
    first = flats[0]
    storage = first.untyped_storage()
    base = first.storage_offset()
    if all(f.is_contiguous() and f.dtype == first.dtype
           and f.untyped_storage().data_ptr() == storage.data_ptr()
           and f.storage_offset() == base + offset for f, offset in zip(flats, plan.offsets)) \
            and (base + plan.total) * first.element_size() <= storage.nbytes():
        return first.as_strided((plan.total,), (1,), base)
    zeros = plan.zeros.to(first.dtype)
    pieces = []
    for f, pad in zip(flats, plan.pads):
        pieces += [f, zeros[:pad]] if pad else [f]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _select(plan, flats, shift, ks):
    device, dtype = flats[0].device, flats[0].dtype
    x = _joined(plan, flats)

    # 1-2. sample and threshold per tensor
    sample = x[plan.sample_at + shift[:, None]].abs().masked_fill_(plan.sample_pad, -1)
    best = torch.topk(sample, plan.top, dim=1).values  # sorted, largest first
    # Zeros are never worth a record: an all-zero tensor must not fill the buffer.
    threshold = best.gather(1, plan.kth).view(-1).clamp_(min=_smallest_positive(dtype))
    if plan.any_everything:
        threshold = threshold.masked_fill(plan.everything, 0)

    # 3. candidates of every tensor, in one fixed-size buffer
    blocks = x.view(-1, BLOCK)
    passing = blocks.abs() >= threshold[plan.block_tensor][:, None]
    found = torch.nonzero_static(passing.view(-1), size=plan.capacity, fill_value=-1).view(-1)
    at = found.clamp(min=0)
    tensor = torch.searchsorted(plan.bounds, at, right=True)
    # a candidate in a tensor's padding (not zero there: a buffer's span, _joined) is none
    valid = (found >= 0) & (at - plan.starts[tensor] < plan.sizes[tensor])
    tensor = torch.where(valid, tensor, len(flats))

    # 4. per tensor the k largest candidates, into its k slots. One sort, by tensor and
    # then by |v| descending: a non-negative float's bits order as its value does.
    bits = x[at].abs().float().view(torch.int32).long()
    order = torch.sort(tensor * 2 ** 31 + (2 ** 31 - 1 - bits), stable=True).indices
    tensor, at = tensor[order], at[order]
    first = torch.searchsorted(tensor, plan.ids)  # where each tensor's candidates begin
    rank = plan.positions - first[tensor]
    slot = torch.where(rank < plan.k_ext[tensor], plan.slot_start_ext[tensor] + rank,
                       plan.k_total)  # k_total: a spare slot for what is not sent
    # Padding: the tensor's largest candidate (its first), or its first element if none.
    largest = torch.where(first[1:] > first[:-1], at[first[:-1].clamp(max=plan.capacity - 1)],
                          plan.starts)
    chosen = torch.empty(plan.k_total + 1, dtype=torch.long, device=device)
    chosen[:-1] = largest[plan.slot_tensor]
    chosen.scatter_(0, slot, at)
    real = torch.zeros(plan.k_total + 1, dtype=torch.bool, device=device)
    real.scatter_(0, slot, True)
    chosen, real = chosen[:-1], real[:-1]
    values = torch.where(real, x[chosen], 0)
    return Selection(chosen - plan.slot_start, values, ks)


def graphs_enabled():
    """CUDA graphs for the selection: on unless ``HVD_DGC_CUDA_GRAPHS=0`` (read at each
    call, so a benchmark can compare both in one process)."""
    return os.environ.get("HVD_DGC_CUDA_GRAPHS", "1") != "0"


class _Graphed:
    """One group's selection captured as a CUDA graph: the plan, the tensors' addresses
    and the dtype are fixed, the sampling shift is its one input (copied into place before
    each replay). Its outputs are copied out, so a later replay never changes what an
    earlier step returned.

    Captured on a side stream in ``thread_local`` mode (Horovod's background thread may
    query its events meanwhile), without ``torch.cuda.graph``'s device synchronisation:
    capturing is queued work like any other, so no step ever waits for it."""

    def __init__(self, plan, flats):
        device = flats[0].device
        self.plan, self.ks = plan, plan.ks  # the graph reads the plan's tensors: kept
        self.shift = torch.zeros(len(plan.ks), dtype=torch.long, device=device)
        self.graph = torch.cuda.CUDAGraph()
        here = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(here)
        with torch.cuda.stream(side):
            self.graph.capture_begin(capture_error_mode="thread_local")
            try:
                self.out = _select(plan, flats, self.shift, plan.ks)
            finally:
                self.graph.capture_end()
        here.wait_stream(side)

    def replay(self, shift):
        """The graph's own outputs, which the next replay overwrites."""
        self.shift.copy_(shift, non_blocking=True)
        self.graph.replay()
        return self.out

    def __call__(self, shift):
        out = self.replay(shift)
        return Selection(out.indices.clone(), out.values.clone(), self.ks)


_GRAPHS = OrderedDict()  # (plan, addresses, dtype) -> _Graphed, _WARM, or None (failed)
_SPANS = OrderedDict()   # select_span's key -> (its _Graphed, its slot starts)
_GRAPHS_KEPT = 4         # each holds its own memory pool (its intermediates)
_WARM = "warm"           # run eagerly once: that initialises what capture will need


def _graph_key(plan, flats, dtype):
    """A captured graph reads its tensors' addresses: one per plan, addresses, dtype."""
    return plan.key, tuple(f.data_ptr() for f in flats), dtype


def _graphed(plan, flats, dtype):
    """The group's captured selection, or None on its first run (eager: it loads the
    kernels and fills the allocator before anything is captured) and where capture failed
    (said once; the eager selection, the same records, runs instead)."""
    key = _graph_key(plan, flats, dtype)
    if key not in _GRAPHS:  # first run
        _GRAPHS[key] = _WARM
        while len(_GRAPHS) > _GRAPHS_KEPT:
            _GRAPHS.popitem(last=False)
        return None
    _GRAPHS.move_to_end(key)
    entry = _GRAPHS[key]
    if entry is not _WARM:  # captured, or None where capture failed
        return entry
    try:
        entry = _Graphed(plan, flats)
    except RuntimeError as e:
        warnings.warn(f"hvd_dgc: DGC's GPU selection could not be captured as a CUDA graph "
                      f"({e}); it runs kernel by kernel (the same records, more host time). "
                      f"HVD_DGC_CUDA_GRAPHS=0 skips the attempt.", RuntimeWarning)
        entry = None
    _GRAPHS[key] = entry
    return entry


@functools.lru_cache(maxsize=32)
def slot_offsets(sizes, ks, device):
    """Per record slot of a launch, where its tensor starts in their concatenation: local
    indices plus these are indices into it (built once, on the device)."""
    ks_t = torch.tensor(ks, dtype=torch.long)
    starts = torch.tensor([0] + list(sizes[:-1]), dtype=torch.long).cumsum(0)
    return upload(starts.repeat_interleave(ks_t), device)


@functools.lru_cache(maxsize=64)
def slot_starts(offsets, ks, device):
    """Per record slot of a launch, where its tensor starts in the flat buffers: local
    indices plus these are positions there (built once, on the device)."""
    return upload(torch.tensor(offsets, dtype=torch.long).repeat_interleave(
        torch.tensor(ks, dtype=torch.long)), device)


def upload(host, device):
    """A host tensor on ``device`` without the host waiting: a copy from pageable memory
    waits for the device (a host synchronisation, counted in tests/torch/test_cuda.py), one
    from pinned memory is queued. On the CPU, ``host`` itself."""
    if torch.device(device).type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


@functools.lru_cache(maxsize=256)
def on_device(values, device, dtype=torch.long):
    """``values`` (a tuple: a launch's offsets, counts, members, flags) as a tensor on
    ``device`` (a string), made once: one copy a step would be a host synchronisation a
    step. Shared: never written to."""
    return upload(torch.tensor(values, dtype=dtype), device)


def counts_on(ks, device):
    """``ks`` as a tensor on ``device``, made once."""
    return on_device(tuple(ks), str(device))


def _smallest_positive(dtype):
    return {torch.float64: 2.0 ** -1074, torch.float16: 2.0 ** -24,
            torch.bfloat16: 2.0 ** -133}.get(dtype, 2.0 ** -149)


def prime_at_least(n):
    n = max(2, int(n))
    while any(n % d == 0 for d in range(2, int(n ** 0.5) + 1)):
        n += 1
    return n
