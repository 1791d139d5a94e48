"""Runtime messages: on rank 0, once.

What hvd_dgc says while a job runs goes through here, from the PyTorch and the
TensorFlow/Keras side alike:

    rank0_once(message, category=UserWarning)   a warning, rank 0, once per key
    rank0_warn(message, category=UserWarning)   a warning, rank 0 (said once by the caller)
    say(line)                                    a printed line, rank 0, once per key
    is_rank0()                                   whether this process is rank 0

A message is keyed by its text unless ``key=`` is given (use a key for a message
whose text carries a changing number, so that it is still said once). A warning
that is truly about one rank (it names the rank) should go through
``warnings.warn`` on that rank instead.

The rank is Horovod's, from whichever of ``horovod.torch`` / ``horovod.tensorflow``
is imported and initialised; before ``hvd.init()`` it is read from the launcher's
environment (``HOROVOD_RANK``, Open MPI's, PMI's), and a process started without
a launcher is rank 0.
"""

import os
import sys
import threading
import warnings

__all__ = ["rank0_once", "rank0_warn", "say", "is_rank0", "rank", "verbose", "reset"]

_said = set()
_lock = threading.Lock()
_RANK_VARIABLES = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def rank():
    """This process's Horovod rank (0 where it cannot be known: a single process)."""
    for module in ("horovod.torch", "horovod.tensorflow"):
        hvd = sys.modules.get(module)
        if hvd is None:
            continue
        try:
            return int(hvd.rank())
        except Exception:  # imported but not initialised
            continue
    for name in _RANK_VARIABLES:
        value = os.environ.get(name)
        if value is not None and value.strip().isdigit():
            return int(value)
    return 0


def is_rank0():
    return rank() == 0


def _first(key):
    """True the first time ``key`` is seen in this process."""
    with _lock:
        if key in _said:
            return False
        _said.add(key)
        return True


def rank0_once(message, category=UserWarning, key=None, stacklevel=2):
    """``warnings.warn(message, category)`` on rank 0, the first time only; returns
    whether it was issued."""
    if not is_rank0() or not _first(("warn", key if key is not None else message)):
        return False
    warnings.warn(message, category, stacklevel=stacklevel + 1)
    return True


def rank0_warn(message, category=UserWarning, stacklevel=2):
    """``warnings.warn(message, category)`` on rank 0 (each call: for a warning the
    caller already says once, per optimizer or per event); returns whether issued."""
    if not is_rank0():
        return False
    warnings.warn(message, category, stacklevel=stacklevel + 1)
    return True


def say(line, key=None, once=True):
    """Print ``line`` on rank 0 (flushed), by default once per key; returns whether it
    was printed."""
    if not is_rank0():
        return False
    if once and not _first(("say", key if key is not None else line)):
        return False
    print(line, flush=True)
    return True


def verbose(option=False):
    """Whether the full texts are wanted: the ``verbose`` option, or
    ``HVD_DGC_VERBOSE`` set to 1/true/yes/on in the environment."""
    value = os.environ.get("HVD_DGC_VERBOSE", "").strip().lower()
    return bool(option) or value in ("1", "true", "yes", "on")


def reset():
    """Forget what was said (tests; a process that trains twice and wants it again)."""
    with _lock:
        _said.clear()
