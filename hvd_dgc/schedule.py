"""Density (1 - sparsity) schedules, shared by the PyTorch and TensorFlow sides.

DGC (Lin et al., ICLR 2018, Sec. 3.4 "warm-up training") starts with a dense-ish
exchange and lowers the density exponentially over the first epochs, because
early gradients change fast and a stale residual hurts most then. The paper's
schedule is 25% -> 6.25% -> 1.5625% -> 0.4% -> 0.1%, one stage per epoch.

A schedule maps ``(step, epoch)`` to a density in (0, 1]. Every rank must see
the same value at the same step (it decides which collective runs), so it
depends only on counters every rank shares.
"""

import math
import os
from typing import Callable, Optional, Sequence, Union

from hvd_dgc.say import rank0_once

__all__ = ["DensitySchedule", "PAPER_WARMUP_DENSITIES", "DEFAULT_SENDS", "ADAPTIVE_SENDS",
           "CHECK_STEPS", "as_schedule", "check_density", "num_selected",
           "check_steps", "counts_epochs", "epoch_check_steps", "stuck_epoch_message"]

#: The paper's warm-up stages; the final density (0.1%) follows them.
PAPER_WARMUP_DENSITIES = (0.25, 0.0625, 0.015625, 0.004)

#: The warm-up when a script sets neither ``density`` nor ``warmup`` (the one-line
#: switch; ``DensitySchedule.coverage``): counted in optimizer steps, so it needs no
#: ``set_epoch`` call. In t steps at density d a tensor can send at most d*t of its
#: coordinates once each: at 0.1%, a 220-step run leaves 78% of a layer's weights
#: where they started (digits CNN: 86% accuracy against 97% dense). So the default
#: lowers the density only as fast as ``density * step >= DEFAULT_SENDS`` allows: every
#: coordinate could have travelled 10 times (and none waits longer than a tenth of the
#: steps so far). The paper's stages then end at steps 160, 640, 2500 and 10000: short
#: runs stay dense-ish, long ones run at 0.1% from step 10000 (two ImageNet epochs at
#: batch 256). Passing ``density=`` or ``warmup=`` replaces this default.
DEFAULT_SENDS = 10

#: The same rule for an adaptive base optimizer (Adam, AdamW, RMSprop, ...: anything but
#: SGD). Error feedback delivers a coordinate's gradient in bursts, about 1/density steps'
#: worth at a time; Adam divides each step by the root mean square of what it receives,
#: so a burst moves the weight about sqrt(1/density) dense steps' worth instead of
#: 1/density: its steps shrink by about sqrt(density) (SGD is linear: unaffected). Stages
#: 4x as long (25% to step 640, 0.1% from step 40000) keep that smaller early on. Digits
#: CNN, AdamW, 220 steps, 5 seeds: 25% throughout 0.45 points below dense Horovod, the SGD
#: stages (6.25% from step 160) 1.17 below.
ADAPTIVE_SENDS = 40

#: An epoch-counted warm-up (``warmup_unit="epoch"``) moves only when the script says
#: where it is: ``optimizer.set_epoch(e)`` (PyTorch, TensorFlow's tape) or one of
#: hvd_dgc's Keras callbacks in ``model.fit``. A script that never does so stays in the
#: first stage for good. After this many optimizer steps with the epoch never set, rank 0
#: says so once (``HVD_DGC_CHECK_STEPS`` in the environment: another count; 0:
#: never). A script that follows the convention of ``DistributedSampler.set_epoch``
#: (called at the start of every epoch, 0 first) sets it before its first step, so it is
#: never told; the count only delays the word for one that never calls it. A stuck
#: warm-up costs bytes, not accuracy (the first stage sends more than planned, never
#: less), so nothing is lost by waiting 200 steps, about the length of the default
#: step-counted warm-up's first stage (160 steps, ``DEFAULT_SENDS / 0.0625``) and a few
#: seconds to minutes of most runs, while a script calling ``set_epoch`` only at the end
#: of a first epoch shorter than that is not told wrongly.
CHECK_STEPS = 200


def counts_epochs(schedule):
    """Whether ``schedule`` has a warm-up counted in epochs (looking inside Adam's
    take-over, ``FrozenAdamSchedule.inner``); a callable's own rule is not judged."""
    while hasattr(schedule, "inner"):
        schedule = schedule.inner
    return isinstance(schedule, DensitySchedule) and schedule.unit == "epoch" and \
        schedule.warmup > 0


def epoch_check_steps(schedule):
    """After how many steps a never-set epoch is reported for ``schedule``: 0 where its
    warm-up does not count epochs or the check is off (``CHECK_STEPS``)."""
    return check_steps() if counts_epochs(schedule) else 0


def check_steps():
    """The step at which a set-up that needs a call the script has not made by then is
    said (the epoch above; in Keras, a lagging optimizer never flushed or a link watch
    never timed): ``HVD_DGC_CHECK_STEPS``, else ``CHECK_STEPS``; 0: never."""
    value = os.environ.get("HVD_DGC_CHECK_STEPS", "").strip()
    if not value:
        return CHECK_STEPS
    if not value.isdigit():
        raise ValueError(f"HVD_DGC_CHECK_STEPS={value!r}: give a whole number of "
                         f"steps (0: no check), or unset it (default {CHECK_STEPS}).")
    return int(value)


def stuck_epoch_message(schedule, steps, epoch, fix):
    """The warning for an epoch-counted warm-up whose epoch was never set by step
    ``steps``; ``fix``: how this framework's script sets it."""
    while hasattr(schedule, "inner"):
        schedule = schedule.inner
    return (f"hvd_dgc: the warm-up counts epochs (warmup={schedule.warmup:g}, "
            f"warmup_unit='epoch') but nothing has set the epoch by step {steps}: it is "
            f"still at epoch {epoch:g}, density {schedule(0, epoch):.4g}. {fix}, or "
            f"pass warmup_unit='step' to count the warm-up in steps.")


def check_density(density, name="density"):
    """Density must be a number in (0, 1]; say which argument and how to fix it."""
    if isinstance(density, bool) or not isinstance(density, (int, float)):
        raise TypeError(f"{name} must be a float in (0, 1], got {density!r} "
                        f"({type(density).__name__})")
    if not (0.0 < float(density) <= 1.0) or math.isnan(density):
        raise ValueError(f"{name} must be in (0, 1] (the fraction of each gradient "
                         f"sent; 0.001 sends the top 0.1%), got {density!r}")
    return float(density)


class DensitySchedule:
    """Density at a training position: warm-up stages, then the final density.

    Args:
        density: final density, in (0, 1]. Default 0.001 (99.9% sparsity).
        warmup: length of the warm-up, in ``unit``s. 0 disables warm-up.
        unit: ``"epoch"`` (driven by ``set_epoch``; the paper's choice) or
            ``"step"`` (driven by the optimizer's step counter).
        warmup_densities: densities of the warm-up stages, each held for
            ``warmup / len(warmup_densities)`` units. Default: the paper's
            ``(0.25, 0.0625, 0.015625, 0.004)``. Values below ``density`` are
            raised to it (a warm-up never sends less than the final density).
        boundaries: where each stage ends, in ``unit``s (increasing, the last equal
            to ``warmup``) instead of equal stages; ``coverage`` sets them.
    """

    def __init__(self, density: float = 0.001, warmup: float = 0, unit: str = "epoch",
                 warmup_densities: Optional[Sequence[float]] = None,
                 boundaries: Optional[Sequence[float]] = None):
        self.density = check_density(density)
        if unit not in ("epoch", "step"):
            raise ValueError(f"warmup unit must be 'epoch' or 'step', got {unit!r}")
        if isinstance(warmup, bool) or not isinstance(warmup, (int, float)) or warmup < 0:
            raise ValueError(f"warmup must be a number >= 0 of {unit}s, got {warmup!r}")
        self.warmup = float(warmup)
        self.unit = unit
        stages = PAPER_WARMUP_DENSITIES if warmup_densities is None else tuple(warmup_densities)
        if self.warmup > 0 and not stages:
            raise ValueError("warmup_densities is empty but warmup > 0")
        self.warmup_densities = tuple(
            max(check_density(d, "warmup_densities[%d]" % i), self.density)
            for i, d in enumerate(stages))
        n = len(self.warmup_densities)
        if boundaries is None:
            boundaries = [self.warmup * (i + 1) / n for i in range(n)] if self.warmup else []
        self.boundaries = tuple(float(b) for b in boundaries)
        if self.warmup > 0 and (len(self.boundaries) != n or self.boundaries[-1] != self.warmup
                                or list(self.boundaries) != sorted(self.boundaries)):
            raise ValueError(f"boundaries must be {n} increasing ends of the warm-up stages, "
                             f"the last equal to warmup={self.warmup:g}; got {boundaries!r}")

    @classmethod
    def coverage(cls, density: float = 0.001, sends: float = DEFAULT_SENDS,
                 warmup_densities: Optional[Sequence[float]] = None):
        """Stages by steps, each ending where the next density reaches ``sends / step``:
        at every step, density * step >= sends (see ``DEFAULT_SENDS``)."""
        density = check_density(density)
        if isinstance(sends, bool) or not isinstance(sends, (int, float)) or not sends > 0:
            raise ValueError(f"sends must be a number > 0, got {sends!r}")
        stages = PAPER_WARMUP_DENSITIES if warmup_densities is None else warmup_densities
        stages = [max(check_density(d, "warmup_densities[%d]" % i), density)
                  for i, d in enumerate(stages)]
        ends = [math.ceil(sends / d) for d in stages[1:] + [density]]
        return cls(density, warmup=ends[-1], unit="step", warmup_densities=stages,
                   boundaries=ends)

    def __call__(self, step: int, epoch: float) -> float:
        t = epoch if self.unit == "epoch" else step
        if self.warmup <= 0 or t >= self.warmup:
            return self.density
        stage = sum(1 for end in self.boundaries if t >= end)
        return self.warmup_densities[min(stage, len(self.warmup_densities) - 1)]

    def __repr__(self):
        return (f"DensitySchedule(density={self.density}, warmup={self.warmup:g}, "
                f"unit={self.unit!r}, warmup_densities={self.warmup_densities}, "
                f"boundaries={self.boundaries})")

    def describe(self):
        """The warm-up in words, for the wrap-time line ("" when there is none)."""
        if self.warmup <= 0:
            return ""
        stages = ", ".join(f"{d:.4g} to {self.unit} {end:g}"
                           for d, end in zip(self.warmup_densities, self.boundaries))
        return f"warm-up {stages}"

    def config(self):
        """Plain description, compared across ranks to catch inconsistent set-ups."""
        return ("DensitySchedule", self.density, self.warmup, self.unit, self.warmup_densities,
                self.boundaries)


ScheduleLike = Union[float, DensitySchedule, Callable[[int, float], float]]


class _CallableSchedule:
    """Wraps a user callable ``f(step, epoch) -> density`` and validates its output."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, step, epoch):
        return check_density(self.fn(step, epoch), "density returned by the schedule callable")

    def config(self):
        return ("callable", getattr(self.fn, "__qualname__", repr(self.fn)))


def as_schedule(density: Optional[ScheduleLike] = None, warmup: Optional[float] = None,
                warmup_unit: str = "epoch", warmup_densities: Optional[Sequence[float]] = None,
                adaptive: bool = False):
    """Turn the user's ``density`` argument (number, schedule or callable) into a schedule.
    Neither ``density`` nor ``warmup`` given: 0.1% after the coverage warm-up
    (``DensitySchedule.coverage``; ``ADAPTIVE_SENDS`` when the base optimizer is
    ``adaptive``, i.e. not SGD, else ``DEFAULT_SENDS``)."""
    if density is None and warmup is None:
        return DensitySchedule.coverage(0.001, ADAPTIVE_SENDS if adaptive else DEFAULT_SENDS,
                                        warmup_densities)
    if warmup_densities is not None and not warmup:  # (no warm-up to hold them)
        unused = f"hvd_dgc: warmup_densities={tuple(warmup_densities)!r} has no effect"
        rank0_once(f"{unused} without a warm-up (density={density!r}, warmup={warmup!r}): "
                   f"pass warmup=N ({warmup_unit}s) to go through them, or drop "
                   f"warmup_densities." if isinstance(density, (int, float)) else
                   f"{unused} next to a density schedule of your own: put the stages in "
                   f"it, or drop warmup_densities.", UserWarning,
                   key="hvd_dgc.warmup_densities_unused")
    if warmup_unit == "step" and warmup is None and isinstance(density, (int, float)):
        rank0_once(f"hvd_dgc: warmup_unit='step' has no effect without warmup: "
                   f"density={density!r} runs from the first step (the default warm-up "
                   f"is dropped once density is given). Pass warmup=N (steps) for one.",
                   UserWarning, key="hvd_dgc.warmup_unit_unused")
    density = 0.001 if density is None else density
    warmup = 0 if warmup is None else warmup
    if isinstance(density, DensitySchedule) or (callable(density) and hasattr(density, "config")):
        if warmup:
            raise ValueError("pass warm-up settings inside the DensitySchedule, not as "
                             "warmup=... next to it")
        return density
    if callable(density):
        if warmup:
            raise ValueError("density is a callable f(step, epoch); put the warm-up in it "
                             "instead of passing warmup=...")
        return _CallableSchedule(density)
    return DensitySchedule(density, warmup=warmup, unit=warmup_unit,
                           warmup_densities=warmup_densities)


def num_selected(numel: int, density: float) -> int:
    """k for a tensor of ``numel`` elements: at least one, at most all."""
    return max(1, min(numel, int(math.ceil(numel * density))))
