"""Gradient memory for PyTorch: what stays behind on this worker between steps.

DGC (Lin et al., ICLR 2018, Sec. 3.2) accumulates the *velocity*, not the raw
gradient, so that momentum survives sparsification ("momentum correction"):

    u <- m * u + g          v <- v + u                     (plain momentum)
    u <- m * (u + g)        v <- v + u + g                 (Nesterov, reference form)

and after ``v[sent]`` leaves, zeroes ``v[sent]`` and ``u[sent]`` ("momentum
factor masking": the momentum of a coordinate just applied is stale). With
``m = 0`` this is plain error feedback (residual accumulation).

On the dense path every coordinate is sent every step, so nothing is stale:
``v`` is cleared and ``u`` kept. DGC at density 1 is then exactly momentum
SGD, ``avg(u)`` being the dense momentum buffer. (Masking there would zero
the momentum every step and silently turn momentum SGD into plain SGD.)

Flat: the tensors that leave together (one launch) keep ``u`` and ``v`` in one flat
buffer each (a ``MemoryBlock``), every tensor's slice starting at a multiple of
``BLOCK`` elements (zeros between, which never pass a threshold). So the memory's work
is a fixed number of operations per launch, whatever the number of tensors: on a GPU
each operation is a kernel launch, and per-tensor work is what doubled a ResNet-50 step
on an H100 (bench/results/gpu_dgc.md). Views give each tensor its slice; checkpoints
keep one entry per tensor. When the tensors that leave together change (a warm-up
stage moves one from the dense path to the sparse one), their slices move into the new
block, once.

Buffers are float32 (float64 for float64 parameters) whatever the parameter's dtype: a
float16 residual would lose the small values DGC exists to keep.

On the sparse path the update also yields the block maxima of ``|v|`` that the
selection scans (cpu_select.py). On CPU float32 the optional C++ kernel
(csrc/fused_memory.cpp) does both in one pass over the buffers instead of four;
elsewhere eager PyTorch does the same maths.
"""

from typing import NamedTuple

import torch

try:
    from hvd_dgc.torch import _fused_memory
except ImportError:  # not built (no compiler at install time): eager PyTorch
    _fused_memory = None

__all__ = ["FlatMemory", "MemoryBlock", "Run", "local_gradient", "prepare_gradients",
           "block_abs_max", "BLOCK", "fused_kernel_available", "buffer_dtype"]

BLOCK = 32  # elements per block of the selection's block maxima (== the kernel's)


def fused_kernel_available():
    return _fused_memory is not None


def block_abs_max(flat):
    """max |flat| over each full block of ``BLOCK`` elements (max and -min: no |flat| copy)."""
    blocks = flat[:flat.numel() // BLOCK * BLOCK].view(-1, BLOCK)
    return torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg_())


def buffer_dtype(param_dtype):
    return torch.float64 if param_dtype == torch.float64 else torch.float32


def aligned_size(numel):
    """``numel`` rounded up to whole blocks: an aligned slice's footprint."""
    return -(-numel // BLOCK) * BLOCK


def prepare_gradients(views, params, clip_norm=None, world_size=1, weight_decay=(),
                      scales=None):
    """The gradients a worker feeds into its memory, in place on ``views`` (each
    tensor's slice of a flat buffer, shaped as its parameter): clipped, then
    weight-decayed, then multiplied by ``scales`` (per view, a tensor or None: Adam's
    frozen preconditioner, hvd_dgc/adam.py). A fixed number of operations for any
    number of tensors.

    Local clipping (DGC Sec. 3.3) clips each worker's gradient *before*
    accumulation, with the global threshold scaled by N^-1/2 (each worker holds
    1/N of the summed gradient's variance), per tensor. Weight decay follows
    clipping, as in ``clip_grad_norm_`` followed by ``SGD(weight_decay=...)``.
    ``weight_decay``: ``[(decay, positions)]`` of the tensors it applies to.
    """
    if clip_norm is not None and views:
        limit = clip_norm / (world_size ** 0.5)
        norms = torch.stack(torch._foreach_norm(views))
        clipped = (limit / (norms + 1e-6)).clamp_(max=1.0)
        torch._foreach_mul_(views, clipped.unbind())
    for decay, positions in weight_decay:
        torch._foreach_add_([views[i] for i in positions],
                            [params[i].detach() for i in positions], alpha=decay)
    if scales is not None:
        scaled = [i for i, s in enumerate(scales) if s is not None]
        if scaled:
            torch._foreach_mul_([views[i] for i in scaled], [scales[i] for i in scaled])


def local_gradient(grad, param, weight_decay=0.0, clip_norm=None, world_size=1):
    """One tensor's ``prepare_gradients``, flat (tests and benchmarks)."""
    g = grad.reshape(-1).to(buffer_dtype(param.dtype), copy=True)
    prepare_gradients([g], [param.reshape(-1)], clip_norm, world_size,
                      [(weight_decay, [0])] if weight_decay else ())
    return g


class Run(NamedTuple):
    """A range of a block whose tensors share the memory's hyper-parameters."""

    lo: int
    hi: int
    momentum: float
    nesterov: bool


class MemoryBlock:
    """``u`` and ``v`` of the tensors of one launch, flat, in the order of ``keys``. The
    first ``aligned`` tensors (the sparse ones: their selection scans blocks) start at
    multiples of BLOCK, zeros between; the rest follow packed."""

    def __init__(self, keys, numels, aligned, device, dtype):
        self.keys, self.numels = tuple(keys), tuple(int(n) for n in numels)
        self.offsets, total = [], 0
        for i, n in enumerate(self.numels):
            self.offsets.append(total)
            total += aligned_size(n) if i < aligned else n
            if i + 1 == aligned:
                self.aligned_end = total
        if not aligned:
            self.aligned_end = 0
        self.aligned = aligned
        self.total, self.device, self.dtype = total, device, dtype
        self.index = {key: i for i, key in enumerate(self.keys)}
        self.v = torch.zeros(total, dtype=dtype, device=device)
        self.u = None
        self.block_max = None   # max |v| per BLOCK of the aligned part, after an update
        self.previous = None    # (u, v) before a step that may be undone (snapshot)
        self.stale = []         # ranges of v that mean zero, not cleared yet (clear_later)
        self.previous_stale = []
        # the tensors (indices) whose v reads zero: never written, or sent whole since
        # (the dense path); nothing of DGC's is pending for them
        self.zero = set(range(len(self.keys)))
        self.previous_zero = set()

    def clear_later(self, sent, lo, hi):
        """``v[lo:hi]`` (``sent``) left this worker whole, in place (the dense path): it
        means zero from now on. It is not cleared: where the next ``accumulate`` rewrites
        the whole block it reads zeros instead of it (one pass over the model fewer than
        clearing); anything else that reads ``v`` settles it first."""
        if sent.numel() == hi - lo and hi > lo and \
                sent.data_ptr() == self.v[lo:hi].data_ptr():
            self.stale.append((lo, hi))
        else:  # (not this v's: cleared now)
            sent.zero_()
        self.zeroed(lo, hi)

    def zeroed(self, lo, hi):
        """``v[lo:hi]`` reads zero now: the tensors it covers whole join ``zero``."""
        self.zero.update(i for i, (a, n) in enumerate(zip(self.offsets, self.numels))
                         if lo <= a and a + n <= hi)

    def settle(self):
        """Clears what ``clear_later`` left: before ``v`` is read other than by
        ``accumulate``."""
        for lo, hi in self.stale:
            self.v[lo:hi].zero_()
        self.stale = []

    def stale_whole(self, stale):
        """Do the ranges ``stale`` cover all of v (each coordinate once)?"""
        end = 0
        for lo, hi in sorted(stale):
            if lo != end:
                return False
            end = hi
        return end == self.total

    def span(self, i):
        return self.offsets[i], self.offsets[i] + self.numels[i]

    def slice_of(self, buffer, i):
        lo, hi = self.span(i)
        return buffer[lo:hi]

    def momentum_buffer(self):
        if self.u is None:
            self.u = torch.zeros_like(self.v)
        return self.u


class StepUndo:
    """A step that may be undone (skip_nonfinite, guard.py): the blocks it wrote beside
    their old buffers, then kept (``commit``) or put back (``rollback``)."""

    def __init__(self):
        self._guarded = []    # blocks whose step may be undone (snapshot)
        self._spare = {}      # id(block) -> (u, v) the next guarded step writes into

    def forget(self, block):
        """``block`` left the memory: its spare buffers go with it."""
        self._spare.pop(id(block), None)

    def snapshot(self, block):
        """Keep ``block`` as it is, so a step that ends up skipped can be undone. Costs
        no copy: the step's update is written beside the old buffers (into spare ones,
        allocated once), ``commit`` keeps the new ones, ``rollback`` the old."""
        if block.previous is not None:
            return
        block.previous = (block.u, block.v)
        block.previous_stale, block.stale = block.stale, []
        block.previous_zero = set(block.zero)
        spare = self._spare.pop(id(block), None)
        if spare is None:
            spare = (None if block.u is None else torch.zeros_like(block.u),
                     torch.zeros_like(block.v))
        u, v = spare
        if block.u is not None and u is None:
            u = torch.zeros_like(block.u)
        block.u, block.v = (u if block.u is not None else None), v
        self._guarded.append(block)

    def rollback(self):
        """Undo every change since the snapshots (the step was skipped)."""
        for block in self._guarded:
            self._spare[id(block)] = (block.u, block.v)
            block.u, block.v = block.previous
            block.previous, block.stale, block.previous_stale = None, block.previous_stale, []
            block.zero = block.previous_zero
        self._guarded = []

    def commit(self):
        for block in self._guarded:
            self._spare[id(block)] = block.previous
            block.previous, block.previous_stale = None, []
        self._guarded = []


class FlatMemory:
    """Momentum correction, momentum factor masking and error feedback, per launch block.

    Args:
        momentum_masking: zero the momentum of sent coordinates: True (the paper's
            default), False (the momentum keeps pushing coordinates already sent), or
            "auto" (the exchange decides per step; hvd_dgc/masking.py).
    """

    def __init__(self, momentum_masking=True):
        self.momentum_masking = momentum_masking
        self.blocks = {}      # (keys, aligned) -> MemoryBlock
        self._where = {}      # key -> the block holding it
        self._loaded = {}     # key -> {"u", "v"} from a checkpoint, not placed in a block yet
        self.undo = StepUndo()  # a guarded step's blocks, kept or put back (guard.py)

    # -- blocks ---------------------------------------------------------------------
    def block(self, keys, numels, aligned=0, device="cpu", dtype=torch.float32):
        """The block of ``keys`` (in this order; the first ``aligned`` at block
        boundaries), made on first use; the keys' slices move into it from wherever
        they were (another block, a checkpoint)."""
        keys = tuple(keys)
        block = self.blocks.get((keys, aligned))
        if block is not None:
            return block
        block = MemoryBlock(keys, numels, aligned, device, dtype)
        for i, key in enumerate(keys):
            old = self._where.get(key)
            if old is not None:
                old.settle()
                j = old.index[key]
                self._place(block, i, old.slice_of(old.v, j),
                            None if old.u is None else old.slice_of(old.u, j))
                self._where[key] = block
                self._forget(old)
            elif key in self._loaded:
                saved = self._loaded.pop(key)
                self._place(block, i, saved["v"], saved["u"])
            self._where[key] = block
        self.blocks[(keys, aligned)] = block
        return block

    def _place(self, block, i, v, u):
        block.slice_of(block.v, i).copy_(v.reshape(-1))
        block.zero.discard(i)
        if u is not None:
            block.slice_of(block.momentum_buffer(), i).copy_(u.reshape(-1))

    def _forget(self, block):
        """A block none of whose keys is still in it goes."""
        if all(self._where.get(k) is not block for k in block.keys):
            self.blocks.pop((block.keys, block.aligned), None)
            self.undo.forget(block)

    # -- one step ---------------------------------------------------------------------
    def accumulate(self, block, g, runs, with_block_max=False, sources=None):
        """Fold one step's local gradients (``g``: flat, the block's layout) into the
        memory over ``runs`` (which cover the block); returns ``v``. ``with_block_max``:
        also ``block.block_max`` over the aligned part (max |v| of every BLOCK elements),
        in the same pass where the kernel can. After ``snapshot`` the update is written
        into other buffers, the old ones kept for ``rollback``.

        ``sources``: ``(grads, params, decays, scales)`` per tensor of the block, read
        where they lie instead of ``g`` (the kernel: ``g_i = (grad_i + decay_i * p_i) *
        scale_i``, no copy into a flat buffer first; see ``direct``)."""
        src_u, src_v = block.previous if block.previous is not None else (block.u, block.v)
        block.zero.clear()  # (the dense path's send marks its tensors again)
        src_v = self._stale_source(block, src_v, sources is not None or _fused(g))
        if sources is not None:
            return self._accumulate_from(block, sources, runs, with_block_max, src_u, src_v)
        v = block.v
        # the kernel wherever it is built, block maxima or not: a tensor's update is then
        # the same arithmetic whichever launch and range it is in (eager PyTorch may fuse
        # a multiply-add where the kernel does not)
        fused = _fused(g, v)
        if with_block_max:
            size = block.aligned_end // BLOCK
            if block.block_max is None or block.block_max.numel() != size:
                block.block_max = v.new_empty(size)
        for run in runs:
            lo, hi, m = run.lo, run.hi, run.momentum
            u = block.momentum_buffer() if m else block.u
            su = src_u if src_u is not None else u
            if fused:
                maxima = block.block_max[lo // BLOCK:hi // BLOCK] \
                    if with_block_max and hi <= block.aligned_end else None
                torch.ops.hvd_dgc.accumulate(
                    g[lo:hi], (su if m else src_v)[lo:hi], src_v[lo:hi],
                    (u if m else v)[lo:hi], v[lo:hi], float(m), bool(run.nesterov), maxima)
                if not m and u is not None and su is not u:  # a guarded step: carry u
                    u[lo:hi].copy_(su[lo:hi])
            else:
                _accumulate_eager(g, su, src_v, u, v, lo, hi, m, run.nesterov)
        if with_block_max and not fused:
            block.block_max = block_abs_max(v[:block.aligned_end])
        return v

    @staticmethod
    def _stale_source(block, src_v, fused):
        """The ``v`` the update reads: where all of it means zero (``clear_later``) and
        the kernel runs, none (an empty tensor: the kernel reads zeros); else ``src_v``,
        its stale ranges cleared first. A guarded step keeps the old v's ranges for
        ``rollback``; otherwise the update rewrites every coordinate of v."""
        guarded = block.previous is not None
        stale = block.previous_stale if guarded else block.stale
        if not stale:
            return src_v
        if fused and _fused(src_v) and block.stale_whole(stale):
            if not guarded:
                block.stale = []
            return src_v.new_empty(0)
        for lo, hi in stale:
            src_v[lo:hi].zero_()
        stale.clear()
        return src_v

    def _accumulate_from(self, block, sources, runs, with_block_max, src_u, src_v):
        grads, params, decays, scales = sources
        none = grads[0].new_empty(0)  # a tensor's "no scale" (the kernel's schema: a list)
        v = block.v
        if with_block_max:
            size = block.aligned_end // BLOCK
            if block.block_max is None or block.block_max.numel() != size:
                block.block_max = v.new_empty(size)
        for run, (members, offsets, decay) in zip(runs, _run_members(block, runs, decays)):
            m = run.momentum
            u = block.momentum_buffer() if m else block.u
            su = src_u if src_u is not None else u
            maxima = block.block_max if with_block_max and run.hi <= block.aligned_end \
                else None
            torch.ops.hvd_dgc.accumulate_from(
                [grads[i] for i in members], [params[i] for i in members],
                [none if scales[i] is None else scales[i] for i in members]
                if any(scales[i] is not None for i in members) else [], offsets, decay,
                1.0, su if m else src_v, src_v, u if m else v, v, float(m),
                bool(run.nesterov), maxima, run.lo, run.hi)
            if not m and u is not None and su is not u:  # a guarded step: carry u over
                u[run.lo:run.hi].copy_(su[run.lo:run.hi])
        return v

    @staticmethod
    def direct(block, grads, params, decays, scales):
        """Can ``accumulate`` read these tensors where they lie (``sources``)? The kernel
        is built and every one is a contiguous float32 CPU tensor (the parameters where
        they decay, the scales where there are)."""
        def fits(t):
            return t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu"
        return _fused_memory is not None and block.dtype == torch.float32 and \
            block.device.type == "cpu" and all(
                g is not None and not g.is_sparse and fits(g) for g in grads) and all(
                fits(p) for p, d in zip(params, decays) if d) and all(
                fits(s) and s.shape == g.shape for s, g in zip(scales, grads)
                if s is not None)

    @staticmethod
    def increment(block, g, runs):
        """What the last ``accumulate`` added to ``v`` (a copy, flat): this rank's own
        velocity for the step, which a step between exchanges applies (``period > 1``):
        ``u`` (plain momentum), ``u + g`` (Nesterov), ``g`` (none)."""
        if len(runs) == 1:
            run = runs[0]
            if not run.momentum:
                return g.clone()
            return block.u + g if run.nesterov else block.u.clone()
        out = g.clone()
        for run in runs:
            if run.momentum:
                us = block.u[run.lo:run.hi]
                if run.nesterov:
                    out[run.lo:run.hi].add_(us)
                else:
                    out[run.lo:run.hi].copy_(us)
        return out

    @staticmethod
    def take(block, positions, masked=None):
        """The values at ``positions`` (flat, the block's), which leave this worker: their
        ``v`` is cleared, and the momentum of ``masked`` (None: none; True: all of them;
        else those positions) too. One pass over the positions where the kernel is
        built (they are scattered over the buffer)."""
        if _fused(block.v) and positions.device.type == "cpu" and masked in (None, True):
            u = block.u if masked is True else None
            return torch.ops.hvd_dgc.take(block.v, u, positions)
        values = block.v[positions]
        FlatMemory.sent(block, positions, positions if masked is True else masked)
        return values

    @staticmethod
    def sent(block, positions, masked=None):
        """The coordinates at ``positions`` (flat, the block's) left this worker: their
        ``v`` is cleared, and the momentum of ``masked`` (None: none) too."""
        block.v.index_fill_(0, positions, 0)
        if masked is not None and block.u is not None:
            block.u.index_fill_(0, masked, 0)

    @staticmethod
    def sent_range(block, lo, hi):
        """Every coordinate of ``[lo, hi)`` left this worker (dense path): clear ``v``,
        keep ``u``."""
        block.v[lo:hi].zero_()
        block.zeroed(lo, hi)

    @staticmethod
    def give_back(block, positions, values):
        """Add ``values`` at ``positions`` into the residual: what an aggregation took
        but did not deliver (region reduce's owner keeps what it did not send on), so
        error feedback sends it later."""
        block.v.index_add_(0, positions, values.to(block.v.dtype))
        block.zero.clear()

    # -- per tensor: checkpoints, tests --------------------------------------------------
    def residual(self, key):
        """``key``'s residual ``v`` (a view), or None before its first step."""
        block = self._where.get(key)
        if block is None:
            saved = self._loaded.get(key)
            return None if saved is None else saved["v"]
        block.settle()
        block.zero.discard(block.index[key])  # (a view: whoever has it may write it)
        return block.slice_of(block.v, block.index[key])

    def velocity(self, key):
        """``key``'s momentum ``u`` (a view), or None."""
        block = self._where.get(key)
        if block is None or block.u is None:
            return None
        return block.slice_of(block.u, block.index[key])

    def seed_velocity(self, key, u):
        """Start ``key``'s momentum at ``u`` (flat): an optimizer's own momentum handed
        over to the memory (Adam's first moment at the freeze, hvd_dgc/adam.py)."""
        block = self._where.get(key)
        if block is not None:
            block.slice_of(block.momentum_buffer(), block.index[key]).copy_(u)
            return
        saved = self._loaded.setdefault(key, {"u": None, "v": torch.zeros_like(u)})
        saved["u"] = u.clone()

    def rescale(self, key, ratio):
        """Multiply ``key``'s momentum and residual by ``ratio`` (flat): the space they
        are held in moved (Adam's preconditioner refreshed, hvd_dgc/adam.py)."""
        block = self._where.get(key)
        if block is not None:
            block.settle()
            for buffer in (block.u, block.v):
                if buffer is not None:
                    block.slice_of(buffer, block.index[key]).mul_(ratio)
            return
        for t in self._loaded.get(key, {}).values():
            if t is not None:
                t.mul_(ratio)

    def keys(self):
        return list(self._where) + [k for k in self._loaded if k not in self._where]

    def state_dict(self):
        """One entry per tensor, ``{key: {"u": flat or None, "v": flat}}``: the format
        of every hvd_dgc checkpoint, whatever blocks the tensors were in."""
        out = {key: {"u": None if self.velocity(key) is None else self.velocity(key).clone(),
                     "v": self.residual(key).clone()} for key in self._where}
        for key, saved in self._loaded.items():
            out.setdefault(key, {"u": saved["u"], "v": saved["v"]})
        return out

    def load_state_dict(self, state, device_of=None):
        """Per-tensor entries; each goes into its block when that is next used."""
        self.blocks, self._where, self.undo = {}, {}, StepUndo()
        self._loaded = {}
        for key, s in state.items():
            device = None if device_of is None else device_of(key)
            self._loaded[key] = {
                "u": None if s["u"] is None else s["u"].to(device, copy=True),
                "v": s["v"].to(device, copy=True)}


def _accumulate_eager(g, su, src_v, u, v, lo, hi, m, nesterov):
    """The memory's update over ``[lo, hi)`` in PyTorch operations (no kernel built, or
    not a CPU): two or three kernels on a GPU. A buffer the run covers whole (a dense
    tensor's own launch, a block of one run) is taken as it is, no view made."""
    def cut(t):
        return t if t is None or (lo == 0 and t.numel() == hi) else t[lo:hi]
    g, su, src_v, u, v = cut(g), cut(su), cut(src_v), cut(u), cut(v)
    if m and nesterov:
        torch.add(su, g, out=u)
        u.mul_(m)
        torch.add(src_v, u, out=v)
        v.add_(g)
    elif m:
        torch.add(g, su, alpha=m, out=u)  # u = m u + g
        torch.add(src_v, u, out=v)
    else:
        torch.add(src_v, g, out=v)
        if u is not None and su is not u:  # a guarded step: carry u over
            u.copy_(su)


def _run_members(block, runs, decays):
    """Per run, its tensors (positions in the block), their offsets and decays as the
    kernel takes them: made once per block, runs and decays."""
    key = (tuple(runs), tuple(decays))
    cache = block.__dict__.setdefault("_run_members", {})
    out = cache.get(key)
    if out is None:
        out = []
        for run in runs:
            members = [i for i, o in enumerate(block.offsets) if run.lo <= o < run.hi]
            out.append((members, torch.tensor([block.offsets[i] for i in members]),
                        torch.tensor([decays[i] for i in members], dtype=torch.float32)))
        cache.clear()  # one assignment at a time (a schedule may change decays)
        cache[key] = out
    return out


def _fused(*tensors):
    return _fused_memory is not None and all(
        t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()
        for t in tensors)
