"""What the backward pass hides, and each tensor's path chosen by the time the step
takes rather than by the sum of its transfers (issue 33, item 2).

Horovod's allreduce runs on its own thread while the backward pass goes on: a tensor
whose gradient is ready ``h`` seconds before the backward pass ends has ``h`` seconds of
compute to hide its transfer behind. DGC's selection and packing run in the hook, on
the training thread: they hide nothing, and they push every later gradient, and the end
of the backward pass, later. The link carries one transfer at a time, in the order the
tensors leave (Horovod's one background thread). So, in seconds after the backward
pass's own end, the step's exchange ends at::

    L_i     = L_{i-1} + local_i            DGC's work on the training thread so far
    start_i = max(L_i - h_i, end_{i-1})    ready (later by that work), and the link free
    end_i   = start_i + comm_i
    exposed = max(end_last, L_last)        what the step waits past its own compute

A path launched at ``synchronize`` (``Candidate.at_end``: region reduce on a CPU, every
launch on an accelerator with a sparse compressor) is ready at the end, ``h = 0``.

``choose_paths`` goes through the tensors in the order their gradients are ready and
gives each the candidate that ends the exchange so far soonest (greedy: a dense transfer
the backward pass hides costs nothing, the one that cannot be hidden costs its time, and
a sparse path always costs its work; equal times keep the candidates' order). The
profile, each tensor's ``h``, is measured by the framework over a few steps in a clock
that leaves out hvd_dgc's own hook work (``ProfileRecorder``), and agreed by the ranks
(their mean, one small allreduce), so every rank plans alike.

The timeline is a model, and a model of a machine: where the transfers and DGC's work
compete for the same cores (training on CPUs, two ranks on two cores), a transfer the
backward pass "hides" still slows it. So the timeline proposes and the step's own time
decides (``PlanTrial``): at the first density where its plan differs from the one the
cost model's sums chose (weighed by ``dense_preference``, which stood in for the
overlap), each plan runs ``TRIAL_STEPS`` steps, the ranks agree the slower rank's times
(max), and the timeline's plan is kept only where it made the step ``TRIAL_MARGIN``
faster. Whether a trial has anything to try is asked of the planner's plan:
``timeline_differs`` (the timeline's plan against the sums'), ``sums_send_sparse``
(the sums' plan against all dense, Keras' trial by the step's own time).
"""

from typing import NamedTuple

from hvd_dgc.paths import PathKind

__all__ = ["Candidate", "BackwardProfile", "OverlapPlan", "Timeline", "choose_paths",
           "exchange_ends",
           "ProfileRecorder", "profile_from", "PlanTrial", "SETTLE_STEPS", "PROFILE_STEPS",
           "TRIAL_STEPS", "TRIAL_MARGIN", "DECIDED_BY_STEP", "sums_send_sparse",
           "timeline_differs"]

#: Steps left out before the profile is measured (allocations, Horovod's first
#: negotiations of each name), and steps measured.
SETTLE_STEPS = 2
PROFILE_STEPS = 3
#: Steps each plan runs in a ``PlanTrial``: the first settles (Horovod negotiates the
#: names a new path brings), the others are timed.
TRIAL_STEPS = 5
#: The step from which a job that starts at step 0 runs on the trial's verdict: the profile
#: agreed a step after it is summed, each plan's steps, the verdict read a step later (an
#: Adam take-over's trial starts after its freeze). Benchmarks that time the paths a long
#: job runs on warm up this long.
DECIDED_BY_STEP = SETTLE_STEPS + PROFILE_STEPS + 1 + 2 * TRIAL_STEPS + 1
#: How much faster the timeline's plan must make the step to be kept.
TRIAL_MARGIN = 0.03


class Candidate(NamedTuple):
    """One way a tensor may travel: the path, its transfer's seconds on the link, DGC's
    own work for it on the training thread, and whether it leaves at ``synchronize``
    (after the backward pass) rather than from its hook."""

    path: object
    comm: float
    local: float = 0.0
    at_end: bool = False


class BackwardProfile(NamedTuple):
    """Seconds of backward compute after each tensor's gradient is ready (``hide``, by
    the planner's tensor key), the backward pass's length from the first gradient to
    the last, and the steps measured (agreed: the ranks' mean)."""

    hide: dict
    backward: float
    steps: int

    def words(self):
        return (f"the backward pass measured: {self.backward * 1e3:.1f} ms from the first "
                f"gradient to the last (mean of {self.steps} steps over the ranks)")


class OverlapPlan(NamedTuple):
    """``paths``: the path of each tensor key; ``exposed``: the predicted seconds the
    step waits for its exchange past its own compute."""

    paths: dict
    exposed: float


class Timeline:
    """The agreed ``BackwardProfile`` and the paths the framework launches at synchronize
    (``at_end``): each step's ``OverlapPlan`` on a planner's tensors (``plan``), kept by
    density until the planner's basis moves (``afresh``)."""

    def __init__(self, profile, at_end=()):
        self.profile, self.at_end = profile, frozenset(at_end)
        self._plans = {}

    def afresh(self):
        """The same profile, every plan to be made again (another world or link)."""
        return Timeline(self.profile, self.at_end)

    def plan(self, planner, density):
        """``OverlapPlan`` of the step at ``density``: every tensor of ``planner`` in the
        order its gradient was ready (the profile's ``h``, largest first), small,
        sparse-gradient and hierarchical ones on their fixed path, the others choosing
        among the flat paths, priced by the planner's cost model (its transfers and DGC's
        work, without ``dense_preference``)."""
        plan = self._plans.get(density)
        if plan is not None:
            return plan
        hide = self.profile.hide
        order, candidates = [], {}
        for tensor in sorted(planner.tensors, key=lambda t: -hide.get(t.key, 0.0)):
            if tensor.sliced:
                continue
            seconds = planner.prices.seconds(tensor.numel, planner.k(tensor, density),
                                             planner.allowed(tensor, density))
            order.append((tensor.key, hide.get(tensor.key, 0.0)))
            candidates[tensor.key] = [Candidate(path, comm, local, path in self.at_end)
                                      for path, (comm, local) in seconds.items()]
        plan = self._plans[density] = choose_paths(order, candidates)
        return plan


def _place(work, link, hide, c):
    """One tensor on the timeline: DGC's work so far and the link's end, after ``c`` (a
    ``Candidate``) for a tensor ready ``hide`` seconds before the backward pass ends."""
    work += c.local
    return work, max(work - (0.0 if c.at_end else hide), link) + c.comm


def exchange_ends(order, chosen):
    """The module docstring's timeline: ``order`` is ``[(key, h)]`` in the order the
    gradients are ready, ``chosen`` maps each key to its ``Candidate``. Returns the
    exposed seconds."""
    work, link = 0.0, float("-inf")
    for key, hide in order:
        work, link = _place(work, link, hide, chosen[key])
    return max(link, work) if order else 0.0


def choose_paths(order, candidates):
    """``OverlapPlan`` for ``order`` (``[(key, h)]``, ready order) and ``candidates``
    (key -> ``Candidate``s, in the order of preference on equal time)."""
    work, link, paths = 0.0, float("-inf"), {}
    for key, hide in order:
        best = None
        for c in candidates[key]:
            placed = _place(work, link, hide, c)
            score = max(placed)
            if best is None or score < best[0]:
                best = (score, c, placed)
        _, c, (work, link) = best
        paths[key] = c.path
    return OverlapPlan(paths, max(link, work) if order else 0.0)


class ProfileRecorder:
    """Each step's gradient-ready times, in a clock that leaves out hvd_dgc's own work in
    the hooks (``ready(key, now)`` as a hook begins, ``own(seconds)`` as it ends), turned
    into each tensor's ``h`` at the step's end (``end_step``). Steps ``SETTLE_STEPS`` to
    ``SETTLE_STEPS + PROFILE_STEPS - 1`` are summed; ``done`` says when they have been."""

    def __init__(self, settle=SETTLE_STEPS, steps=PROFILE_STEPS):
        self.settle, self.steps = settle, steps
        self.seen = 0                # steps ended
        self._own = 0.0              # this step's own hook work so far
        self._times = {}             # key -> this step's ready time, own work left out
        self.sums = {}               # key -> summed h over the measured steps
        self.backward = 0.0          # summed first-to-last gradient seconds

    @property
    def measuring(self):
        return self.settle <= self.seen < self.settle + self.steps

    @property
    def done(self):
        return self.seen >= self.settle + self.steps

    def ready(self, key, now):
        if self.measuring:  # (accumulating passes: the last, which launches, counts)
            self._times[key] = now - self._own

    def own(self, seconds):
        self._own += seconds

    def end_step(self):
        if self.measuring and self._times:
            last = max(self._times.values())
            for key, t in self._times.items():
                self.sums[key] = self.sums.get(key, 0.0) + last - t
            self.backward += last - min(self._times.values())
        self._times, self._own = {}, 0.0
        self.seen += 1

    def totals(self, keys):
        """The sums of ``keys``' ``h`` (0 for a tensor never ready in the measured steps)
        and of the backward length, in whole microseconds, to be summed over the ranks:
        integers, so every rank's sum is the same to the last bit, and so its plan."""
        return [int(round(self.sums.get(k, 0.0) * 1e6)) for k in keys] + \
            [int(round(self.backward * 1e6))]


def profile_from(keys, totals, ranks, steps=PROFILE_STEPS):
    """``BackwardProfile`` from ``totals`` (``ProfileRecorder.totals`` summed over
    ``ranks``): the mean over ranks and steps, in seconds."""
    n = 1e6 * ranks * steps
    return BackwardProfile({k: t / n for k, t in zip(keys, totals)}, totals[-1] / n, steps)


class PlanTrial:
    """The sums' plan against the timeline's, by the step's own time (module docstring).

    ``end_step(seconds, density, differs)`` after each step (``differs()``: do the two
    plans differ at ``density``?) returns what the next steps run on: "timeline" or
    "sums" (switch to it), "agree" (both windows done: ``timed`` goes to the ranks' max),
    or None (as they were). ``decide(agreed, density)`` with the agreed sums gives the
    verdict (True: the timeline's plan kept); a density that changed meanwhile voids
    the trial, which waits for the next density where the plans differ."""

    def __init__(self, steps=TRIAL_STEPS, margin=TRIAL_MARGIN):
        self.steps, self.margin = steps, margin
        self.phase = "waiting"   # waiting, sums, timeline, agreeing, decided
        self.density = None      # the density the trial runs at
        self.count = 0
        self.timed = [0.0, 0.0]  # timed seconds on the sums' plan, on the timeline's
        self.verdict = None
        self.means = None        # the agreed mean step of each plan

    def end_step(self, seconds, density, differs):
        if self.phase in ("sums", "timeline") and density != self.density:
            self.phase = "waiting"  # a density stage began: try again where they differ
            return "sums"
        if self.phase == "waiting":
            if differs():
                self.phase, self.density, self.count = "sums", density, 0
                self.timed = [0.0, 0.0]
            return None
        if self.phase not in ("sums", "timeline"):
            return None
        which = 0 if self.phase == "sums" else 1
        self.count += 1
        if self.count > 1:  # (the first settles)
            self.timed[which] += seconds
        if self.count < self.steps:
            return None
        self.count = 0
        if which == 0:
            self.phase = "timeline"
            return "timeline"
        self.phase = "agreeing"
        return "agree"

    def decide(self, agreed, density):
        """``agreed``: the ranks' max of ``timed``. Returns the verdict, or None where the
        density changed while the times travelled (the trial waits again)."""
        if density != self.density:
            self.phase = "waiting"
            return None
        steps = self.steps - 1  # timed of each plan's
        self.means = (agreed[0] / steps, agreed[1] / steps)
        self.verdict = self.means[1] < self.means[0] * (1 - self.margin)
        self.phase = "decided"
        return self.verdict


def sums_send_sparse(planner, density):
    """Does the cost model's sums' plan send some flat tensor sparse at ``density``?
    (Only then is there a dense plan to try against it; a sparse ``aggregation`` the
    script forced has none.)"""
    return planner.resolved.sparse and PathKind.DENSE in planner.flat and any(
        planner.summed_path(t, density) != PathKind.DENSE for t in planner.tensors
        if planner.large(t) and not planner.hierarchical(t))


def timeline_differs(planner, density):
    """Would the step's timeline (``timeline.plan``) send some flat tensor another way
    than the sums do, at ``density``? (Only then is there anything to try.)"""
    if planner.timeline is None or not planner.resolved.sparse:
        return False
    plan = planner.timeline.plan(planner, density).paths
    return any(plan[t.key] != planner.summed_path(t, density) for t in planner.tensors
               if planner.large(t) and not t.sliced and not planner.hierarchical(t))
