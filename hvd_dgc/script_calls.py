"""The calls a set-up works only with, which a script may never make, and what rank 0
says once when it has not made them by a step (schedule.py ``check_steps``).

- ``set_epoch``, for a warm-up counted in epochs (both frameworks);
- in Keras, ``flush``, for an optimizer whose ranks' weights differ between exchanges
  (``delay``, ``period``), unless a callback of hvd_dgc's in ``fit`` flushes;
- in Keras, a callback of hvd_dgc's in ``fit`` to time the steps, for a link watch the
  script asked for.

The framework reports what the script did (``epoch_set``, ``flushed``,
``fit_callback``) and asks at each step whether this is the step to judge
(``at_step``, or ``due`` in Python); ``judge`` then says what is missing.
"""

from hvd_dgc.say import rank0_once
from hvd_dgc.schedule import check_steps, epoch_check_steps, stuck_epoch_message

__all__ = ["ScriptCalls"]


class ScriptCalls:
    """``schedule``: the density schedule in force; ``epoch_fix``: how this framework's
    script sets the epoch (the words of the fix); ``lagging``: the words of a Keras
    optimizer's ``delay``/``period`` that need a flush (empty: none needed);
    ``link_watch``: the watch a Keras script asked for and its steps must time (None:
    none, or none that can act)."""

    def __init__(self, schedule, epoch_fix, lagging="", link_watch=None):
        self.schedule, self.epoch_fix = schedule, epoch_fix
        self.lagging, self.link_watch = lagging, link_watch
        self.epoch_check = epoch_check_steps(schedule)
        self.epoch_set = self.flushed = self.fit_callback = False
        self._judged = False

    def needed(self):
        """Whether any call is needed at all (else nothing is judged)."""
        return bool(self.epoch_check or self.lagging or self.link_watch is not None)

    def at_step(self):
        """The step at which the calls are judged (0: never)."""
        return check_steps() if self.needed() else 0

    def due(self, step):
        """For a framework that judges in Python after each step: whether ``step`` is the
        first at or past ``at_step`` (then never again)."""
        at = self.at_step()
        if not at or self._judged or step < at:
            return False
        self._judged = True
        return True

    def judge(self, step, epoch):
        """Rank 0 says, once each, what the script has not done by ``step``."""
        if self.lagging and not self.flushed and not self.fit_callback:
            rank0_once(f"hvd_dgc: with {self.lagging} each rank's weights differ from the "
                       f"others' until optimizer.flush(), and nothing has flushed by step "
                       f"{step}. In model.fit pass "
                       f"hvd.callbacks.BroadcastGlobalVariablesCallback(0) or DGCCallback() "
                       f"(they flush before each evaluation, at each epoch's end and at the "
                       f"end); in your own loop call optimizer.flush() before evaluating or "
                       f"saving.", UserWarning, key="hvd_dgc.never_flushed")
        if self.link_watch is not None and not self.fit_callback:
            rank0_once(f"hvd_dgc: link_watch={self.link_watch!r} has timed no step by step "
                       f"{step}: it needs model.fit with "
                       f"hvd.callbacks.BroadcastGlobalVariablesCallback(0) or DGCCallback(), "
                       f"which time the steps.", UserWarning, key="hvd_dgc.link_watch_idle")
        if self.epoch_check and not self.epoch_set:
            rank0_once(stuck_epoch_message(self.schedule, step, float(epoch), self.epoch_fix),
                       UserWarning, key="hvd_dgc.epoch_never_set")
