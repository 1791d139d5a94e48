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
from typing import Callable, Optional, Sequence, Union

__all__ = ["DensitySchedule", "PAPER_WARMUP_DENSITIES", "DEFAULT_WARMUP_STEPS", "as_schedule",
           "check_density", "num_selected"]

#: The paper's warm-up stages; the final density (0.1%) follows them.
PAPER_WARMUP_DENSITIES = (0.25, 0.0625, 0.015625, 0.004)

#: The warm-up when a script sets neither ``density`` nor ``warmup`` (the one-line
#: switch): counted in optimizer steps, so it needs no ``set_epoch`` call. The residual
#: sends a coordinate about once per 1/density steps, so at 0.1% a run needs thousands
#: of steps before every coordinate has travelled; a short run at 0.1% from its first
#: step trains a small model on a trickle (digits MLP, 88 steps: 73% accuracy against
#: 96% dense). Passing ``density=`` or ``warmup=`` replaces this default.
DEFAULT_WARMUP_STEPS = 1000


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
    """

    def __init__(self, density: float = 0.001, warmup: float = 0, unit: str = "epoch",
                 warmup_densities: Optional[Sequence[float]] = None):
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

    def __call__(self, step: int, epoch: float) -> float:
        t = epoch if self.unit == "epoch" else step
        if self.warmup <= 0 or t >= self.warmup:
            return self.density
        stage = int(math.floor(t * len(self.warmup_densities) / self.warmup))
        return self.warmup_densities[max(0, min(stage, len(self.warmup_densities) - 1))]

    def __repr__(self):
        return (f"DensitySchedule(density={self.density}, warmup={self.warmup:g}, "
                f"unit={self.unit!r}, warmup_densities={self.warmup_densities})")

    def config(self):
        """Plain description, compared across ranks to catch inconsistent set-ups."""
        return ("DensitySchedule", self.density, self.warmup, self.unit, self.warmup_densities)


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
                warmup_unit: str = "epoch", warmup_densities: Optional[Sequence[float]] = None):
    """Turn the user's ``density`` argument (number, schedule or callable) into a schedule.
    Neither ``density`` nor ``warmup`` given: 0.1% after ``DEFAULT_WARMUP_STEPS`` steps of
    the paper's warm-up stages."""
    if density is None and warmup is None:
        return DensitySchedule(0.001, warmup=DEFAULT_WARMUP_STEPS, unit="step",
                               warmup_densities=warmup_densities)
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
