"""The backward pass timed from the hooks, agreed by the ranks and given to the planner;
then the timeline's plan tried against the sums' by the step's own time
(hvd_dgc/overlap.py)."""

import time

import torch
import horovod.torch as _hvd
from horovod.torch.mpi_ops import Max, Sum

from hvd_dgc.overlap import PlanTrial, ProfileRecorder, profile_from, timeline_differs
from hvd_dgc.plan_words import PlanWords
from hvd_dgc.switch import change_line
from hvd_dgc.torch.at_exit import settle_at_exit

__all__ = ["BackwardProfiler"]


class BackwardProfiler:
    """Times the hooks of steps ``SETTLE_STEPS`` on (``hook``), leaving out hvd_dgc's own
    work in them; their sums travel in one non-blocking allreduce at the end of the last
    measured step and are read at the end of the next, where every rank gives the same
    profile to the planner. Then a ``PlanTrial``, its step times agreed the same way (the
    ranks' max). Every switch happens at the end of a step, the same on every rank.
    ``not_before``: the first step the trial may run (an Adam take-over's freeze: before
    it every tensor goes dense, and Adam is exact)."""

    made = 0  # profilers made in this process: each names its allreduces apart

    def __init__(self, planner, process_set, keys, at_end, not_before=0):
        self.recorder = ProfileRecorder()
        self.trial = PlanTrial()
        self.planner, self.process_set = planner, process_set
        self.keys, self.at_end, self.not_before = list(keys), tuple(at_end), not_before
        self._agreeing = None  # the handle of the sums in flight, and what they are
        self._last = None      # when the last step ended
        self.decided_at = None
        BackwardProfiler.made += 1
        self._name = f"hvd_dgc.backward.{BackwardProfiler.made}"
        settle_at_exit(self, BackwardProfiler._settle)

    def hook(self, key, ready, p):
        """``ready(p)`` (the scheduler's hook for the parameter ``p``, the planner's tensor
        ``key``), timed while measuring."""
        recorder = self.recorder
        if not recorder.measuring:
            return ready(p)
        began = time.perf_counter()
        recorder.ready(key, began)
        try:
            return ready(p)
        finally:
            recorder.own(time.perf_counter() - began)

    def end_step(self, step, density):
        """After a step's averages are in (the next step runs on what this decides)."""
        now = time.perf_counter()
        seconds, self._last = (0.0 if self._last is None else now - self._last), now
        recorder, planner = self.recorder, self.planner
        if not recorder.done:
            recorder.end_step()
            if recorder.done:
                self._agree("profile", recorder.totals(self.keys), torch.int64, Sum)
            return
        if self._agreeing is not None:
            what, handle = self._agreeing
            self._agreeing = None
            agreed = _hvd.synchronize(handle).tolist()
            if what == "profile":
                planner.overlapped(profile_from(self.keys, [int(t) for t in agreed],
                                                self.process_set.size(), recorder.steps),
                                   self.at_end)
            else:
                self._decide(agreed, step, density)
                return
        trial = self.trial
        if planner.timeline is None or trial.phase == "decided" or step + 1 < self.not_before:
            return
        action = trial.end_step(seconds, density, lambda: timeline_differs(planner, density))
        if action in ("timeline", "sums"):
            planner.use_timeline(action == "timeline")
        elif action == "agree":
            self._agree("trial", trial.timed, torch.float64, Max)

    def _agree(self, what, values, dtype, op):
        self._agreeing = (what, _hvd.allreduce_async(
            torch.tensor(values, dtype=dtype), op=op, process_set=self.process_set,
            name=f"{self._name}.{what}"))

    def _decide(self, agreed, step, density):
        planner, trial = self.planner, self.trial
        kept = trial.decide(agreed, density)
        planner.use_timeline(bool(kept))
        if kept is None:
            return
        self.decided_at = step + 1
        if _hvd.rank() == 0 and not PlanWords(planner).verbose():  # short; a change of plan only
            sums, timeline = trial.means
            if kept:
                kept = PlanWords(planner).compressed_words(trial.density)
                print(change_line(step + 1, f"timeline plan kept ({timeline * 1e3:.1f} ms a "
                                            f"step, sums' {sums * 1e3:.1f}): {kept}"),
                      flush=True)
        elif _hvd.rank() == 0:
            sums, timeline = trial.means
            plan = planner.timeline.plan(planner, trial.density)
            print(f"hvd_dgc: from step {step + 1}, {planner.timeline.profile.words()}; where the "
                  f"step's timeline (a transfer the backward pass hides costing nothing) "
                  f"sends tensors otherwise than the cost model's sums, both were tried at "
                  f"density {trial.density:g}: {timeline * 1e3:.1f} ms a step on the "
                  f"timeline's paths (predicted to wait {plan.exposed * 1e3:.1f} ms past "
                  f"the backward pass), {sums * 1e3:.1f} ms on the sums': "
                  f"{'the timeline' if kept else 'the sums'} kept: "
                  f"{PlanWords(planner).sparse_words(trial.density)}", flush=True)

    def _settle(self):
        """At exit: the agreement in flight, waited for."""
        if self._agreeing is not None:
            _hvd.synchronize(self._agreeing[1])

    def stats(self):
        trial = self.trial
        out = {"timeline": {"sums": None, "timeline": None, "kept": None,
                            "from": self.decided_at}}
        if self.planner.timeline is not None:
            out["backward_seconds"] = self.planner.timeline.profile.backward
        if trial.means is not None:
            out["timeline"].update(sums=trial.means[0], timeline=trial.means[1],
                                   kept="timeline" if trial.verdict else "sums")
        return out
