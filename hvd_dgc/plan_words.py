"""What rank 0 says of a plan: the wrap-time line (``brief``, or ``summary`` with
``verbose``) and its warnings, the lines of a new density stage and of an elastic sync,
what was measured. Words only: every figure is the planner's (hvd_dgc/plan.py), read
through it, and the texts are hvd_dgc/switch.py's.

    words = PlanWords(planner)
    words.announce(framework, delay, period)   wrap time, rank 0: the line, the warnings
    words.brief(...), words.summary(...)       the line by default, the full plan
    words.stage_line(step, before, after)      a new stage that changes the paths
    words.sync_line(world)                     an elastic sync's new link
"""

from hvd_dgc.adam import ADAM_SPARSE_SHARE
from hvd_dgc.packing import gather_value_bits, reduces_signs
from hvd_dgc.paths import SUMS, PathKind
from hvd_dgc.schedule import DensitySchedule
from hvd_dgc.say import rank0_once, say, verbose
from hvd_dgc.switch import (CHANGE_LIMIT, adam_idle_warning, brief, change_line,
                            gather_idle_warning, idle_warning, percent, summary)

__all__ = ["PlanWords", "exchange_collective"]


def exchange_collective(plan):
    """How a payload compressor's tensors travel on ``plan``'s world, in words."""
    return "compressed allreduce" if reduces_signs(plan.compressor, plan.world_size) \
        else "allgather"


class PlanWords:
    """The words of one ``Planner``'s plan (``plan``), said on rank 0."""

    def __init__(self, plan):
        self.plan = plan

    def sparse_words(self, density):
        """How many large tensors take a sparse path at ``density``, in words."""
        plan = self.plan
        large = [t for t in plan.tensors if plan.large(t)]
        sparse = sum(plan.path(t, density) != PathKind.DENSE for t in large)
        return f"{sparse} of {len(large)} large tensors sparse at density {density:g}"

    def compressed_words(self, density, at=True):
        """``sparse_words`` for the short lines: "2 of 4 large tensors sparse at 1%"."""
        plan = self.plan
        large = [t for t in plan.tensors if plan.large(t)]
        sparse = sum(plan.path(t, density) not in (PathKind.DENSE, PathKind.SPARSE_GRAD)
                     for t in large)
        return f"{sparse} of {len(large)} large tensors sparse" + \
            (f" at {percent(density)}" if at else "")

    def sync_line(self, world):
        """Rank 0's line where an elastic sync measured the link of a new world of
        ``world`` ranks (None where nothing was measured): short, the full story with
        ``verbose``."""
        plan = self.plan
        words = self.measured_words()
        if not words:
            return None
        if self.verbose():
            return f"hvd_dgc: elastic sync at {world} ranks: {words}"
        link = "" if plan.link is None else \
            f"link {plan.link.bandwidth * 8 / 1e6:.0f} Mbit/s, "
        final = plan.resolved.final_density() or 1.0
        line = f"[hvd_dgc] elastic sync at {world} ranks: {link}{self.compressed_words(final)}"
        return line if len(line) <= CHANGE_LIMIT else line[:CHANGE_LIMIT - 3] + "..."

    def stage_line(self, step, before, after):
        """Rank 0's short line where a new density stage changes the tensors' paths
        (None where the paths stay as they were): the density now and what it sends."""
        plan = self.plan
        if before == after or not plan.resolved.sparse:
            return None
        if [plan.path(t, before) for t in plan.tensors] == \
                [plan.path(t, after) for t in plan.tensors]:
            return None
        return change_line(step, f"density {percent(after)} now: "
                                 f"{self.compressed_words(after, at=False)}")

    def measured_words(self):
        """What was measured, for the rank-0 line ("" if nothing)."""
        plan = self.plan
        words = [x.words() for x in (plan.link, plan.local) if x is not None]
        if plan.unmeasured:
            words.append(plan.unmeasured)
        large = [t for t in plan.tensors if plan.large(t)] if plan.resolved.sparse else []
        dense = [(d, sum(plan.path(t, d) == PathKind.DENSE for t in large))
                 for d in plan.densities() if d < 1]
        dense = [f"{n} of {len(large)} at density {d:g}" for d, n in dense if n]
        if words and dense:  # said once; the statistics count each step's paths
            words.append(f"dense where sparse would cost more: {', '.join(dense)}")
        priced = plan.exchanged.dense()
        if priced:  # said with or without a measured link: it follows the world's size
            large = sum(plan.large(t) for t in plan.tensors)
            work = " and its work" if plan.local is not None else ""
            words.append(f"dense where {plan.compressor.name}'s "
                         f"{exchange_collective(plan)}{work} at "
                         f"{plan.world_size} ranks would cost more than the allreduce: "
                         f"{len(priced)} of {large} large tensors")
        return "; ".join(words)

    def kind_name(self):
        """The compressor's name ("dense" where nothing is compressed)."""
        plan = self.plan
        return plan.compressor.name if plan.resolved.kind != "dense" else "dense"

    def _final(self, density_now):
        """The final density and the warm-up in words (a callable: its value now)."""
        r = self.plan.resolved
        if not r.sparse:
            return 1.0, ""
        final = r.final_density()
        if final is None:
            return density_now, "warm-up set by a callable schedule"
        return final, r.schedule.describe() if hasattr(r.schedule, "describe") else ""

    def _sums(self, final):
        """The paths of the large tensors at the final density."""
        plan = self.plan
        if not plan.resolved.sparse:
            return set()
        return {plan.path(t, final) for t in plan.tensors if plan.large(t)}

    def idle_warning(self, density_now=1.0):
        """Why DGC does nothing with this set-up, or None. Nothing where the compressor
        is Adam's default sign and Adam is left exact: the script chose no compressor,
        and its training is Horovod's (``brief`` says so)."""
        plan = self.plan
        if plan.resolved.kind == "dense":
            return None
        if plan.exchanged.idle() and not plan.resolved.chosen:
            return None
        if plan.exchanged.idle():
            return gather_idle_warning(self.kind_name(), plan.world_size,
                                       plan.link is not None, exchange_collective(plan))
        if plan.adam.declined and plan.adam.share:
            return adam_idle_warning(plan.adam.share, ADAM_SPARSE_SHARE, plan.link is not None)
        final, _ = self._final(density_now)
        large = any(plan.large(t) for t in plan.tensors)
        sums = self._sums(final)
        sparse_at_final = not plan.resolved.sparse or bool(sums - {PathKind.DENSE})
        return idle_warning(self.kind_name(), plan.min_compress_size, large, sparse_at_final,
                            final, plan.world_size, plan.link is not None)

    def verbose(self):
        """The full texts wanted: the ``verbose`` option or ``HVD_DGC_VERBOSE=1``."""
        plan = self.plan
        return verbose(getattr(plan.config, "verbose", False))

    def announce(self, framework, delay, period=1, density_now=1.0):
        """Wrap time, both frameworks, rank 0 only: the warnings (each once), then one
        line: ``brief`` by default, ``summary`` (the full plan) with ``verbose``."""
        plan = self.plan
        message = self.idle_warning(density_now)
        if message:
            rank0_once(message, UserWarning, stacklevel=3)
        if plan.resolved.taken_over.lost:
            rank0_once(plan.resolved.taken_over.lost, UserWarning, stacklevel=3)
        line = self.summary(framework, delay, period, density_now) if self.verbose() else \
            self.brief(framework, delay, period, density_now)
        say(line, once=False)

    def brief(self, framework, delay, period=1, density_now=1.0):
        """The wrap-time line by default (switch.brief, at most 200 characters): what
        runs now, what comes later, how to see the full plan."""
        plan = self.plan
        r = plan.resolved
        final, _ = self._final(density_now)
        inner = getattr(r.schedule, "inner", r.schedule)  # (FrozenAdamSchedule's)
        freeze = None
        if r.freeze is not None and not plan.adam.declined:
            freeze = plan.adam.freeze if plan.adam.freeze is not None else r.freeze
        start, until, unit = final, None, "step"
        if r.sparse and isinstance(inner, DensitySchedule) and inner.warmup > 0:
            stages = [d for d in inner.warmup_densities if d not in plan.adam.dense]
            start, until, unit = (stages or [final])[0], inner.warmup, inner.unit
            if r.freeze is not None and unit == "step":  # counted from the freeze
                until += r.freeze
        callable_schedule = r.sparse and r.final_density() is None
        if callable_schedule:
            start = final = density_now
        never = 2 ** 62  # a step past every start (PowerSGD's start_iter, Adam's freeze)
        large = [t for t in plan.tensors if plan.large(t)]

        def compressed(density):
            return sum(plan.path(t, density, never) not in (PathKind.DENSE,
                                                            PathKind.SPARSE_GRAD)
                       for t in large)
        return brief(framework, self.kind_name(), final, start=start, until=until, unit=unit,
                     sparse=compressed(final), sparse_start=compressed(start),
                     total=len(plan.tensors), name=r.taken_over.name, freeze=freeze,
                     declined=plan.adam.declined, zero_one=r.zero_one and period > 1,
                     chosen=r.chosen, delay=delay, period=period,
                     schedule_callable=callable_schedule, large=len(large),
                     min_compress_size=plan.min_compress_size)

    def summary(self, framework, delay, period=1, density_now=1.0):
        """The full plan (``verbose=True``) rank 0 prints at wrap time: what runs and how
        to turn it off."""
        plan = self.plan
        final, warm = self._final(density_now)
        taken_over = plan.resolved.taken_over.said
        if plan.adam.freeze not in (None, plan.resolved.freeze):
            warm = plan.resolved.schedule.describe(plan.adam.freeze)
        if plan.exact_adam(0):  # Adam taken over by a compressor of its own collectives
            taken_over = plan.resolved.schedule.describe()
        if plan.adam.declined:
            warm = ""
            little = "every tensor goes dense on this link" if not plan.adam.share else \
                f"{plan.adam.share:.1%} of the gradient would go sparse on this link (under " \
                f"{ADAM_SPARSE_SHARE:.0%}: every tensor goes dense)"
            taken_over = f"Adam not taken over: {little}, so exact Adam runs throughout " \
                         f"(adam.py)"
        large = [t for t in plan.tensors if plan.large(t)]
        if plan.resolved.sparse:  # those the cost model sends dense even at the final density
            large = [t for t in large if plan.path(t, final) != PathKind.DENSE]
        large = len(large) - len(plan.exchanged.dense())
        sums = [p for p in SUMS if p in self._sums(final)]
        return summary(self.kind_name(), final, warm, plan.min_compress_size,
                       plan.resolved.dense_fp16, gather_value_bits(plan.compressor), delay,
                       large,
                       len(plan.tensors), framework, sums, period, taken_over,
                       self.measured_words(), plan.resolved.zero_one)
