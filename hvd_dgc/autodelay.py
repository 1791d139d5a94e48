"""``delay="auto"``: the delay of delayed averaging chosen from measured times (issue 17).

Delayed averaging hides an exchange behind D steps of compute (Zhu et al., NeurIPS
2021). D too small and each step waits for the network; D too large and the averages
are staler than they need be. The right D depends on the link and the model, and a
user rarely knows either, so it is measured:

    c  compute time per step (between the end of one step's wait and the next step's)
    w  time a step spends collecting the exchanges due at it (waiting, and summing)
    an exchange applied D steps after its launch had D*c of cover and still made its
    step wait w: it took about D*c + w, that is D + w/c steps (p*w/c with period p,
    where one step in p collects)
    waits above ``idle`` of the compute: D' = ceil(margin * (D + p*w/c)), at most
    max_delay; no such wait: D' = D - 1 (the exchange might fit in less: less
    staleness), at least 1

so D settles where the exchange just fits, probing one step below it now and then.
A window measured under a D that a decision has since replaced decides nothing (the
agreement lags a window, and would otherwise undo the decision it fed).

Every rank measures its own c and w; each window's sums travel in one small
non-blocking allreduce (max over ranks: the slowest rank sets the pace) that is
read one window later, when it has long arrived, so agreeing costs no wait. Every rank
then computes the same D' from the same numbers and switches at the same step.

Framework-free: the torch optimizer holds an ``AutoDelayState`` and calls
``observe``/``decide``; the maths is tested alone (tests/torch/test_single_process.py).
"""

import math
from typing import NamedTuple

__all__ = ["AutoDelay", "AutoDelayState", "choose_delay", "as_auto_delay"]


class AutoDelay(NamedTuple):
    """Hyper-parameters of ``delay="auto"`` (``delay=AutoDelay(max_delay=16)`` to set them).

    Args:
        max_delay: the most staleness allowed (steps an average may lag).
        window: steps between decisions (the measurements of one window decide the D
            used from the end of the next).
        margin: cover asked for beyond the measured exchange time (jitter).
        start: D until the first decision.
        idle: waits below this fraction of the compute count as none (collecting
            costs some time even when nothing is waited for).
    """

    max_delay: int = 8
    window: int = 20
    margin: float = 1.25
    start: int = 1
    idle: float = 0.05

    def check(self):
        check_counts(self, ("max_delay", "window", "start"))
        if not self.start <= self.max_delay:
            raise ValueError(f"AutoDelay start={self.start} is above max_delay="
                             f"{self.max_delay}; lower start or raise max_delay")
        if not (isinstance(self.margin, (int, float)) and self.margin >= 1):
            raise ValueError(f"AutoDelay margin must be a number >= 1, got {self.margin!r}")
        if not (isinstance(self.idle, (int, float)) and 0 <= self.idle < 1):
            raise ValueError(f"AutoDelay idle must be a number in [0, 1), got {self.idle!r}")
        return self


def check_counts(settings, names):
    """Each of ``names`` of the settings record ``settings`` (AutoDelay, LinkWatch) is an
    int >= 1, or a ValueError names the record, the field and the value."""
    for name in names:
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{type(settings).__name__} {name} must be an int >= 1, got "
                             f"{value!r}")


def as_auto_delay(delay):
    """``delay`` as given to an optimizer: an int (fixed), "auto" or an ``AutoDelay``.
    Returns ``(fixed int or None, AutoDelay or None)``."""
    if isinstance(delay, AutoDelay):
        return None, delay.check()
    if isinstance(delay, str) and delay.lower() == "auto":
        return None, AutoDelay()
    if isinstance(delay, bool) or not isinstance(delay, int) or delay < 0:
        raise ValueError(f"delay must be an int >= 0 (the number of steps an average may lag; "
                         f"0 = synchronous), \"auto\" or hvd_dgc.AutoDelay(max_delay=...), "
                         f"got {delay!r}")
    return delay, None


def choose_delay(current, compute_s, wait_s, steps, config, period=1):
    """The D that covers one exchange, from one window's sums (see the module doc).

    Args:
        current: the D the window ran with.
        compute_s, wait_s: summed over the window's ``steps`` (max over ranks).
        period: steps per exchange (``period=``): one step in ``period`` waits.
    """
    if steps <= 0 or compute_s <= 0:
        return current
    waited = wait_s / compute_s  # in steps of compute, per step
    if waited <= config.idle:
        return max(1, current - 1)
    return max(1, min(config.max_delay, math.ceil(config.margin * (current + period * waited))))


class AutoDelayState:
    """The running measurements and the D in force (one per optimizer; picklable)."""

    def __init__(self, config):
        self.config = config
        self.delay = config.start
        self.compute = self.wait = 0.0
        self.steps = 0
        self.decisions = []  # (step, D) each time D changed

    def observe(self, compute_s, wait_s):
        self.compute += compute_s
        self.wait += wait_s
        self.steps += 1

    def window_done(self):
        return self.steps >= self.config.window

    def take_window(self):
        """This window's sums and the D it ran with (to agree on), and a fresh window."""
        sums = (self.compute, self.wait, float(self.steps), float(self.delay))
        self.reset_window()
        return sums

    def reset_window(self):
        self.compute = self.wait = 0.0
        self.steps = 0

    def decide(self, agreed, step, period=1):
        """Apply the agreed sums of a past window: the new D, the same on every rank."""
        compute_s, wait_s, steps, ran_with = agreed
        if int(ran_with) != self.delay:  # measured under a D since replaced: moot
            return self.delay
        new = choose_delay(self.delay, compute_s, wait_s, int(steps), self.config, period)
        if new != self.delay:
            self.decisions.append((step, new))
        self.delay = new
        return new
