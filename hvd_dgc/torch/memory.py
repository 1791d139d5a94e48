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

Buffers are flat and float32 (float64 for float64 parameters) whatever the
parameter's dtype: a float16 residual would lose the small values DGC exists
to keep.

On the sparse path the update also yields the block maxima of ``|v|`` that the
selection scans (compression.py). On CPU float32 the optional C++ kernel
(csrc/fused_memory.cpp) does both in one pass over the buffers instead of
four; elsewhere eager PyTorch does the same maths (on a GPU a one-kernel Triton
update measured slower than these two kernels: its launch costs more than the
pass it saves, as the update is bound by launches there, not bytes).
"""

import torch

try:
    from hvd_dgc.torch import _fused_memory
except ImportError:  # not built (no compiler at install time): eager PyTorch
    _fused_memory = None

__all__ = ["DGCMemory", "local_gradient", "block_abs_max", "BLOCK", "fused_kernel_available"]

BLOCK = 32  # elements per block of the selection's block maxima (== the kernel's)


def fused_kernel_available():
    return _fused_memory is not None


def block_abs_max(flat):
    """max |flat| over each full block of ``BLOCK`` elements (max and -min: no |flat| copy)."""
    blocks = flat[:flat.numel() // BLOCK * BLOCK].view(-1, BLOCK)
    return torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg_())


def buffer_dtype(param_dtype):
    return torch.float64 if param_dtype == torch.float64 else torch.float32


def local_gradient(grad, param, weight_decay=0.0, clip_norm=None, world_size=1):
    """The gradient a worker feeds into its memory: clipped, then weight-decayed.

    Local clipping (DGC Sec. 3.3) clips each worker's gradient *before*
    accumulation, with the global threshold scaled by N^-1/2 (each worker holds
    1/N of the summed gradient's variance). It is per tensor because the
    gradient is handled as soon as backward produces it. Weight decay follows
    clipping, as in ``clip_grad_norm_`` followed by ``SGD(weight_decay=...)``.
    """
    g = grad.reshape(-1).to(buffer_dtype(param.dtype))
    if clip_norm is not None:
        limit = clip_norm / (world_size ** 0.5)
        scale = (limit / (torch.linalg.vector_norm(g) + 1e-6)).clamp(max=1.0)
        g = g * scale
    if weight_decay:
        g = g.add(param.detach().reshape(-1).to(g.dtype), alpha=weight_decay)
    return g


class DGCMemory:
    """Momentum correction, momentum factor masking and error feedback, per parameter.

    Args:
        momentum_masking: zero the momentum of sent coordinates: True (the paper's
            default), False (the momentum keeps pushing coordinates already sent), or
            "auto" (the optimizer decides per step; hvd_dgc/masking.py).
    """

    def __init__(self, momentum_masking=True):
        self.momentum_masking = momentum_masking
        self.buffers = {}  # key -> {"u": flat tensor or None, "v": flat tensor}
        self._snapshots = {}  # key -> the buffers before this step (None: had none)
        self._spare = {}      # key -> buffers to copy the next snapshot into

    def accumulate(self, key, grad, momentum=0.0, nesterov=False, with_block_max=False):
        """Fold one step's local gradient into the memory; returns ``v`` (what may be
        sent), or ``(v, block_abs_max(v))`` when ``with_block_max``."""
        state = self.buffers.get(key)
        if state is None:
            state = {"u": None, "v": torch.zeros_like(grad)}
            self.buffers[key] = state
        v = state["v"]
        if momentum and state["u"] is None:
            state["u"] = torch.zeros_like(grad)
        u = state["u"]
        kernel_u = u if momentum else v  # the kernel ignores u without momentum
        if with_block_max and _fused(grad, v, kernel_u):
            block_max = v.new_empty(v.numel() // BLOCK)
            _fused_memory.accumulate_block_max(grad, kernel_u, v, float(momentum),
                                               bool(nesterov), block_max)
            return v, block_max
        if momentum:
            if nesterov:
                u.add_(grad).mul_(momentum)
                v.add_(u).add_(grad)
            else:
                torch.add(grad, u, alpha=momentum, out=u)  # u = m u + g, in one pass
                v.add_(u)
        else:
            v.add_(grad)
        return (v, block_abs_max(v)) if with_block_max else v

    def increment(self, key, grad, nesterov=False):
        """What the last ``accumulate(key, grad, ...)`` added to ``v`` (a copy): this
        rank's own velocity for the step, which a step between exchanges applies
        (``period > 1``): ``u`` (plain momentum), ``u + g`` (Nesterov), ``g`` (none)."""
        u = self.buffers[key]["u"]
        if u is None:
            return grad.clone()
        return u + grad if nesterov else u.clone()

    def sent(self, key, indices, mask_momentum=None):
        """The coordinates at ``indices`` left this worker (sparse path). Their momentum is
        zeroed if ``mask_momentum`` (default: the ``momentum_masking`` setting; the
        optimizer decides per step, as "auto" depends on the density: masking.py)."""
        state = self.buffers[key]
        state["v"].index_fill_(0, indices, 0)
        if mask_momentum is None:
            mask_momentum = self.momentum_masking is not False
        if mask_momentum and state["u"] is not None:
            state["u"].index_fill_(0, indices, 0)

    def give_back(self, key, indices, values, like):
        """Add ``values`` at ``indices`` into ``key``'s residual: what an aggregation took
        but did not deliver (region reduce's owner keeps what it did not send on), so
        error feedback sends it later. ``like``: a flat tensor shaped as the buffer."""
        state = self.buffers.get(key)
        if state is None:
            state = {"u": None, "v": torch.zeros_like(like)}
            self.buffers[key] = state
        state["v"].index_add_(0, indices, values.to(state["v"].dtype))

    def sent_all(self, key):
        """Every coordinate left this worker (dense path): clear ``v``, keep ``u``."""
        self.buffers[key]["v"].zero_()

    def snapshot(self, key):
        """Keep ``key``'s buffers as they are, so a step that ends up skipped can be undone:
        the step works on copies made into spare buffers (two copies, no allocation after
        the first step); ``commit`` keeps the copies, ``rollback`` the originals."""
        state = self.buffers.get(key)
        if state is None or key in self._snapshots:
            self._snapshots.setdefault(key, state)
            return
        spare = self._spare.pop(key, None)
        work = {}
        for name, t in state.items():
            s = None if spare is None else spare.get(name)
            if t is None:
                work[name] = None
            elif s is not None and s.shape == t.shape and s.dtype == t.dtype \
                    and s.device == t.device:
                work[name] = s.copy_(t)
            else:
                work[name] = t.clone()
        self._snapshots[key] = state
        self.buffers[key] = work

    def rollback(self):
        """Undo every change since the snapshots (the step was skipped)."""
        for key, saved in self._snapshots.items():
            changed = self.buffers.pop(key, None)
            if saved is not None:
                self.buffers[key] = saved
                if changed is not None:
                    self._spare[key] = changed
        self._snapshots = {}

    def commit(self):
        for key, saved in self._snapshots.items():
            if saved is not None:
                self._spare[key] = saved
        self._snapshots = {}

    def residual(self, key):
        state = self.buffers.get(key)
        return None if state is None else state["v"]

    def state_dict(self):
        return {key: {"u": s["u"], "v": s["v"]} for key, s in self.buffers.items()}

    def load_state_dict(self, state, device_of=None):
        self.buffers, self._snapshots, self._spare = {}, {}, {}
        for key, s in state.items():
            move = (lambda t: t) if device_of is None else (lambda t, d=device_of(key): t.to(d))
            self.buffers[key] = {"u": None if s["u"] is None else move(s["u"].clone()),
                                 "v": move(s["v"].clone())}


def _fused(*tensors):
    return _fused_memory is not None and all(
        t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()
        for t in tensors)
