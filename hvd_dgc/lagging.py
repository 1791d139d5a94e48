"""When each step's average is applied: delayed averaging and temporally sparse updates,
written once for both frameworks (the collectives stay theirs: hvd_dgc/torch/delayed.py,
hvd_dgc/tensorflow/delayed.py).

Delayed averaging (``delay=D``; Zhu et al., NeurIPS 2021) applies step i's average D
steps later, in place of the own contribution this rank applied for it. Temporally
sparse updates (``period=p``; Zhu et al., "Distributed Training Across the World",
2019) exchange every p-th step only; the steps between apply this rank's own velocity,
and the exchange's average replaces all of them when it is applied. So every step
leaves an entry (its launches: an exchange's collectives, or a local step's own update)
that is due at its period's exchange plus the D in force when the period began::

    exchanges_now(s)   s < start, or (s + 1) % p == 0      (the same step on every rank)
    applied_at(s)      the period's exchange + D
    push(s, x)         x joins the queue, due no earlier than the entry before it
    due(s)             the entries whose average step s applies (oldest first)

At p = 1 this is the DGA rule, and at p = 1, D = 0 synchronous training. Steps before
``start`` (Adam's exact warm-up, not linear in the gradient) exchange every step.

Each entry is taken back at the step size it was applied with. The optimizer turns an
update into a displacement at this step's rate (SGD: ``lr``; Adam taken over: ``lr /
(1 - beta1^t)``), which a schedule or Adam's count moves between a step and the one that
takes it back, and AdamW's decoupled decay shrinks that displacement at every step after
it (``x <- (1 - lr wd) x`` before each update). An own step applied at ``a_s`` and taken
back at ``a_t`` would leave ``(a_s prod(1 - lr_j wd) - a_t) own_s`` with its rank, so the
ranks would agree after an exchange only up to that (measured: 5e-2 on a 2-rank MLP
frozen at step 3). So each entry keeps its step's ``StepSize``, and its correction enters
the due step's update times

    take_back = a_s / a_t * prod_{s < j <= t} (1 - lr_j wd)

so every own step leaves exactly (to rounding), and an exchange's average moves the
weights as it would have at its own step, decayed since, as a synchronous run's would.
"""

import math
from collections import deque
from typing import NamedTuple

from hvd_dgc.say import rank0_warn

__all__ = ["InFlight", "LagQueue", "StepSize", "ZERO_RATE", "take_back"]


class InFlight(NamedTuple):
    """One step's launches (local ones on a step between exchanges), waiting for the
    step at which the exchange that covers them is applied."""

    due: int        # the optimizer step that applies its average
    launches: list  # the framework's: launches, or futures of corrections
    size: object = None  # its step's StepSize (the framework's: per parameter or per
    #                      tensor); None: the same as the step that takes it back


class StepSize(NamedTuple):
    """How a step turned its update into a displacement: ``rate`` times it (SGD's
    ``lr``, frozen Adam's ``lr / (1 - beta1^t)``), and ``log_decay``, the sum of
    ``log(1 - lr wd)`` over the decoupled weight decays to this step's, included (only
    differences count)."""

    rate: float
    log_decay: float = 0.0


def take_back(then, now):
    """The factor on an entry's correction: its step's ``StepSize`` against the one of
    the step that applies it (1.0 where either is unknown or they are equal, or the rate
    now is 0: a step of size 0 moves nothing, so what it should take back stays:
    ``ZERO_RATE``)."""
    if then is None or now is None or then == now or not now.rate:
        return 1.0
    return then.rate / now.rate * math.exp(now.log_decay - then.log_decay)


#: Said once where a step of size 0 (a schedule's learning rate 0) is to take back own
#: steps applied at another size.
ZERO_RATE = ("hvd_dgc: the learning rate is 0 at a step that takes back this rank's own "
             "steps (delay/period), applied at a non-zero rate: they stay with this rank "
             "until a flush (optimizer.flush()) averages the weights.")


class LagQueue:
    """The period, and the steps in flight (oldest first). ``delay``: the D in force (a
    subclass's attribute or property: delay="auto" changes it)."""

    delay = 0
    _said_zero_rate = False

    def __init__(self, period=1, start=0):
        self.period, self.start = int(period), int(start)
        self.inflight = deque()
        self._period_delay = None  # the delay of the period under way (applied_at)

    def exchanges_now(self, step):
        """Every ``period``-th step exchanges (the same step on every rank, as ``step``
        is; it comes back with checkpoints and elastic commits), and every step before
        ``start``."""
        return step < self.start or (step + 1) % self.period == 0

    def applied_at(self, step):
        """The step that applies the average covering ``step``: the period's exchange,
        ``delay`` steps after it (the delay in force when the period began: a change by
        delay="auto" waits for the next period, so a period's steps stay together)."""
        if step % self.period == 0 or self._period_delay is None:
            self._period_delay = self.delay
        return step + (-(step + 1)) % self.period + self._period_delay

    def push(self, step, launches, size=None):
        """This step's launches join those in flight (first in, first applied: a D lowered
        by delay="auto" waits for the older ones); ``size``: the step size this step
        applies them at."""
        after = self.inflight[-1].due if self.inflight else -1
        self.inflight.append(InFlight(max(self.applied_at(step), after), launches, size))

    def take_back(self, then, now):
        """``take_back`` of one entry's size against ``now``'s, saying ``ZERO_RATE`` once
        where a rate of 0 is to take back a step applied at another."""
        if then is not None and now is not None and not now.rate and then.rate \
                and not self._said_zero_rate:
            self._said_zero_rate = True
            rank0_warn(ZERO_RATE, RuntimeWarning)  # (the same schedule on every rank)
        return take_back(then, now)

    def due(self, step, flush=False):
        """The entries whose averages this step applies (``flush``: all of them), oldest
        first."""
        out = []
        while self.inflight and (flush or self.inflight[0].due <= step):
            out.append(self.inflight.popleft())
        return out
