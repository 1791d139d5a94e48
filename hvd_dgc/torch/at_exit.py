"""What a rank still has in flight when its script ends.

Horovod shuts down at exit, and a rank that leaves with a collective in flight shuts it
down under the ranks still to submit their side of it: they fail with "Horovod has been
shut down". Synchronous training never leaves one (each step waits for its averages),
but delayed averaging and ``period`` keep the last steps in flight, an overlapped outer
loop its last round, the link watch a window's agreement; with ranks a few steps apart
(one finishes its compute first), the first to end would kill the others. So each owner
of such collectives registers a settle at exit that waits for what it has in flight (the
other ranks submit the same collectives at the same steps; a rank that failed has shut
Horovod down, which ends the wait). It only waits: an average still due is not applied,
nothing follows (``flush()`` applies it, before evaluating or saving).

The owner is held until exit: a script's optimizer is often freed when its training
function returns, before the interpreter exits, and its collectives are still in flight
then. So only owners that can leave some register (an optimizer with ``delay``/
``period``, an overlapped outer loop, a link watch). Registered after ``hvd.init()``,
so it runs before Horovod's own shutdown at exit (``atexit`` runs last-in, first-out).
"""

import atexit

__all__ = ["settle_at_exit"]


def settle_at_exit(owner, settle):
    """At exit, ``settle(owner)``; an error from a Horovod already shut down is moot."""
    atexit.register(_settle, owner, settle)


def _settle(owner, settle):
    try:
        settle(owner)
    except Exception:  # noqa: BLE001  (Horovod already shut down: nothing to wait for)
        pass
