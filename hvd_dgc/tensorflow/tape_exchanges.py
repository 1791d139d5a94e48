"""The tape's exchanges of this process: a tape lives one step, but DGC's memory must
outlive it, so each exchange belongs to the set of variables differentiated (and the
options) and is kept here, made at its first step (``exchange_for``). ``dgc_state``
(``hvd.dgc_state``) holds them as checkpoint children; ``set_epoch``, ``flush``,
``in_flight`` and ``compression_stats`` act on them all (hvd_dgc/tensorflow/__init__.py
exports them as Horovod-style functions; elastic.py syncs them)."""

import hashlib

import tensorflow as tf

from hvd_dgc.config import DGCConfig
from hvd_dgc.tensorflow.exchange import GradientExchange
from hvd_dgc.tensorflow.names import variable_name

__all__ = ["TapeExchanges", "dgc_state", "exchange_for", "variable_ref", "set_epoch", "flush",
           "in_flight", "compression_stats", "EXCHANGES", "PENDING_SHARED"]

EXCHANGES = {}  # (variable refs, options key) -> GradientExchange
EPOCH = [None]  # what hvd.set_epoch set last (None: never called)


class TapeExchanges(tf.Module):
    """The tape exchanges of this process (their memories, step, epoch, statistics), as
    checkpoint children named by their variables' names and shapes, so a new process
    finds its own again: ``hvd.dgc_state``."""

    def __init__(self):
        super().__init__(name="hvd_dgc_state")

    def _attach(self, exchange, variables):
        signature = repr([(variable_name(v, i), tuple(v.shape))
                          for i, v in enumerate(variables)])
        base = "exchange_" + hashlib.sha1(signature.encode()).hexdigest()[:12]
        name, n = base, 1
        while getattr(self, name, None) is not None:  # same variables, other options
            n += 1
            name = f"{base}_{n}"
        setattr(self, name, exchange)
        return name

    def by_name(self):
        """``{name: exchange}``, sorted: the same names on every rank that traced the
        same step (an elastic sync hands rank 0's step and epoch over by them)."""
        return {name: value for name, value in sorted(vars(self).items())
                if isinstance(value, GradientExchange)}


#: An elastic sync's shared state (rank 0's step and epoch) for a tape exchange this
#: rank has not made yet (a worker that joined, before its first tape step), by name.
PENDING_SHARED = {}


dgc_state = TapeExchanges()


def options_key(options):
    """Hashable and faithful: compressors, schedules and cost models by their config
    (two DGC compressors with different options differ), lists as tuples."""
    def key(value):
        if isinstance(value, DGCConfig):
            return value.key()
        config = getattr(value, "config", None)
        if callable(config):
            return config()
        return tuple(value) if isinstance(value, list) else value
    return tuple(sorted((name, key(value)) for name, value in options.items()))


class _Identity:
    """A dictionary key for a variable by identity. Keras 3 variables (TF 2.21's default
    ``tf.keras``) have no ``.ref()``; holding the variable, as a ``Reference`` does, keeps
    its id from being reused while it is a key."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __hash__(self):
        return id(self.obj)

    def __eq__(self, other):
        return isinstance(other, _Identity) and other.obj is self.obj


def variable_ref(variable):
    """A dictionary key for ``variable`` by identity (its ``ref()`` where it has one)."""
    ref = getattr(variable, "ref", None)
    return ref() if callable(ref) else _Identity(variable)


def exchange_for(sources, options):
    """The exchange of the variables ``sources`` under ``options`` (a tape's keyword
    arguments), made at its first use and kept for the process."""
    key = (tuple(variable_ref(s) for s in sources), options_key(options))
    exchange = EXCHANGES.get(key)
    if exchange is None:
        exchange = GradientExchange(**options)
        if EPOCH[0] is not None:  # hvd.set_epoch before this exchange's first step
            exchange.set_epoch(EPOCH[0])
        EXCHANGES[key] = exchange
        name = dgc_state._attach(exchange, sources)
        if name in PENDING_SHARED:
            exchange.load_shared_state(PENDING_SHARED.pop(name))
    return exchange


def set_epoch(epoch):
    """Epoch-based warm-up: call at the start of each epoch on every rank (0 first, as
    ``DistributedSampler.set_epoch``; before the first step too: a tape's exchange made
    later starts at the epoch set last)."""
    EPOCH[0] = epoch
    for exchange in EXCHANGES.values():
        exchange.set_epoch(epoch)


def flush(optimizer):
    """Delayed averaging (``delay=D``, ``period=p``): wait for the steps still in
    flight, apply their corrections ``avg - own`` (``-own`` of a period's steps since
    its last exchange) with ``optimizer`` as one extra step (its ``iterations`` left
    unchanged), and average the variables across ranks. Call it on every rank.
    Returns whether anything was in flight."""
    def apply(corrections, variables):
        optimizer.apply_gradients(zip(corrections, variables))
    iterations = getattr(optimizer, "iterations", None)
    flushed = [e.flush(apply, iterations) for e in EXCHANGES.values() if e.lags]
    return any(flushed)


def in_flight():
    """Steps of delayed averaging (or between a period's exchanges) not applied yet,
    over this process's exchanges."""
    return max([e.in_flight for e in EXCHANGES.values()] or [0])


def compression_stats():
    """Statistics of this process's exchange (a list when there are several)."""
    stats = [e.stats() for e in EXCHANGES.values() if e.memory is not None]
    return stats[0] if len(stats) == 1 else stats
