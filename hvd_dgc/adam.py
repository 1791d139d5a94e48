"""Adam and AdamW at DGC's density: exact Adam first, then its second moment frozen.

DGC's momentum correction (Lin et al., ICLR 2018, Sec. 3.2) needs an update linear in
the gradient. Adam's is not: it divides by the root mean square of what arrives, and
error feedback delivers each coordinate in bursts about 1/density steps apart, so its
steps shrink. 1-bit Adam (Tang et al., ICML 2021) runs exact Adam for a warm-up, then
freezes the second moment ``v``; from there Adam is momentum SGD with a fixed diagonal
preconditioner, and error-compensated compression works as it does for SGD. With

    P = 1 / (sqrt(v_T / (1 - beta2^T)) + eps)      v_T, bias-corrected, at the freeze T
                                                   (floored: below)

Adam's ``m <- beta1 m + (1 - beta1) g;  x <- x - lr / (1 - beta1^t) * P m`` is, in the
preconditioned space ``u = P m`` (P is fixed and the same on every rank, so the average
of ``P g_r`` is ``P`` times the average of ``g_r``):

    g' = (1 - beta1) P (g + wd x)     (wd: Adam's L2 weight decay; AdamW's is decoupled)
    u  <- beta1 u + g'                 DGC's memory: u and v, selection, masking
    x  <- x (1 - lr wd_AdamW) - lr / (1 - beta1^t) * average(sent)

At the freeze, ``u`` starts at ``P m_T`` (Adam's first moment, carried over). At density
1 this is Adam with a frozen ``v`` exactly; at DGC's density it is DGC on momentum SGD.

One guard Adam does not need: its ``v`` catches up within a few steps when a quiet
coordinate wakes (a ReLU unit that was dead during the warm-up, ``v = 0``, so ``P =
1/eps``), a frozen one never does, and such a coordinate's first gradients would be
multiplied by up to 1/eps. So the frozen ``v`` of each tensor is floored at
``VARIANCE_FLOOR`` times its mean: no coordinate steps more than 1/sqrt(VARIANCE_FLOOR)
= 10 times the tensor's typical step. (Without it a 4-step warm-up of a ReLU MLP blew up
within two frozen steps.) A tensor with no gradient at all in the warm-up (``v`` = 0
everywhere: a layer used only later) gets the mean ``v`` of the others.

The first ``freeze`` steps exchange dense gradients (exact Adam: its ``v`` is the one
every rank computes from the same averages, so ``P`` is the same everywhere); the
density schedule starts at the freeze, and so do delayed averaging and ``period``
(linear from there: a correction is ``lr / (1 - beta1^t)`` times ``avg - own``, each
own step's at its own step's ``t``: hvd_dgc/lagging.py ``take_back``).

Refreshed (``refresh_variance``; 0/1 Adam, Lu et al., ICLR 2023, refreshes its frozen
variance at rare agreed steps): a ``v`` frozen early goes stale (bench/adam_lm.py, 1,500 steps,
dense: frozen at step 20 ends 4.3% behind dense Horovod, frozen at 200 level with it),
and exact Adam's dense steps are most of a run's bytes. So after the freeze each rank
goes on tracking an estimate of Adam's ``v`` from its own gradients (no communication);
at the refresh steps the ranks average it (one dense exchange, and every rank goes on
from the average), ``P`` becomes ``P'`` from it, and the memory's momentum and residual,
held in the preconditioned space, are multiplied by ``P'/P``: Adam's own ``m`` times
the new ``P``. Between refreshes the update is linear, as before.

What each rank tracks (``observed_weights``): exact Adam's ``v`` is the moving average
of the square of the ranks' average gradient, ``mu^2 + sigma^2 / N`` for N ranks whose
batches' noise ``sigma^2`` is independent; a rank's own square reads ``mu^2 + sigma^2``,
up to N times too large where noise dominates (an LM's later steps), and P, and the
steps, too small. The noise of two different steps is independent, so the product of a
rank's gradient with its previous one estimates ``mu^2`` without it, and

    v <- beta2 v + (1 - beta2) (g_t^2 / N + (1 - 1/N) g_t g_(t-1))

averaged over the ranks estimates exact Adam's (the first step after the freeze has no
previous gradient: zeros; a refreshed average below zero is taken as 0, the floor
above then applies). Measured (bench/adam_variance.py: a 2-rank byte LM, dense
AdamW, both rules beside exact Adam's ``v``, summed over the model): the rank's own
square 1.09 times exact Adam's at step 300, 1.15 at 600 (and growing); this estimate
0.87 and 0.83: the step a gradient makes responds to its noise, so the next gradient
leans against it and the product reads low by that response (steps 1.1 times exact
Adam's, median over the tensors, where the own square's are 0.92). Neither is exact.
One previous gradient per parameter is kept for it (in the optimizer's state:
checkpoints carry it). A non-finite entry of the average (a rank's overflow step)
takes the tensor's mean.

This module holds what both frameworks share: the options, the phases, the schedule and
where the take-over starts on this link (``plan_take_over``). tests/reference.py states
the maths in NumPy.
"""

import math
from typing import NamedTuple, Optional

from hvd_dgc.paths import PathKind
from hvd_dgc.schedule import DEFAULT_SENDS, DensitySchedule

__all__ = ["VARIANCE_FLOOR", "DEFAULT_FREEZE", "FROZEN_ONCE_FREEZE", "ZERO_ONE_PERIOD",
           "ADAM_SPARSE_SHARE", "AdamPlan", "FrozenAdamSchedule", "plan_take_over",
           "settle", "sparse_share",
           "check_freeze_variance", "check_refresh_variance", "freeze_steps",
           "observed_weights", "refresh_count",
           "refreshes_at", "resolve_refresh"]

#: The frozen ``v`` of a tensor is at least this times its mean over the tensor.
VARIANCE_FLOOR = 0.01

#: Steps of exact (dense) Adam before the second moment is frozen, by default, where it
#: is refreshed (the default: ``refresh_variance`` "auto"). bench/adam_lm.py, 1,500 steps,
#: dense after the freeze: frozen at 20 and refreshed 1.3577 (Horovod 1.3829), every 100
#: steps 1.3853; frozen once at 20 1.4418, at 50 1.3935, at 200 1.3824.
DEFAULT_FREEZE = 20

#: ``freeze_variance="auto"`` with ``refresh_variance=False``: frozen once, late enough
#: that the variance need not move again (the former default).
FROZEN_ONCE_FREEZE = 200

#: 0/1 Adam (Lu et al., ICLR 2023) where the script adds nothing: after the freeze the
#: scaled sign of the memory (1-bit Adam's compressor), sent at every ``ZERO_ONE_PERIOD``-th
#: step, each rank stepping on its own velocity between exchanges (``period``). Why it is
#: Adam's default and not DGC's top-k: on bench/adam_lm.py (3,000 steps, 2 ranks, AdamW,
#: three seeds, validation loss vs dense Horovod at equal steps) it made -0.72% at 53.9x
#: fewer bytes (-1.55% with the refresh's estimate of 2026-12-02), where synchronous
#: top-k with the coverage stages made +2.81% at 12.0x, 1-bit Adam exchanging every step
#: +1.68% at 21.2x (at most 32x: one bit an element a step), forced 0.1% +6.36% at 28.3x;
#: at 4 ranks -2.17% at 54.5x (-0.84% with the former refresh). A top-k coordinate
#: travels once in ~1/density steps and moves in bursts, where Adam's normalised steps
#: are large; the sign moves every coordinate every exchange, and the local steps move
#: it every step. Dropped where the take-over is declined (a link where the sign saves
#: nothing: exact Adam, every step, as Horovod). A script's own ``compression`` or an
#: option of DGC's top-k (``density``, ``warmup``, ...: config.py ``TOPK_OPTIONS``) sends
#: what it says; its own ``delay`` or ``period`` keeps the sign at its own pace
#: (``period=1``: 1-bit Adam, every step).
ZERO_ONE_PERIOD = 4

#: Adam is taken over (its variance frozen: ``plan_take_over``) only from a density
#: stage in which the tensors that leave sparse hold at least this share of the
#: gradient's elements. The frozen variance costs accuracy and buys only bytes: on
#: Horovod's digits example over loopback only the 1,280-weight classifier (0.8% of the
#: model) went sparse, and the take-over lost 0.5 points for no byte saved
#: (bench/results/one_line_accuracy.md). Below it every tensor goes dense, Adam exact.
ADAM_SPARSE_SHARE = 0.1

#: The freeze step of a take-over that is declined (``plan_take_over``: nothing is
#: ever compressed on this link): a step never reached.
NEVER = 2 ** 62

#: After the freeze, when the script sets neither ``density`` nor ``warmup``: SGD's
#: default (schedule.DEFAULT_SENDS: each stage as long as every coordinate could have
#: travelled 10 times; 0.1% from 10,000 steps after the freeze), as the update is now
#: linear. Byte-level LM on the standard library, 2 ranks, 1,500 steps, AdamW: this
#: 1.4815 (+7.1% on dense Horovod's 1.3829) at 4.1x fewer bytes; the paper's stages
#: over 200 steps 1.5599 (+12.8%) at 6.1x; error feedback (freeze_variance=False, the
#: former default) 1.5060 (+8.9%) at 3.4x; the frozen variance alone (dense) 1.3824.
#: (bench/adam_lm.py, bench/results/adam_lm.md)


def _steps_or(name, value, named, says):
    """``value`` if it is one of ``named`` or an int >= 1; else the error ``says``."""
    if any(value is n if n in (None, False) else value == n for n in named):
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be {says}, got {value!r}")
    return value


def observed_weights(world):
    """``(square, cross)``: what a rank's tracked ``v`` adds, times ``1 - beta2``, is
    ``square * g_t^2 + cross * g_t g_(t-1)`` (the module's docstring: averaged over
    ``world`` ranks it estimates the square of their average gradient)."""
    world = max(1, int(world))
    return 1.0 / world, 1.0 - 1.0 / world


def check_freeze_variance(value):
    """``freeze_variance``: "auto" (DEFAULT_FREEZE steps, refreshed; FROZEN_ONCE_FREEZE
    with ``refresh_variance=False``), an int >= 1 (steps of exact
    Adam), or False (no take-over: error feedback on Adam's raw gradient)."""
    return _steps_or("freeze_variance", value, (False, "auto"),
                     "'auto', a number of steps >= 1 (exact Adam before its second moment "
                     "is frozen) or False (Adam's own update on error feedback)")


def check_refresh_variance(value):
    """``refresh_variance``: None (``resolve_refresh``), False (frozen once), "auto"
    (refreshed at Adam's steps 2T, 4T, 8T, ... of a freeze at step T: 0/1 Adam's
    growing intervals) or an int k >= 1 (every k steps after the freeze)."""
    return _steps_or("refresh_variance", value, (None, False, "auto"),
                     "False (the variance frozen once), 'auto' (refreshed at steps 2T, 4T, "
                     "8T, ... of a freeze at step T) or a number of steps >= 1 between "
                     "refreshes")


def refreshes_at(t, freeze, refresh):
    """Whether the frozen variance is refreshed at the end of Adam's step ``t`` (1-based;
    the freeze is at the end of step ``freeze``)."""
    if refresh is False or freeze is None or t <= freeze:
        return False
    if refresh == "auto":
        times, rest = divmod(t, freeze)
        return rest == 0 and times & (times - 1) == 0
    return (t - freeze) % refresh == 0


def refresh_count(t, freeze, refresh):
    """How many refreshes the ends of Adam's steps 1 to ``t`` made (``refreshes_at``)."""
    if refresh is False or freeze is None or t <= freeze:
        return 0
    if refresh == "auto":
        return (t // freeze).bit_length() - 1
    return (t - freeze) // refresh


def freeze_steps(value, refresh="auto"):
    """The freeze step of a checked ``freeze_variance`` (None: off), with the resolved
    ``refresh`` (``resolve_refresh``)."""
    if value is False:
        return None
    if value == "auto":
        return DEFAULT_FREEZE if refresh is not False else FROZEN_ONCE_FREEZE
    return int(value)


def resolve_refresh(freeze_variance, refresh_variance):
    """``refresh_variance`` as it runs: None (the default) refreshes ("auto") where the
    freeze is the default one, and leaves a freeze the script chose (N steps) frozen
    once, as it asked."""
    if refresh_variance is None:
        return "auto" if freeze_variance == "auto" else False
    return refresh_variance


class FrozenAdamSchedule:
    """Density 1 for the first ``freeze`` steps (exact Adam), then ``inner`` from its
    start: ``inner(step - freeze, epoch)``. Looks like a ``DensitySchedule`` to the
    planner (``density``, ``warmup``, ``warmup_densities``)."""

    def __init__(self, freeze, inner, refresh=False):
        self.freeze, self.inner, self.refresh = int(freeze), inner, refresh
        self.density = getattr(inner, "density", None)
        stages = getattr(inner, "warmup_densities", ()) if getattr(inner, "warmup", 0) else ()
        self.warmup = float(self.freeze)
        self.warmup_densities = (1.0,) + tuple(stages)

    @classmethod
    def default(cls, freeze, refresh=False):
        return cls(freeze, DensitySchedule.coverage(0.001, DEFAULT_SENDS), refresh)

    def __call__(self, step, epoch):
        if step < self.freeze:
            return 1.0
        return self.inner(step - self.freeze, epoch)

    def describe(self, frozen_at=None):
        """In words; ``frozen_at``: where the take-over freezes, if later than the density
        schedule's start (``plan_take_over``: every tensor dense before it)."""
        at = self.freeze if frozen_at is None else frozen_at
        inner = self.inner.describe() if hasattr(self.inner, "describe") else \
            "a callable schedule"
        after = f"; after it {inner}, in steps from the freeze" if inner else ""
        refreshed = "" if self.refresh is False else \
            f", refreshed at steps {2 * at}, {4 * at}, {8 * at}, ... (0/1 Adam)" \
            if self.refresh == "auto" else f", refreshed every {self.refresh} steps (0/1 Adam)"
        if at == self.freeze:
            return f"exact Adam (dense) to step {at}, then its second moment frozen" \
                   f"{refreshed} and its momentum corrected by DGC (1-bit Adam){after}"
        return f"exact Adam to step {at} (every tensor dense on this link before it), then " \
               f"its second moment frozen{refreshed} and its momentum corrected by DGC " \
               f"(1-bit Adam); the density {inner}, in steps from step {self.freeze}"

    def config(self):
        inner = self.inner.config() if hasattr(self.inner, "config") else repr(self.inner)
        return ("FrozenAdamSchedule", self.freeze, inner, self.refresh)

    def __repr__(self):
        return f"FrozenAdamSchedule(freeze={self.freeze}, inner={self.inner!r}, " \
               f"refresh={self.refresh!r})"


class AdamPlan(NamedTuple):
    """Where Adam's take-over starts on this link (``plan_take_over``), decided once at
    wrap time: a relink (linkwatch.py) keeps it."""

    freeze: Optional[int] = None  # the step its variance freezes (None: declined)
    declined: bool = False        # Adam left exact: every tensor dense throughout
    dense: frozenset = frozenset()  # densities before the take-over's stage: there every
    #                                 tensor goes dense (Adam still exact)
    share: float = 0.0  # the largest share of the gradient a stage sends sparse


def sparse_share(planner, density):
    """The share of the gradient's elements in large tensors that leave other than
    dense at ``density`` on ``planner``'s paths (0 where there are none)."""
    total = sum(t.numel for t in planner.tensors)
    sparse = sum(t.numel for t in planner.tensors
                 if planner.large(t) and planner.path(t, density) != PathKind.DENSE)
    return sparse / total if total else 0.0


def plan_take_over(planner, lagging):
    """``AdamPlan``: the step at which Adam/AdamW's take-over freezes its variance is the
    schedule's freeze, or later, at the start of the first density stage in which the
    large tensors that leave other than dense on ``planner``'s link hold
    ``ADAM_SPARSE_SHARE`` of the gradient's elements (before it every tensor goes dense,
    so Adam is exact and the few bytes a small tensor would have saved are spent);
    declined where no stage does (exact Adam throughout, every tensor dense), also where
    a compressor of its own collectives would send every large tensor dense
    (plan.py ``ExchangeGroup``). The schedule's freeze as it is with ``delay`` or
    ``period`` (``lagging``: they need the linear update from it), a compressor of its
    own collectives otherwise (no density stages), a callable schedule, or no tensor
    large enough to compress (``min_compress_size``: the script's choice)."""
    r = planner.resolved
    inner = getattr(r.schedule, "inner", None)
    if r.freeze is not None and not lagging and planner.exchanged.idle():
        return AdamPlan(declined=True)
    if r.freeze is None or lagging or r.kind == "exchange" or \
            not isinstance(inner, DensitySchedule) or \
            not any(planner.large(t) for t in planner.tensors):
        return AdamPlan(freeze=r.freeze)
    warm = inner.warmup > 0
    stages = list(zip((0.0,) + inner.boundaries if warm else (0.0,),
                      tuple(inner.warmup_densities if warm else ()) + (inner.density,)))
    if warm and inner.unit != "step":  # stages in epochs: only the final one judged,
        stages = [(0.0, inner.density)]   # and the freeze stays where it was planned
    most = 0.0
    for start, density in stages:
        share = sparse_share(planner, density)
        most = max(most, share)
        if share >= ADAM_SPARSE_SHARE:
            dense = frozenset(d for s, d in stages if s < start) - \
                {d for s, d in stages if s >= start}
            return AdamPlan(r.freeze + int(math.ceil(start)), False, dense, most)
    return AdamPlan(declined=True, share=most)


def settle(resolved, adam):
    """The resolved options to build the step from, once ``adam`` (an ``AdamPlan``) is
    decided: 0/1 Adam's default period (config.py ``Resolved.zero_one``) runs only where
    Adam is taken over; where it is declined (the compressor saves nothing on this link)
    the step is Horovod's, every step."""
    if resolved.zero_one and adam.declined and resolved.config.period > 1:
        return resolved.every_step()
    return resolved
