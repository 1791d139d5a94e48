"""Where a launch's average is written: the launch's flat buffer, or the gradients.

A path's ``collect`` writes its tensors' average through one of these, by ranges and
positions of the launch's flat layout (exchange.py), and never asks which:

    out.zero(lo, hi)             the range will receive records
    out.add(positions, values)   records added (in record order: the same sums bit for
                                 bit whichever target)
    out.assign(lo, hi, values)   a range's values as they are (dense, per tensor)

``FlatUpdate`` writes into the launch's flat buffer; the exchange then copies it into the
gradients (one operation), and delayed averaging keeps it (``avg - own``).
``GradUpdate`` writes straight into the parameters' gradients (synchronous steps on a
CPU, float32 gradients, with the kernel library built): no flat buffer to copy out
of, a pass over the model saved.
``ViewUpdate`` (a step that synchronizes itself: nothing can touch the gradients
between the average and the step) writes into the launch's flat buffer, kept zero but
where it was last written, and the gradients become its views: a sparse average costs
its records, not a pass over the model to zero the gradients first, and a step linear
in the average (SGD's, frozen Adam's) can run where it is not zero only
(``step_at_records``).
``InPlaceUpdate``: the average is in the gradients already (paths.py ``InPlacePath``:
Horovod's allreduce ran on them in place); nothing is written, the guard looks.

Each keeps ``check``: the sum of every value written, a device scalar whose finiteness
is what the non-finite guard reads (guard.py: one read-back per step, and no pass over
the whole update: a poisoned payload makes its own values infinite).
"""

from typing import NamedTuple

import torch

from hvd_dgc.torch.compression import add_in_order
from hvd_dgc.torch.memory import fused_kernel_available

__all__ = ["FlatUpdate", "GradUpdate", "InPlaceUpdate", "ViewUpdate", "SCATTERED",
           "step_at_records", "write_sparse"]

#: positions per element beyond which a pass over the buffer (a memset, a dense step)
#: costs less than touching the positions one by one (measured on ResNet-50's shapes,
#: bench/step_overhead.py: at the warm-up's density 0.0625 the positions cost 2x)
SCATTERED = 1 / 32


class _Update:
    def __init__(self, layout):
        self.layout = layout
        self._sums = []

    def _checked(self, values):
        self._sums.append(values.sum(dtype=torch.float32 if values.dtype != torch.float64
                                     else torch.float64))
        return values

    def finish(self):
        """Every path has written its part (the exchange calls this once)."""

    def check(self):
        """The sum of everything written (non-finite iff something written was)."""
        if not self._sums:
            return torch.zeros((), device=self.layout.device)
        return torch.stack(self._sums).sum() if len(self._sums) > 1 else self._sums[0]


class FlatUpdate(_Update):
    """The average in the launch's flat buffer (``layout.update``)."""

    def __init__(self, layout):
        super().__init__(layout)
        self.buffer = layout.update
        layout.written = None  # written all over: a ViewUpdate zeroes it all first

    def zero(self, lo, hi):
        self.buffer[lo:hi].zero_()

    def add(self, positions, values):
        add_in_order(self.buffer, positions, self._checked(values.to(self.buffer.dtype)))

    def assign(self, lo, hi, values):
        self.buffer[lo:hi] = self._checked(values.reshape(-1))


class Written(NamedTuple):
    """Where a ViewUpdate wrote its buffer: records' positions (tensors) and ranges
    assigned (``(lo, hi)``)."""

    positions: list
    ranges: list

    def count(self):
        return sum(p.numel() for p in self.positions)

    def flat_positions(self):
        return torch.cat(self.positions) if len(self.positions) > 1 else self.positions[0]


class ViewUpdate(_Update):
    """The average in the launch's flat buffer, which the gradients then view.

    The buffer is zero but where the last ViewUpdate wrote (``layout.written``, a
    ``Written``; None when unknown: after a FlatUpdate, or when a gradient still
    viewing it was written to, which the exchange checks before each collect), so only
    those are zeroed; and not those this update assigns whole (a dense path's range is
    rewritten every step: clearing it first would be a pass over it for nothing). The
    clearing waits for the first records added, or for ``finish``."""

    def __init__(self, layout):
        super().__init__(layout)
        self.buffer = buffer = layout.update
        last = layout.written
        # what to clear (a Written: the last records' positions, ranges), None once done
        if last is None or last.count() > SCATTERED * buffer.numel():
            self._stale = Written([], [(0, buffer.numel())])
        else:
            self._stale = Written(list(last.positions), list(last.ranges))
        self.written = layout.written = Written([], [])

    def _clear_positions(self):
        if self._stale.positions:
            self.buffer.index_fill_(0, self._stale.flat_positions(), 0)
            self._stale.positions.clear()

    def _settle(self):
        """Zero what the last update left and this one has not assigned."""
        if self._stale is None:
            return
        self._clear_positions()
        for lo, hi in self._stale.ranges:
            self.buffer[lo:hi].zero_()
        self._stale = None

    def finish(self):
        self._settle()

    @staticmethod
    def fits(layout):
        """Every gradient dense, in the buffer's dtype, on its device (its view can be
        the gradient)."""
        return all((p := layout.members[i].param).dtype == layout.dtype and
                   p.device == layout.device and
                   (p.grad is None or not p.grad.is_sparse) for i in layout.dense_grads)

    def zero(self, lo, hi):
        """Zero already (``add`` settles first)."""

    def add(self, positions, values):
        self._settle()
        add_in_order(self.buffer, positions, self._checked(values.to(self.buffer.dtype)))
        self.written.positions.append(positions)

    def assign(self, lo, hi, values):
        if self._stale is not None:  # [lo, hi) is rewritten: no need to clear it first
            self._clear_positions()  # (few; cleared now, as they may lie in it)
            self._stale.ranges[:] = [piece for a, b in self._stale.ranges
                                     for piece in ((a, min(b, lo)), (max(a, hi), b))
                                     if piece[0] < piece[1]]
        self.buffer[lo:hi] = self._checked(values.reshape(-1))
        self.written.ranges.append((lo, hi))

    def sparse_members(self):
        """The members only records were added to (none assigned): those a linear step
        can apply where the records are (``step_at_records``), in member order."""
        layout = self.layout
        return [i for i in layout.dense_grads
                if not any(lo < layout.offsets[i] + layout.members[i].numel
                           and layout.offsets[i] < hi for lo, hi in self.written.ranges)]

    def positions(self, numel):
        """Every position a record was added at, once (sorted); None when there are
        more than SCATTERED of ``numel`` (a dense pass is cheaper)."""
        if self.written.count() > SCATTERED * numel:
            return None
        if not self.written.positions:
            return torch.empty(0, dtype=torch.long, device=self.buffer.device)
        return torch.unique(self.written.flat_positions())


class GradUpdate(_Update):
    """The average written into the launch's gradients (``p.grad``) where they lie."""

    def __init__(self, layout):
        super().__init__(layout)
        self.grads = [layout.members[i].param.grad for i in layout.dense_grads]
        self.starts = [layout.offsets[i] for i in layout.dense_grads]
        self.numels = [layout.members[i].numel for i in layout.dense_grads]
        self._starts = torch.tensor(self.starts, dtype=torch.long)

    @staticmethod
    def fits(layout):
        """The kernel library built (it writes) and every gradient a contiguous float32
        CPU tensor."""
        return fused_kernel_available() and all(
            (p := layout.members[i].param).grad is not None and not p.grad.is_sparse
            and p.grad.dtype == torch.float32 and p.grad.is_contiguous()
            and p.grad.device.type == "cpu" for i in layout.dense_grads)

    def _within(self, lo, hi):
        return [j for j, (s, n) in enumerate(zip(self.starts, self.numels))
                if s < hi and s + n > lo]

    def zero(self, lo, hi):
        torch._foreach_zero_([self.grads[j] for j in self._within(lo, hi)])

    def add(self, positions, values):
        torch.ops.hvd_dgc.index_add_list(self.grads, self._starts, positions,
                                         self._checked(values.float()))

    def assign(self, lo, hi, values):
        values = self._checked(values.reshape(-1))
        within = self._within(lo, hi)
        sizes = [self.numels[j] for j in within]
        gaps = [self.starts[j] - (self.starts[within[i - 1]] + self.numels[within[i - 1]])
                if i else self.starts[j] - lo for i, j in enumerate(within)]
        if any(gaps):  # (aligned tensors: zeros between; dense ranges are packed)
            pieces = [values[self.starts[j] - lo:self.starts[j] - lo + self.numels[j]]
                      for j in within]
        else:
            pieces = values.split(sizes)
        torch._foreach_copy_([self.grads[j].view(-1) for j in within], list(pieces))


class InPlaceUpdate(_Update):
    """The average already in the gradients (paths.py ``InPlacePath``: Horovod's
    allreduce ran on them in place); only the guard's sums are taken, where it looks."""

    def __init__(self, layout, checked):
        super().__init__(layout)
        self.checked = checked

    def arrived(self, grads):
        if not self.checked:
            return
        if fused_kernel_available() and all(
                g.dtype == torch.float32 and g.is_contiguous() and g.device.type == "cpu"
                for g in grads):
            self._sums.append(torch.ops.hvd_dgc.finite_flag(grads))  # 0, or NaN
        else:
            for g in grads:
                self._checked(g)


def write_sparse(sparse, scale=None):
    """Sparse gradients' averages (``[(member, sparse tensor)]``, a path's ``collect``) as
    the parameters' gradients (times GradScaler's ``scale``); returns the parameters
    (the base optimizer steps them on their own: no memory applied their momentum)."""
    params = set()
    for m, avg in sparse:
        if scale is not None:
            avg = avg * scale
        m.param.grad = avg.to(m.param.dtype)
        params.add(m.param)
    return params


def step_at_records(updates, alphas):
    """``p += alphas[p] * p.grad`` where a ViewUpdate's records landed, for the
    parameters of ``alphas`` whose average came only as records; returns those stepped.
    Elsewhere the average is zero, so a linear step adds nothing there (SGD's with its
    momentum taken over, frozen Adam's: sgd.py, adam.py): one kernel call per launch,
    the multiply-add of torch's own kernel, where the dense step would pass over every
    weight and gradient. Not where records reach more than SCATTERED of the elements,
    nor off a CPU or float32 (the kernel's)."""
    stepped = set()
    if not fused_kernel_available():
        return stepped
    for out in updates:
        layout = out.layout
        index = [i for i in out.sparse_members() if layout.params[i] in alphas]
        params = [layout.params[i] for i in index]
        if not params or out.buffer.dtype != torch.float32 or any(
                p.device.type != "cpu" or p.dtype != torch.float32 or not p.is_contiguous()
                for p in params):
            continue
        positions = out.positions(sum(p.numel() for p in params))
        if positions is None:
            continue  # records nearly everywhere: the dense step's pass is cheaper
        if positions.numel():
            with torch.no_grad():
                torch.ops.hvd_dgc.sgd_sparse_step(
                    params, torch.tensor([layout.offsets[i] for i in index]), positions,
                    out.buffer, torch.tensor([alphas[p] for p in params],
                                             dtype=torch.float64))
        stepped.update(params)
    return stepped
