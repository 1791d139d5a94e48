"""When each step's average is applied: delayed averaging and temporally sparse updates,
written once for both frameworks (the collectives stay theirs: hvd_dgc/torch/lagging.py,
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
"""

from collections import deque
from typing import NamedTuple

__all__ = ["InFlight", "LagQueue"]


class InFlight(NamedTuple):
    """One step's launches (local ones on a step between exchanges), waiting for the
    step at which the exchange that covers them is applied."""

    due: int        # the optimizer step that applies its average
    launches: list  # the framework's: launches, or futures of corrections


class LagQueue:
    """The period, and the steps in flight (oldest first). ``delay``: the D in force (a
    subclass's attribute or property: delay="auto" changes it)."""

    delay = 0

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

    def push(self, step, launches):
        """This step's launches join those in flight (first in, first applied: a D lowered
        by delay="auto" waits for the older ones)."""
        after = self.inflight[-1].due if self.inflight else -1
        self.inflight.append(InFlight(max(self.applied_at(step), after), launches))

    def due(self, step, flush=False):
        """The launches whose averages this step applies (``flush``: all of them)."""
        out = []
        while self.inflight and (flush or self.inflight[0].due <= step):
            out += self.inflight.popleft().launches
        return out
