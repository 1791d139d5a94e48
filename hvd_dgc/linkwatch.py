"""The link watched while training, and the paths re-decided when it changes (issue 33).

The wrap-time probe (linkprobe.py) prices every path on the link of that moment. A link
that later gets slower or faster (a shared uplink filling up, a job moved, a WAN's
congestion) leaves the paths chosen for another link: dense on a link that has become
slow, sparse with all its local work on one that has become fast. Probing again costs
Horovod collectives every rank joins (up to ``linkprobe.BUDGET_SECONDS``), so the step's
own collectives say when it is worth it:

    w   the seconds a step waited for its averages (what the backward pass did not
        hide), the window's mean (max over the ranks)
    b   the baseline: the mean of the window after a probe, or the second whole window
        on the step's paths (after the wrap, a density stage, a re-plan: the first
        settles)
    probe when  w > slower * b + floor     (the link got slower)
           or   w < (b - floor) / slower   (it got faster: the step waits clearly less)

``floor`` keeps a step's jitter (Horovod's cycle time, the scheduler) from reading as a
change where the step barely waits. The probe's numbers then replace the cost model
only where they move the predicted time of the step's exchange, on the paths it takes
now, by more than ``change`` the way the waits moved (the same link measured twice moves
by about 20%, bench/results/never_slower.md, and more on a busy machine; a probe that
contradicts the waits is not believed); then every tensor's path is chosen afresh
(``Planner.relink``). Two thresholds, one on the evidence and one on the measurement,
so the paths do not flap on noise; and each probe that finds the link as it was doubles
the windows before the next may run.

Agreement, as ``delay="auto"`` (autodelay.py): each window's sums travel in one small
allreduce (max over ranks); every rank then takes the same decision at the same step,
and the probe agrees its own numbers. ``LinkWatcher`` does it once for both frameworks
over their seam (hvd_dgc/seam.py): in PyTorch the agreement travels while training goes
on and is read a window later, when it has long arrived; TensorFlow's (between ``fit``'s
batches, eager) is read at once. ``LinkWatchState``'s maths is tested alone.
"""

from typing import NamedTuple

from hvd_dgc.autodelay import check_counts
from hvd_dgc.linkprobe import probe_link
from hvd_dgc.plan_words import PlanWords
from hvd_dgc.switch import change_line

__all__ = ["LinkWatch", "LinkWatchState", "LinkWatcher", "Relink", "as_link_watch",
           "changes_plan", "judge_probe", "link_watch_idle", "relinked_words"]


class LinkWatch(NamedTuple):
    """Hyper-parameters of the link watch (``link_watch=LinkWatch(window=100)``).

    Args:
        window: steps whose waits are averaged into one reading.
        slower: how many times the baseline wait (plus ``floor``) a window must wait
            for the link to read as slower; its inverse, faster.
        floor: seconds a step's wait may move by without meaning anything.
        change: how many times a new measurement must move the predicted exchange time
            of the step's paths, the way the waits moved, to replace the cost model.
        backoff: the most windows between probes that found nothing, as a power of two
            (each such probe doubles the wait before the next, up to 2**backoff).
    """

    window: int = 50
    slower: float = 2.0
    floor: float = 0.002
    change: float = 1.5
    backoff: int = 6

    def check(self):
        check_counts(self, ("window", "backoff"))
        for name in ("slower", "change"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not value > 1:
                raise ValueError(f"LinkWatch {name} must be a number > 1, got {value!r}")
        if isinstance(self.floor, bool) or not isinstance(self.floor, (int, float)) or \
                not self.floor >= 0:
            raise ValueError(f"LinkWatch floor must be a number of seconds >= 0, got "
                             f"{self.floor!r}")
        return self


def as_link_watch(value):
    """``link_watch`` as given to an optimizer: None or True (the default: watched where
    the link is measured), False (never re-measured) or a ``LinkWatch``. Returns a
    ``LinkWatch`` or None (off)."""
    if value is None or value is True:
        return LinkWatch()
    if value is False:
        return None
    if isinstance(value, LinkWatch):
        return value.check()
    raise ValueError(f"link_watch must be None (the default: the link re-measured when the "
                     f"step's waits say it changed), False (measured once, at wrap time) "
                     f"or hvd_dgc.LinkWatch(window=...), got {value!r}")


def changes_plan(before, after, change, direction=0):
    """Do ``after`` seconds (the step's exchange on its current paths, priced by a new
    measurement) differ from ``before`` (priced by the model in use) by more than
    ``change`` times, the way the waits said (``direction`` 1: slower, -1: faster; 0:
    either)? A probe that reads the other way than the waits (a busy moment) is not
    believed: two measurements must agree."""
    if before <= 0 or after <= 0:
        return before != after and direction * (after - before) >= 0
    if direction >= 0 and after / before > change:
        return True
    return direction <= 0 and before / after > change


def judge_probe(planner, link, density, launches, change, moved):
    """A probe's ``link`` (None: one rank, nothing measured) against the model in use:
    ``(relink, before, after)``, the step's exchange on its current paths priced both
    ways (``Planner.exchange_seconds``), and whether the new numbers are to replace the
    model (``changes_plan`` the way the waits ``moved``)."""
    if link is None:
        return False, 0.0, 0.0
    before = planner.exchange_seconds(density, launches)
    after = planner.exchange_seconds(density, launches, model=planner.priced(link))
    return changes_plan(before, after, change, moved), before, after


def relinked_words(step, link, was, before, after, planner, density, traced=False):
    """Rank 0's line where a probe moved the paths to a new link (both frameworks): a
    short one (switch.change_line), the full story with ``verbose``; ``traced``: the
    step is traced again (Keras)."""
    again = "; the step is traced again" if traced else ""
    words = PlanWords(planner)
    if not words.verbose():
        rate = f"{link.bandwidth * 8 / 1e6:.0f} Mbit/s"
        if was is not None:
            rate += f" (was {was.bandwidth * 8 / 1e6:.0f})"
        return change_line(step, f"link now {rate}: {words.compressed_words(density)}"
                                 f"{'; step traced again' if traced else ''}")
    return (f"hvd_dgc: at step {step} the link measured {link.numbers()} (was "
            f"{was.numbers() if was is not None else 'not measured'}; a {link.seconds:.2f} s "
            f"probe): the step's exchange on its paths priced {after * 1e3:.1f} ms, not "
            f"{before * 1e3:.1f} ms, so each tensor's path was chosen afresh: "
            f"{words.sparse_words(density)}{again}")


class LinkWatchState:
    """One optimizer's watch: the window being measured and the agreed baseline."""

    def __init__(self, watch):
        self.watch = watch
        self._sums = [0.0, 0.0]  # waited seconds, steps
        self.baseline = None     # agreed mean wait a step; None: the next window sets it
        self.key = None          # what the baseline was measured on (density, plan)
        self.quiet = 0           # windows left before a probe may run
        self.found_nothing = 0   # probes in a row that found the link as it was
        self.probes = 0
        self.relinked = []       # steps at which a probe replaced the cost model

    def observe(self, waited):
        self._sums[0] += waited
        self._sums[1] += 1

    def window_done(self):
        return self._sums[1] >= self.watch.window

    def take_window(self):
        """This window's sums, to be agreed (max over ranks); a fresh window begins."""
        sums, self._sums = tuple(self._sums), [0.0, 0.0]
        return sums

    def decide(self, agreed, measured_on, now):
        """From a window's agreed sums: where the link should be probed now, the way the
        waits moved (1: slower, -1: faster), else 0.
        ``measured_on`` and ``now``: what fixed the step's paths when the window was
        measured and now (its density and the plan's generation). A window measured on
        other paths than today's says nothing; on today's, the first settles and the
        second sets the baseline."""
        waited, steps = agreed
        if not steps or measured_on != now:
            return 0
        mean = waited / steps
        if self.key != now:  # new paths: their first window settles (Horovod negotiates
            self.key, self.baseline = now, None  # shapes it has not cached yet)
            return 0
        if self.baseline is None:
            self.baseline = mean
            return 0
        if self.quiet > 0:
            self.quiet -= 1
            return 0
        w = self.watch
        if mean > w.slower * self.baseline + w.floor:
            return 1
        return -1 if mean < (self.baseline - w.floor) / w.slower else 0

    def probed(self, relinked, step):
        """After a probe: the next window sets the baseline; a probe that changed nothing
        makes the next wait longer (up to 2**backoff windows)."""
        self.probes += 1
        self.baseline = None
        if relinked:
            self.relinked.append(step)
            self.found_nothing = 0
        else:
            self.found_nothing = min(self.found_nothing + 1, self.watch.backoff)
        self.quiet = 2 ** self.found_nothing - 1

    def stats(self):
        return {"link_probes": self.probes, "relinked_at": list(self.relinked)}


class Relink(NamedTuple):
    """A probe's verdict that the paths should follow a new ``link``: the step's exchange
    on its current paths priced ``before`` (the model in use) and ``after`` (the link)."""

    link: object
    before: float
    after: float


class LinkWatcher:
    """One optimizer's link watch over its seam (hvd_dgc/seam.py ``Collectives``):
    ``observe`` each synchronous step's seconds; where that ends a window, ``end_window``:
    the ranks agree on the window's sums, and where the agreed waits say the link moved,
    the link is probed and judged (``judge_probe``). ``in_flight``: the agreement travels
    while training goes on and the last window's decides (PyTorch); else it is read at
    once (TensorFlow)."""

    made = 0  # watchers made in this process: each names its collectives apart

    def __init__(self, watch, collectives, in_flight):
        self.state = LinkWatchState(watch)
        self.collectives, self.in_flight = collectives, in_flight
        self._agreeing = None  # (handle of the last window's sums, what they were on)
        self._windows = 0
        LinkWatcher.made += 1
        self._name = f"hvd_dgc.linkwatch.{LinkWatcher.made}"

    def observe(self, seconds):
        """One step's ``seconds`` (waited, or the whole step); True where it ends a
        window (then call ``end_window``)."""
        self.state.observe(seconds)
        return self.state.window_done()

    def end_window(self, planner, density, launches, step):
        """The window's agreement and verdict (every rank at the same step); ``density``
        and ``launches`` price the step's exchange. A ``Relink`` where the paths should
        follow a new link (the caller moves them), else None."""
        state = self.state
        now = (density, planner.generation)  # what fixed the paths this window ran on
        handle = self.collectives.max_async(state.take_window(),
                                            f"{self._name}.{self._windows % 2}")
        self._windows += 1
        agreeing = (handle, now)
        if self.in_flight:
            agreeing, self._agreeing = self._agreeing, agreeing
            if agreeing is None:
                return None
        moved = state.decide(tuple(self.collectives.wait(agreeing[0])), agreeing[1], now)
        if not moved:
            return None
        link = probe_link(self.collectives)
        relinked, before, after = judge_probe(planner, link, density, launches,
                                              state.watch.change, moved)
        state.probed(relinked, step)
        return Relink(link, before, after) if relinked else None

    def settle(self):
        """At exit: the agreement in flight, waited for (a rank that ends first must not
        leave the others waiting in it)."""
        if self._agreeing is not None:
            self.collectives.wait(self._agreeing[0])
            self._agreeing = None


def link_watch_idle(config, measured, sparse, elastic=False, tape=False):
    """Why ``link_watch`` cannot act in this set-up (a sentence naming the fix), or "":
    the PyTorch optimizer and TensorFlow's exchange say it on rank 0 where the script
    passed ``link_watch`` itself (the default, None, stays quiet)."""
    why = ("under elastic Horovod the link is measured again at each sync of the state "
           "instead" if elastic else
           "the link is not measured (cost_model is set, or HVD_DGC_COST_MODEL=assumed): "
           "drop cost_model to have it measured" if not measured else
           "nothing is compressed (every tensor dense): there are no paths to choose" if
           not sparse else
           f"with {config.lagging} a step does not wait for its own averages, so its waits "
           f"do not tell the link's speed" if config.lagging else
           "DistributedGradientTape's step is traced into your tf.function; use Keras' "
           "model.fit for a watched link" if tape else "")
    return f"hvd_dgc: link_watch={config.link_watch!r} does nothing here: {why}." if why \
        else ""
