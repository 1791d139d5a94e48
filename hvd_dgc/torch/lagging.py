"""What a step does not wait for: delayed averaging, temporally sparse updates, and the
launches still in flight.

Delayed gradient averaging (``delay=D``; Zhu et al., NeurIPS 2021) keeps the
collectives of the last D steps in flight: step i waits only for step i-D's, and
applies ``own_i - own_(i-D) + avg_(i-D)``: this rank's own contribution now, and the
average of the step launched D steps ago in place of what this rank applied for it
then. The correction is applied to the velocity the memory sends (what DGC already
communicates); with SGD, whose update is linear in the gradient, that equals feeding
the corrected gradient to SGD's own momentum (sum_j m^(i-j) (g_j - g_(j-D) +
avg_(j-D)) is the same sum), so one form serves every path.

Temporally sparse updates (``period=p``; Zhu et al., "Distributed Training Across the
World", 2019) exchange every p-th step only. In between each rank steps with its own
velocity (what its memory just took in) and sends nothing; the memory keeps the whole
sum, and the p-th step's exchange sends from it as any step would. When that
exchange's average arrives (at once, or D steps later), it replaces every ``own`` this
rank applied for those p steps: ``avg - sum(own)``. At p = 1 this is the DGA rule, and
at p = 1, D = 0 synchronous training.

``delay="auto"`` (hvd_dgc/autodelay.py) measures compute and waits, and every rank
switches D at the same step, from sums agreed by a non-blocking max-allreduce read a
window later.
"""

import time
from collections import deque
from typing import NamedTuple

import torch
import horovod.torch as _hvd
from horovod.torch.mpi_ops import Max

from hvd_dgc.autodelay import AutoDelayState

__all__ = ["Lagging", "InFlight"]


class InFlight(NamedTuple):
    """One step's launches (local ones on a step between exchanges), waiting for the
    step at which the exchange that covers them is applied."""

    due: int        # the optimizer step that applies its average
    launches: list  # of engine.Launch


class Lagging:
    """The delay in force, the period, and the steps in flight (oldest first)."""

    def __init__(self, config, process_set, start=0, now=None):
        self.start = start          # the first step that may lag (Adam: its freeze)
        self._now = now if now is not None else (lambda: start)  # the optimizer's step
        auto = config.auto_delay
        self.auto = None if auto is None else AutoDelayState(auto)
        self._delay = config.fixed_delay or 0
        self.period = config.period
        self.process_set = process_set
        self.inflight = deque()
        self._period_delay = None  # the delay of the period under way (applied_at)
        self._step_ended = None    # delay="auto": when the last step's wait ended
        self._agreeing = None      # delay="auto": a window's sums, being agreed on

    @property
    def delay(self):
        """The D in force: the fixed one, or delay="auto"'s last decision."""
        return self._delay if self.auto is None else self.auto.delay

    @delay.setter
    def delay(self, value):
        if self.auto is None:
            self._delay = value
        else:
            self.auto.delay = value

    def describe_delay(self):
        if self.auto is None:
            return self.delay
        return f"auto (from {self.auto.config.start}, at most {self.auto.config.max_delay})"

    @property
    def held(self):
        """Before ``start`` every step is synchronous: Adam's exact warm-up (adam.py) is
        not linear in the gradient, so nothing of it may be replaced later."""
        return self._now() < self.start

    @property
    def keeps_own(self):
        """Whether a step applies this rank's own contribution before the average comes."""
        return not self.held and (self.delay > 0 or self.period > 1)

    def name_suffix(self, step):
        """Steps in flight at once need different Horovod names."""
        if not self.keeps_own:
            return ""
        slots = (self.delay if self.auto is None else self.auto.config.max_delay) + 1
        return ".d%d" % (step % slots)

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

    # -- per step ------------------------------------------------------------------------
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

    def gradients(self, engine, launches, due):
        """This step's gradients: ``own`` of its launches, plus ``avg - own`` of every
        launch due (``-own`` for a step between exchanges), one operation per launch.
        ``{param: flat tensor}``."""
        grads = {}
        for launch in launches:
            result = launch.own.clone()
            for i in launch.layout.dense_grads:
                o, m = launch.layout.offsets[i], launch.layout.members[i]
                grads[m.param] = result[o:o + m.numel]
        for launch in due:
            correction = engine.corrections(launch)
            layout = launch.layout
            targets, sources = [], []
            for i in layout.dense_grads:
                o, m = layout.offsets[i], layout.members[i]
                if m.param not in grads:  # a flush: no launch of this step
                    grads[m.param] = torch.zeros(m.numel, dtype=correction.dtype,
                                                 device=correction.device)
                targets.append(grads[m.param])
                sources.append(correction[o:o + m.numel])
            torch._foreach_add_(targets, sources)
        return grads

    def tune(self, step, started, waited):
        """delay="auto": measure this step, and at the end of a window read the previous
        window's agreed sums (long arrived: no wait), decide D from them (every rank the
        same, from this step on), and start agreeing on this window's (max over ranks,
        non-blocking)."""
        auto = self.auto
        if auto is None:
            return
        if self._step_ended is not None:
            auto.observe(started - self._step_ended, waited)
        self._step_ended = time.perf_counter()
        if not auto.window_done():
            return
        sums = torch.tensor(auto.take_window(), dtype=torch.float64)
        if self._agreeing is not None:
            handle, self._agreeing = self._agreeing, None
            auto.decide(tuple(_hvd.synchronize(handle).tolist()), step, self.period)
        self._agreeing = _hvd.allreduce_async(sums, op=Max, process_set=self.process_set,
                                              name="hvd_dgc.autodelay.%d" % (step % 2))
        self._step_ended = time.perf_counter()

    def flushed(self):
        """After a flush: its wait is not a step's compute."""
        self._step_ended = None

    def resume_delay(self, delay):
        """Go on from ``delay`` (a checkpoint's, or rank 0's after an elastic reset); with
        delay="auto", from a fresh window of measurements (the old ones were another
        run's or another world's)."""
        self.delay = delay
        if self.auto is not None:
            self.auto.reset_window()

    def abandon(self, engine):
        """An elastic restore: Horovod must finish what is in flight; its results are
        moot."""
        for entry in self.inflight:
            for launch in entry.launches:
                if launch.local:
                    continue
                try:
                    engine.collect(launch)
                except Exception:  # noqa: BLE001  from a Horovod since shut down (elastic)
                    pass
        self.inflight.clear()
        if self._agreeing is not None:  # delay="auto": a window's agreement, now moot
            try:
                _hvd.synchronize(self._agreeing)
            except Exception:  # noqa: BLE001  from a Horovod since shut down (elastic)
                pass
        self._agreeing, self._step_ended = None, None
