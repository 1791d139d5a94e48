"""SGD taken over: DGC's memory applies SGD's momentum and weight decay (momentum
correction, Lin et al. 2018, Sec. 3.2), so the wrapped SGD steps with both off.

With any other optimizer (Adam, AdamW, ...) nothing is taken over: the memory does
error feedback on the raw gradient and the optimizer applies its own update.
"""

from contextlib import contextmanager

import torch

from hvd_dgc.lagging import StepSize
from hvd_dgc.torch.update import step_at_records

__all__ = ["SGDTakeOver"]

_TAKEN_OVER = ("momentum", "weight_decay", "nesterov")


def check_dampening(group):
    if group.get("momentum", 0) and group.get("dampening", 0):
        raise ValueError(f"hvd_dgc: SGD dampening={group['dampening']} is not supported: DGC's "
                         f"momentum correction accumulates u = m*u + g. Use dampening=0.")


class SGDTakeOver:
    """The hyper-parameters the memory applies for each parameter, and the base step
    that leaves them out."""

    def __init__(self, optimizer, active, plain=False):
        self.optimizer, self.active = optimizer, active
        self.plain = active and plain  # torch's own SGD.step: sparse_step may stand in
        self._group_of = {p: g for g in optimizer.param_groups for p in g["params"]}
        if active:
            for group in optimizer.param_groups:
                check_dampening(group)

    def hyper(self, p):
        """``(momentum, nesterov, weight_decay)`` the memory applies for ``p`` (read each
        step: a schedule may change them)."""
        if not self.active:
            return 0.0, False, 0.0
        group = self._group_of[p]
        check_dampening(group)
        return group["momentum"], group["nesterov"], group["weight_decay"]

    @staticmethod
    def stats():
        """Nothing for ``compression_stats()``: SGD has no phases."""
        return {}

    @staticmethod
    def scale(p):
        """SGD's gradient enters the memory as it is."""
        return None

    def step_sizes(self, ahead=True):
        """``{param: StepSize(lr)}``: what the base step multiplies ``p.grad`` by (delayed
        averaging takes each own step back at the size it was applied with:
        hvd_dgc/lagging.py; SGD's weight decay is in the gradient); None where nothing
        is taken over."""
        if not self.active:
            return None
        return {p: StepSize(float(g["lr"])) for p, g in self._group_of.items()}

    @staticmethod
    def freeze_at(step):
        """Nothing to freeze (Adam's take-over does: adam.py)."""

    @staticmethod
    def observe(params, scale=None, world=1):
        """Nothing to track of the local gradients (Adam's refresh does: adam.py)."""

    @contextmanager
    def off(self):
        """The memory applied momentum and weight decay already; the base SGD must not."""
        if not self.active:
            yield
            return
        groups = self.optimizer.param_groups
        saved = [{k: g[k] for k in _TAKEN_OVER} for g in groups]
        try:
            for g in groups:
                g["momentum"], g["weight_decay"], g["nesterov"] = 0.0, 0.0, False
            yield
        finally:
            for g, s in zip(groups, saved):
                g.update(s)

    def correct(self, base_step):
        """Apply the corrections in ``p.grad`` (a flush): ``lr * correction``, the base
        step with momentum and weight decay off."""
        with self.off():
            base_step()

    def step(self, base_step, closure, sparse, updates=()):
        """The wrapped optimizer's step. Parameters whose update is a sparse gradient (no
        memory applied their momentum) step in a second call with SGD's own
        hyper-parameters; each call sees only its own gradients. Parameters whose
        average arrived as records into a ViewUpdate (``updates``) step there only
        (``sparse_step``), not over their whole gradient."""
        stepped = self.sparse_step(updates) if self.plain and closure is None else set()
        if not (self.active and sparse):
            with _grads_hidden(stepped), self.off():
                return base_step(closure)
        with _grads_hidden(sparse | stepped):
            with self.off():
                loss = base_step(closure)
        others = [p for p in self._group_of
                  if p not in sparse and p not in stepped and p.grad is not None]
        with _grads_hidden(others + list(stepped)):
            base_step(None)
        return loss

    def sparse_step(self, updates):
        """SGD's step with momentum and weight decay off (the memory applied them) is
        ``p += -lr * avg``: where a sparse average is zero it adds zero, so it runs at
        the records' positions only (update.step_at_records); returns the parameters
        stepped. At density 0.001 this skips a pass over the model's weights and
        gradients."""
        alphas = {}
        for group in self.optimizer.param_groups:
            lr = float(group["lr"])
            for p in group["params"]:
                alphas[p] = lr if group.get("maximize", False) else -lr
        return step_at_records(updates, alphas)


@contextmanager
def _grads_hidden(params):
    """``p.grad = None`` for ``params`` meanwhile: torch's optimizers skip them."""
    saved = {p: p.grad for p in params}
    try:
        for p in saved:
            p.grad = None
        yield
    finally:
        for p, g in saved.items():
            p.grad = g


def is_sgd(optimizer):
    return isinstance(optimizer, torch.optim.SGD)
