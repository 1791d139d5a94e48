"""The gradient exchange: a launch's gradients from the parameters to the collectives
and back.

The path of one gradient, as the optimizer runs it (optimizer.py says when):

    launch(params)                    the tensors leaving together (scheduler.py)
      (nothing of DGC's pending)      all dense, residual zero, nothing for the memory to
                                      apply: Horovod's allreduce of p.grad in place, and
                                      no more (paths.py InPlacePath)
      grads -> g                      one copy into a flat buffer (the launch's layout)
      g /= loss scale                 GradScaler: the memory holds unscaled gradients
      clip (N^-1/2), weight decay     memory.prepare_gradients, per tensor, in one pass
      (Adam frozen: x scale)          (hvd_dgc/adam.py)
      guard                           non-finite: poison the payload (skip) or drop it
      memory.accumulate(g)            u = m u + g; v += u  (+ |v| block maxima)
      path.launch(part) per kind      each path takes what leaves the memory (paths.py)
                                      and starts its collectives, in one order on every
                                      rank (hvd_dgc.paths.ORDER)
    advance(launches)                 second rounds, every launch before any wait
    collect(launch) -> update         the average, flat, in the launch's layout
    write(...)                        p.grad for every parameter, from flat buffers

A launch's tensors lie in one flat buffer per role (gradient, memory u and v, update,
own), each tensor's slice a view: the work above is a fixed number of operations per
launch whatever the number of tensors, which on a GPU is the number of kernels
(bench/results/step_overhead.md). Each path owns a contiguous range: the sparse
tensors first (block-aligned, for the selection's scan), then the others. The exchange
is the only part that holds the memory; a path is handed its launch's block.
"""

from collections import OrderedDict
from functools import cached_property
from itertools import groupby
from typing import NamedTuple

import torch

from hvd_dgc.paths import ORDER, PathKind
from hvd_dgc.torch.compression import coalesce_in_order
from hvd_dgc.torch.gpu_select import on_device
from hvd_dgc.torch.memory import BLOCK, FlatMemory, Run, aligned_size, buffer_dtype, \
    prepare_gradients
from hvd_dgc.torch.paths import CLASSES, InPlacePath, Part, PathContext, make_paths
from hvd_dgc.torch.update import FlatUpdate, GradUpdate, InPlaceUpdate, ViewUpdate

__all__ = ["GradientExchange", "Launch", "Member", "StepCounters"]

#: layouts kept a parameter: a model's launches (up to one a tensor, where each leaves
#: from its own hook) times a few path assignments, with room to spare
_LAYOUTS_KEPT = 3


class Member(NamedTuple):
    """One parameter of a launch as the exchange sees it; the hyper-parameters the memory
    applies for it (SGD's, taken over; else 0) are read from its param group each step."""

    param: torch.Tensor
    key: int              # its index among the optimizer's parameters
    name: str
    info: object          # plan.TensorInfo
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    order: tuple = None   # the strides its flat slices follow (memory_order), or row-major

    @property
    def numel(self):
        return self.info.numel

    @property
    def shape(self):
        return self.param.shape

    def shaped(self, flat):
        """A flat slice of its numel as the parameter's shape, in its memory order: the
        view its gradient can be, with the parameter's strides."""
        if self.order is None:
            return flat.view(self.shape)
        return flat.as_strided(self.shape, self.order, flat.storage_offset())

    def flat(self, tensor):
        """``tensor`` (the parameter's shape) flat, in the order ``shaped`` reads."""
        if self.order is None:
            return tensor.reshape(-1)
        out = torch.empty_strided(self.shape, self.order, dtype=tensor.dtype,
                                  device=tensor.device)
        out.copy_(tensor)
        return out.as_strided((out.numel(),), (1,))


def memory_order(param):
    """The strides a parameter's flat slices follow: its own where it is dense but not
    row-major (a channels_last weight), else None (row-major). In its own order its
    gradient is copied in, and its average handed back as ``p.grad``, with the strides
    autograd and the base optimizer use: torch's fused multi-tensor kernels need the
    strides of the two lists to match, and fall back to a kernel per tensor (measured on
    an H200: 322 of a ResNet-50 step's ~460 extra operations) where they do not."""
    if param.is_contiguous():
        return None
    expected = 1
    for d in sorted(range(param.dim()), key=lambda d: (param.stride(d), d)):
        if param.size(d) != 1 and param.stride(d) != expected:
            return None  # overlapping or with gaps: row-major copies
        expected *= param.size(d)
    return tuple(param.stride())


class StepCounters:
    """What a step collects for the optimizer to read once at its end (one read-back
    for the step, not one per tensor)."""

    def __init__(self):
        self.fp16_clipped = []  # device counts of fp16 values sent clipped (dense, records)


class Layout:
    """How one launch's tensors lie in its flat buffers, for one assignment of paths:
    fixed, so made once and kept (the buffers with it)."""

    def __init__(self, members, kinds, memory, device, dtype):
        order = sorted(range(len(members)), key=lambda i: (
            CLASSES[kinds[i]].flat_rank, members[i].momentum, members[i].nesterov, i))
        self.members = tuple(members[i] for i in order)
        self.kinds = tuple(kinds[i] for i in order)
        self.classes = tuple(CLASSES[k] for k in self.kinds)
        stored = [i for i, c in enumerate(self.classes) if c.stored]
        aligned = sum(1 for c in self.classes if c.aligned)
        self.block = memory.block([self.members[i].key for i in stored],
                                  [self.members[i].numel for i in stored], aligned,
                                  device, dtype) if stored else None
        offsets, end = [], self.block.total if self.block is not None else 0
        for i, m in enumerate(self.members):
            if i < len(stored):
                offsets.append(self.block.offsets[i])
            else:  # gradients a path reads (hierarchical DGC: its memory is per slice)
                offsets.append(end)
                end += m.numel if self.classes[i].reads_gradient else 0
        self.offsets, self.total = tuple(offsets), end
        # a slice of the flat buffers: what is stored in the memory or read from the
        # gradient; else a sparse gradient, which travels as it is
        flat = [c.stored or c.reads_gradient for c in self.classes]
        self.dense_grads = [i for i, f in enumerate(flat) if f]
        self.sparse_grads = [i for i, f in enumerate(flat) if not f]
        self.aligned = aligned > 0
        self.checked = [i for i, c in enumerate(self.classes) if c.checked]
        # the flat gradient is wanted after the memory update (a path reads it, or the
        # guard's look at a tensor the block maxima do not cover)
        self.reads_gradient = any(c.reads_gradient or (c.checked and not c.aligned)
                                  for c in self.classes)
        self.device, self.dtype, self.flat = device, dtype, flat
        self.written = None  # where a ViewUpdate wrote it last (None: anywhere)
        self.params = [m.param for m in self.members]
        if self.block is not None and self.block.aligned:  # in block maxima (guard.py)
            blocks = [(self.block.offsets[i] // BLOCK,
                       (self.block.offsets[i] + aligned_size(self.members[i].numel)) // BLOCK)
                      for i in range(self.block.aligned)]
            self.block_spans = (on_device(tuple(e for _, e in blocks), str(device)),
                                on_device(tuple(b for b, _ in blocks), str(device)))
        self.decay = [(wd, [j for j, i in enumerate(self.dense_grads)
                            if self.members[i].weight_decay == wd])
                      for wd in sorted({self.members[i].weight_decay
                                        for i in self.dense_grads} - {0.0})]
        self.runs = self._runs(len(stored))
        self.parts = [(kind, tuple(i for i, k in enumerate(self.kinds) if k == kind))
                      for kind in ORDER if kind in self.kinds]

    def _runs(self, stored):
        """Ranges of the memory block whose tensors share (momentum, nesterov), split
        where the aligned part ends (the kernel's block maxima stop there); together
        they cover the block."""
        if self.block is None:
            return []
        bounds = list(self.block.offsets[1:stored]) + [self.block.total]
        runs = []
        for i in range(stored):
            lo, hi = self.block.offsets[i], bounds[i]
            m = self.members[i]
            same = runs and runs[-1].momentum == m.momentum and \
                runs[-1].nesterov == m.nesterov and runs[-1].hi == lo and \
                (lo != self.block.aligned_end or lo == 0)
            if same:
                runs[-1] = runs[-1]._replace(hi=hi)
            else:
                runs.append(Run(lo, hi, m.momentum, m.nesterov))
        return runs

    # the flat buffers, made at first use (a launch that goes in place needs none)
    @cached_property
    def g(self):
        """The launch's gradients, flat: what the memory update reads."""
        return torch.zeros(self.total, dtype=self.dtype, device=self.device)

    @cached_property
    def update(self):
        """The launch's average, flat (update.py FlatUpdate, ViewUpdate)."""
        return torch.empty(self.total, dtype=self.dtype, device=self.device)

    @cached_property
    def g_views(self):
        return [self.members[i].shaped(self.g[self.offsets[i]:self.offsets[i]
                                              + self.members[i].numel])
                for i in self.dense_grads]

    @cached_property
    def update_views(self):
        return [m.shaped(self.update[o:o + m.numel]) if f else None
                for o, m, f in zip(self.offsets, self.members, self.flat)]

    def views(self, tensor):
        """Does ``tensor`` lie in this layout's update buffer?"""
        if "update" not in self.__dict__:
            return False
        start = self.update.data_ptr()
        return start <= tensor.data_ptr() < start + self.total * self.update.element_size()

    def range_of(self, index):
        """The flat range the consecutive members at ``index`` cover (in the memory
        block: up to the next member, padding included)."""
        first, last = index[0], index[-1]
        lo = self.offsets[first]
        block = self.block
        if block is not None and last < len(block.keys):
            hi = block.offsets[last + 1] if last + 1 < len(block.keys) else block.total
        else:
            hi = self.offsets[last] + self.members[last].numel
        return lo, hi


class Launch:
    """One launch: its layout, this step's place (step, density, names) and, once
    started, each path's part and handle; with delay or period, what this rank sent."""

    def __init__(self, layout, name, at):
        self.layout, self.name = layout, name
        self.block = layout.block
        self.step, self.density, self.rank = at.step, at.density, at.rank
        self.guarded = False   # this step may be undone: memory written beside the old
        self.ks = ()
        self.poison = None     # per member: a device flag, this rank's was not finite
        self.sparse = []       # per sparse-gradient member: (indices, values)
        self.scale = at.scale  # GradScaler's scale, multiplied back into the update
        self.own = None        # flat: what this rank sent (delay, period)
        self.started = []      # [(path, part, handle)] in launch order
        self.local = not at.exchanging
        self.in_place = False  # Horovod's allreduce of the gradients (paths.InPlacePath.takes)

    @property
    def params(self):
        return tuple(m.param for m in self.layout.members)

    @property
    def g(self):
        return self.layout.g


class StepPlace(NamedTuple):
    """Where a launch is: what every launch of one step shares."""

    step: int
    density: float
    rank: int
    exchanging: bool      # False on a step between exchanges (period > 1)
    keeps_own: bool       # delay > 0 or period > 1: what this rank sent is kept
    scale: object         # GradScaler's scale (a tensor), or None
    name_suffix: str      # keeps the names of steps in flight at once apart


class GradientExchange:
    """Launches, advances and collects the collectives of a step's launches, on flat
    buffers; holds the memory (FlatMemory) and one instance of every path."""

    def __init__(self, resolved, planner, wire, stats, guard, members, hyper, scale,
                 sparse_as_dense, world):
        self.resolved, self.planner, self.guard = resolved, planner, guard
        self.config = resolved.config
        self.compressor = resolved.compressor
        self.members = members            # {param: Member}
        self.hyper = hyper                # param -> (momentum, nesterov, weight_decay)
        self.scale = scale                # param -> what its gradient is multiplied by
        self.sparse_as_dense = sparse_as_dense
        self.world = world                # callable: the world size now
        self.memory = FlatMemory(self.config.momentum_masking)
        self.counters = StepCounters()
        ctx = PathContext(wire, self.compressor, self.memory, stats,
                          self.config.momentum_masking, resolved.dense_fp16, self.counters)
        self.paths = make_paths(ctx)
        self.in_place = InPlacePath(ctx)
        self.stats = stats
        self._layouts = OrderedDict()  # the latest layouts (and their buffers), kept
        self._viewing = {}  # param -> the layout whose update buffer its grad views

    # -- launch -----------------------------------------------------------------------
    def launch(self, params, at, name):
        """Start the collectives of ``params`` (one launch per device and buffer dtype
        among them, in order); returns the ``Launch``es."""
        launches = []
        groups = groupby(params, key=lambda p: (p.device, buffer_dtype(p.dtype)))
        for n, (_, group) in enumerate(groups):
            launches.append(self._launch(tuple(group), at, name if not n else f"{name}.{n}"))
        return launches

    def _launch(self, params, at, name):
        members = [self.members[p]._replace(**dict(zip(
            ("momentum", "nesterov", "weight_decay"), self.hyper(p)))) for p in params]
        kinds = tuple(PathKind.SPARSE_GRAD if self._sparse_grad(m.param)
                      else self.planner.path(m.info, at.density, at.step) for m in members)
        layout = self._layout(members, kinds, params[0])
        launch = Launch(layout, name + at.name_suffix, at)
        launch.ks = tuple(self.planner.k(m.info, at.density) for m in layout.members)
        if self.in_place.takes(layout, at, self.config.clip_norm, self.guard.mode,
                               self.scale):
            self.in_place.start(launch)
            self.stats.add_launches(1)
            return launch
        if layout.sparse_grads:
            self._sparse_payloads(launch, at)
        block = layout.block
        wants = block is not None and layout.aligned and not launch.local and getattr(
            self.compressor, "wants_block_max", lambda d: False)(block.v.device)
        sources = self._direct(launch, at, wants)
        if sources is None:
            self._gather(launch, at)
        guarding = self.guard.before_accumulate(self.memory, launch)
        if block is not None:
            with torch.no_grad():
                self.memory.accumulate(block, launch.g, layout.runs, with_block_max=wants,
                                       sources=sources)
        self.guard.accumulated(launch, guarding)
        if launch.local:  # a step between exchanges: this rank steps with its own velocity
            launch.own = self.memory.increment(block, launch.g, layout.runs) \
                if block is not None else launch.g.clone()
        else:
            if at.keeps_own:
                launch.own = torch.zeros_like(launch.g)
            self._start(launch)
        self.guard.launched(launch, guarding)
        return launch

    def _direct(self, launch, at, wants):
        """The gradients to read where they lie (FlatMemory.accumulate's ``sources``),
        or None to copy them into the launch's flat buffer first: reading them saves a
        pass over them where nothing else needs them flat (no clipping, no loss scale,
        neither a step between exchanges nor tensors whose path reads the gradient
        itself, and the guard's flags come from the block maxima)."""
        layout = launch.layout
        if layout.block is None or launch.local or at.scale is not None or \
                self.config.clip_norm is not None or self.guard.mode == "drop" or \
                layout.reads_gradient or layout.sparse_grads:
            return None
        if self.guard.mode == "skip" and layout.checked and not wants:
            return None
        grads = [m.param.grad for m in layout.members]
        params = [m.param for m in layout.members]
        decays = [m.weight_decay for m in layout.members]
        scales = [self.scale(p) for p in params]
        if not self.memory.direct(layout.block, grads, params, decays, scales):
            return None
        return grads, params, decays, scales

    def _sparse_grad(self, p):
        return p.grad is not None and p.grad.is_sparse and not self.sparse_as_dense

    def _layout(self, members, kinds, first):
        key = (tuple(m.key for m in members), kinds,
               tuple((m.momentum, m.nesterov, m.weight_decay) for m in members))
        layout = self._layouts.get(key)
        if layout is None:
            layout = Layout(members, kinds, self.memory, first.device,
                            buffer_dtype(first.dtype))
            self._layouts[key] = layout
            while len(self._layouts) > _LAYOUTS_KEPT * len(self.members) + 8:  # (a schedule)
                self._layouts.popitem(last=False)
        else:
            self._layouts.move_to_end(key)
        return layout

    def _gather(self, launch, at):
        """This step's gradients into the launch's flat buffer, unscaled, clipped and
        weight-decayed: a fixed number of operations whatever the number of tensors."""
        layout = launch.layout
        if not layout.dense_grads:
            return
        grads = []
        for i in layout.dense_grads:
            p = layout.members[i].param
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            # sparse_as_dense (Horovod's meaning): a dense allreduce, here through DGC
            grads.append(p.grad.to_dense() if p.grad.is_sparse else p.grad)
        torch._foreach_copy_(layout.g_views, grads)
        if at.scale is not None:
            launch.g.div_(at.scale)
        params = [layout.members[i].param for i in layout.dense_grads]
        prepare_gradients(layout.g_views, params, self.config.clip_norm, self.world(),
                          layout.decay, [self.scale(p) for p in params])

    def _sparse_payloads(self, launch, at):
        """A sparse gradient travels as Horovod sends it: its indices and values,
        allgathered; DGC's memory never sees it. Coalesced first (a batch that looks a
        row up twice sends it once)."""
        for i in launch.layout.sparse_grads:
            m = launch.layout.members[i]
            if at.keeps_own:
                raise ValueError(
                    f"hvd_dgc: parameter '{m.name}' has a sparse gradient (e.g. "
                    f"nn.Embedding(sparse=True)) and {self.config.lagging}: delayed "
                    f"averaging and temporally sparse updates need dense gradients. Pass "
                    f"sparse_as_dense=True to DistributedOptimizer, or "
                    f"{self.config.undo_lagging}.")
            g = coalesce_in_order(m.param.grad)
            if at.scale is not None:
                g = g / at.scale
            launch.sparse.append((g.indices().t().contiguous(), g.values()))

    def _start(self, launch):
        """Each path's part, started in one order on every rank (a path may carry
        another's tensors where that is cheaper: ``absorb``)."""
        layout = launch.layout
        parts = {}
        for kind, index in layout.parts:
            lo, hi = layout.range_of(index)
            parts[kind] = Part(kind, launch, tuple(layout.members[i] for i in index), index,
                               lo, hi, tuple(launch.ks[i] for i in index), launch.own)
        for kind in ORDER:
            if kind in parts:
                parts = self.paths[kind].absorb(parts, self.planner)
        for kind in ORDER:
            if kind in parts:
                path = self.paths[kind]
                launch.started.append((path, parts[kind], path.launch(parts[kind])))
        self.stats.add_launches(len(launch.started))

    # -- advance, collect ----------------------------------------------------------------
    @staticmethod
    def advance(launches):
        """Second rounds (PowerSGD's Q, region reduce's gather, hierarchical's cross-host
        records) start on every launch before any is waited on, so no rank can wait on
        one that another rank has not started."""
        for launch in launches:
            for path, _, handle in launch.started:
                path.advance(handle)

    def collect(self, launch, into_grads=False, views=False):
        """Wait for one launch: its average through an update target (update.py), and
        the sparse gradients' averages as ``[(member, sparse tensor)]``. ``into_grads``
        (a synchronous step): straight into the gradients where they can take it;
        ``views`` (a step that synchronized itself): the gradients become views of the
        launch's buffer, which is zeroed only where it was written."""
        layout = launch.layout
        self._check_views(layout)
        if launch.in_place:
            out = InPlaceUpdate(layout, self.guard.mode == "skip")
        elif views and launch.scale is None and ViewUpdate.fits(layout):
            out = ViewUpdate(layout)
        elif into_grads and launch.scale is None and GradUpdate.fits(layout):
            out = GradUpdate(layout)
        else:
            out = FlatUpdate(layout)
        sparse = []
        for path, _, handle in launch.started:
            averages = path.collect(handle, out)
            if averages is not None:  # a sparse gradient's average replaces the flat one
                sparse += averages
        out.finish()
        return out, sparse

    def _check_views(self, layout):
        """A gradient a ViewUpdate left viewing a layout's buffer that still does was
        written to since (backward after ``zero_grad(set_to_none=False)``, an average
        copied in): that buffer is no longer zero where its record says."""
        for i in layout.dense_grads:
            p = layout.params[i]
            owner = self._viewing.pop(p, None)
            if owner is not None and p.grad is not None and owner.views(p.grad):
                owner.written = None

    # -- gradients back ---------------------------------------------------------------
    def write(self, launch, out, scale=None):
        """``p.grad`` of the launch's parameters from the update ``out`` (a GradUpdate
        wrote them already), in their dtype (times GradScaler's ``scale``, the space
        ``unscale_`` expects): one copy for all of them."""
        if isinstance(out, (GradUpdate, InPlaceUpdate)):
            return
        layout, flat = launch.layout, out.buffer
        if isinstance(out, ViewUpdate):
            for i in layout.dense_grads:
                p, view = layout.params[i], layout.update_views[i]
                if p.grad is not view:
                    p.grad = view
                self._viewing[p] = layout
            return
        if flat is layout.update and scale is None:
            views = layout.update_views
        else:
            flat = flat if scale is None else flat * scale
            views = [m.shaped(flat[o:o + m.numel]) if i in layout.dense_grads else None
                     for i, (o, m) in enumerate(zip(layout.offsets, layout.members))]
        sources, targets = [], []
        for i in layout.dense_grads:
            p, view = layout.params[i], views[i]
            if p.grad is None:
                p.grad = view.to(p.dtype, copy=True)
            elif p.grad.is_sparse:  # sparse_as_dense: a sparse gradient again
                p.grad = view.to(p.dtype).to_sparse()
            else:
                sources.append(view)
                targets.append(p.grad)
        if targets:
            torch._foreach_copy_(targets, sources)

    def own_views(self, launch):
        """``{param: flat view}`` of what this rank sent in ``launch`` (delay, period)."""
        layout = launch.layout
        return {layout.members[i].param: launch.own[layout.offsets[i]:layout.offsets[i]
                                                   + layout.members[i].numel]
                for i in layout.dense_grads}

    def corrections(self, launch):
        """``avg - own`` of a launch whose average is due (the delayed average replaces
        this rank's own contribution), or ``-own`` for a step between exchanges; flat,
        its layout."""
        if launch.local:
            return launch.own.neg()
        out, _ = self.collect(launch)
        return out.buffer.sub_(launch.own)

    # -- checkpoints ---------------------------------------------------------------------
    def residual(self, param):
        """``param``'s residual (a flat view, in its memory order), or None before its
        first step."""
        return self.memory.residual(self.members[param].key)

    def seed_velocity(self, param, u):
        """Start ``param``'s memory momentum at ``u`` (``param``'s shape, any strides)."""
        m = self.members[param]
        self.memory.seed_velocity(m.key, m.flat(u))

    def rescale(self, param, ratio):
        """Multiply ``param``'s memory momentum and residual by ``ratio`` (its shape)."""
        m = self.members[param]
        self.memory.rescale(m.key, m.flat(ratio))

    def memory_state(self):
        """The memory's per-tensor entries with each flat in its parameter's row-major
        order: what checkpoints hold, whatever memory format the model had."""
        return self._reorder(self.memory.state_dict(),
                             lambda m, t: m.shaped(t).contiguous().view(-1))

    def load_memory_state(self, state):
        """``memory_state``'s entries, in each parameter's memory order again."""
        return self._reorder(state, lambda m, t: m.flat(t.view(m.shape)))

    def _reorder(self, state, how):
        by_key = {m.key: m for m in self.members.values() if m.order is not None}
        return {key: {name: (how(by_key[key], t) if key in by_key and t is not None
                             else t) for name, t in entry.items()}
                for key, entry in state.items()}
