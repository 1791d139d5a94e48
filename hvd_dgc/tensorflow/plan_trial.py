"""Keras: the cost model's plan tried against every tensor dense, by the step's own time
(issue 33, item 2).

The cost model's sums (communication at the probe's rates plus DGC's calibrated work)
choose each tensor's path; PyTorch then tries the step's timeline against them
(hvd_dgc/overlap.py, with a hook per gradient). A traced TF step has no hook per gradient,
and its selection and packing compete with the backward pass and Horovod's transfers for
the same cores, which no sum sees: on these machines a Keras step at density 0.001 sent
sparse made 0.59x stock Horovod at 10 Gbit/s where its dense plan made 1.02x
(bench/results/never_slower.md, stop 62). So where the sums' plan sends some tensor
sparse at a density, both it and the all-dense plan run ``TRIAL_STEPS`` steps of
``fit`` (the first of each settles: a new trace, Horovod negotiating new names), timed
whole between batches by hvd_dgc's callback (keras/callbacks.py ``_StepTimer``), the
ranks agree the slower rank's times (one small allreduce between batches, every rank at
the same batch), and the sparse plan is kept only where it made the step
``TRIAL_MARGIN`` faster than dense: compression must pay for itself. Each density of the
warm-up is tried once; a link the watch finds changed (``Planner.relink``) clears the
verdicts, and they are tried again on the new numbers. Every switch changes the traced
step, so ``fit`` traces it again (at most three times a density).
"""

import horovod.tensorflow as _hvd

from hvd_dgc.overlap import TRIAL_MARGIN, TRIAL_STEPS, PlanTrial, sums_send_sparse
from hvd_dgc.plan_words import PlanWords
from hvd_dgc.switch import change_line, percent
from hvd_dgc.tensorflow.seam import HorovodCollectives

__all__ = ["DenseTrial"]


class DenseTrial:
    """One Keras optimizer's trials; ``observe(seconds, step)`` after each train step
    returns True where the paths changed (``fit`` must trace its step again)."""

    made = 0  # trials made in this process: each names its collective apart

    def __init__(self, exchange, steps=TRIAL_STEPS, margin=TRIAL_MARGIN):
        self.exchange, self.steps, self.margin = exchange, steps, margin
        DenseTrial.made += 1
        self._name = f"hvd_dgc.plantrial.{DenseTrial.made}"
        self.trial = self._fresh()
        self.decided = {}  # density -> True (all dense kept) or False (the sums' plan)
        self.tried = []    # (density, sums' seconds a step, dense's, "dense" or "sums")
        self.generation = exchange.planner.generation
        self._sums_words = ""  # the sums' plan of the trial running, in words

    def _fresh(self):
        """PlanTrial's two slots: the sums' plan, then the alternative, kept where it is
        not ``margin`` slower (a negative margin): here the alternative is all dense."""
        return PlanTrial(self.steps, -self.margin)

    def _force(self, density, on):
        changed = self.exchange.force_dense(density, on)
        self.generation = self.exchange.planner.generation
        return changed

    def observe(self, seconds, step):
        planner = self.exchange.planner
        if planner.generation != self.generation:  # the link watch moved the basis:
            self.decided = {}                       # its forced plans were cleared too
            self.trial = self._fresh()
            self.generation = planner.generation
        density, _ = self.exchange.priced_now()  # the next step's
        trial = self.trial
        action = trial.end_step(seconds, density, lambda: density not in self.decided and
                                sums_send_sparse(planner, density))
        if action == "timeline":  # the sums' steps are done: all dense for as many
            self._sums_words = PlanWords(planner).sparse_words(trial.density)
            return self._force(trial.density, True)
        if action == "sums":  # a new density began meanwhile: back to the sums' plan
            return self._force(trial.density, False)
        if action != "agree":
            return False
        agreed = HorovodCollectives(self.exchange.process_set).max(trial.timed, self._name)
        dense = trial.decide(agreed, density)
        self.trial = self._fresh()
        if dense is None:  # the density moved while the times travelled: try it again
            return self._force(trial.density, False)
        self.decided[trial.density] = dense
        sums, alone = trial.means
        self.tried.append((trial.density, sums, alone, "dense" if dense else "sums"))
        changed = False if dense else self._force(trial.density, False)
        if _hvd.rank() == 0 and not PlanWords(planner).verbose():  # short; a change of plan only
            if dense:
                print(change_line(step, f"every tensor dense at {percent(trial.density)} "
                                        f"({alone * 1e3:.1f} ms a step, sparse "
                                        f"{sums * 1e3:.1f})"), flush=True)
        elif _hvd.rank() == 0:
            print(f"hvd_dgc: at step {step} the cost model's plan ({self._sums_words}) "
                  f"took {sums * 1e3:.1f} ms a step and every tensor dense "
                  f"{alone * 1e3:.1f} ms: "
                  + ("dense kept (sparse must be "
                     f"{self.margin:.0%} faster)" if dense else "the cost model's plan kept")
                  + ("; the step is traced again" if changed else ""), flush=True)
        return changed

    def stats(self):
        return {"plan_trials": [{"density": d, "sums_seconds": s, "dense_seconds": a,
                                 "kept": k} for d, s, a, k in self.tried]}
