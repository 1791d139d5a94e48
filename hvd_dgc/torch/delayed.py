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
at p = 1, D = 0 synchronous training. When each step's entry is due is written once for
both frameworks (hvd_dgc/lagging.py ``LagQueue``); this module adds the delay in force,
the corrections in torch and delay="auto"'s agreement.

``delay="auto"`` (hvd_dgc/autodelay.py) measures compute and waits, and every rank
switches D at the same step, from sums agreed by a non-blocking max-allreduce read a
window later.
"""

import time

import torch
import horovod.torch as _hvd
from horovod.torch.mpi_ops import Max

from hvd_dgc.autodelay import AutoDelayState
from hvd_dgc.lagging import LagQueue

__all__ = ["DelayedAveraging"]


class DelayedAveraging(LagQueue):
    """The delay in force (fixed, or delay="auto"'s), on the shared queue of steps in
    flight (hvd_dgc/lagging.py)."""

    def __init__(self, config, process_set, start=0, now=None):
        super().__init__(config.period, start)  # start: the first step that may lag
        #                                          (Adam: its freeze)
        self._now = now if now is not None else (lambda: start)  # the optimizer's step
        auto = config.auto_delay
        self.auto = None if auto is None else AutoDelayState(auto)
        self._delay = config.fixed_delay or 0
        self.process_set = process_set
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

    # -- per step ------------------------------------------------------------------------
    def gradients(self, exchange, launches, due, sizes=None):
        """This step's gradients: ``own`` of its launches, plus ``avg - own`` of every
        entry due (``-own`` for a step between exchanges), one operation per launch, each
        times its step's size over this one's (``sizes``: ``{param: size}`` now;
        hvd_dgc/lagging.py ``take_back``). ``{param: flat tensor}``."""
        grads = {}
        for launch in launches:
            result = launch.own.clone()
            for i in launch.layout.dense_grads:
                o, m = launch.layout.offsets[i], launch.layout.members[i]
                grads[m.param] = result[o:o + m.numel]
        for entry in due:
            for launch in entry.launches:
                self._add_correction(grads, exchange.corrections(launch), launch.layout,
                                     entry.size, sizes)
        return grads

    def _add_correction(self, grads, correction, layout, then, now):
        targets, sources, factors = [], [], []
        for i in layout.dense_grads:
            o, m = layout.offsets[i], layout.members[i]
            if m.param not in grads:  # a flush: no launch of this step
                grads[m.param] = torch.zeros(m.numel, dtype=correction.dtype,
                                             device=correction.device)
            targets.append(grads[m.param])
            sources.append(correction[o:o + m.numel])
            factors.append(self._factor(then, now, m.param))
        if not targets:
            return
        if len(set(factors)) == 1:
            torch._foreach_add_(targets, sources, alpha=factors[0])
        else:
            torch._foreach_mul_(sources, factors)
            torch._foreach_add_(targets, sources)

    def _factor(self, then, now, param):
        """``take_back`` of one parameter; a learning rate of 0 now cannot take back a
        step applied at another (the step moves nothing): said once, left as it is."""
        if then is None or now is None:
            return 1.0
        return self.take_back(then.get(param), now.get(param))

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

    def only_own(self):
        """Whether what is in flight is only this rank's own steps (between a period's
        exchanges, no collective pending): a checkpoint can take them back alone."""
        return all(launch.local for entry in self.inflight for launch in entry.launches)

    def abandon(self, exchange):
        """An elastic restore: Horovod must finish what is in flight; its results are
        moot."""
        for entry in self.inflight:
            for launch in entry.launches:
                if launch.local:
                    continue
                try:
                    exchange.collect(launch)
                except Exception:  # noqa: BLE001  from a Horovod since shut down (elastic)
                    pass
        self.inflight.clear()
        if self._agreeing is not None:  # delay="auto": a window's agreement, now moot
            try:
                _hvd.synchronize(self._agreeing)
            except Exception:  # noqa: BLE001  from a Horovod since shut down (elastic)
                pass
        self._agreeing, self._step_ended = None, None
