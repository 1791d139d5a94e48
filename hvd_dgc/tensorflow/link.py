"""DGC's own work on this device (hvd_dgc/localcost.py) with the compressor's own
selection and records, or a payload compressor's encoding and decoding, in a
``tf.function`` as a step runs them: ``cost_model="measure"`` (the link itself is timed
by hvd_dgc/linkprobe.py on the seam, hvd_dgc/seam.py). And the link watched while
Keras' ``fit`` trains (``LinkWatchInFit``, on hvd_dgc/linkwatch.py ``LinkWatcher``)."""

import time

import tensorflow as tf
import horovod.tensorflow as _hvd

from hvd_dgc.linkwatch import LinkWatcher, relinked_words
from hvd_dgc.localcost import CALIBRATION_NUMEL, calibrate, calibrate_payload
from hvd_dgc.tensorflow.memory import write_at
from hvd_dgc.tensorflow.seam import HorovodCollectives

__all__ = ["measure_local", "measure_payload", "LinkWatchInFit"]


def measure_local(compressor, collectives, density, device=None):
    """The ``LocalCost`` of a sparse ``compressor`` (``select``, ``pack``,
    ``scatter_sum``), agreed over ``collectives`` (hvd_dgc/seam.py: the slowest rank's):
    its selection over a synthetic memory, and the records taken out of the memory,
    packed and summed, each in a ``tf.function`` (traced first). ``device``: PyTorch's
    signature (TensorFlow places the ops itself)."""
    v = tf.Variable(tf.random.stateless_normal([CALIBRATION_NUMEL], seed=[0, 0]),
                    trainable=False)
    # what the step's memory becomes once cleared where selected (write_at: a write of
    # all of it), kept apart so that every timed call selects from the same values
    cleared = tf.Variable(tf.zeros_like(v), trainable=False)
    seed = tf.constant([0, 0])

    @tf.function(autograph=False)
    def select(k):
        value = v.read_value()
        indices = compressor.select(value, k, seed)
        write_at(cleared, indices, tf.zeros(tf.shape(indices)), value)
        return indices

    @tf.function(autograph=False)
    def records(indices):
        values = tf.gather(v.read_value(), indices)  # what leaves the memory
        return compressor.scatter_sum(compressor.pack(values, indices), CALIBRATION_NUMEL)

    def timed_select(numel, k):
        return _fastest(select, tf.constant(k, tf.int32))

    def timed_records(k):
        indices = tf.random.stateless_uniform([k], seed=[1, 0], maxval=CALIBRATION_NUMEL,
                                              dtype=tf.int32)
        return _fastest(records, indices)
    return calibrate(timed_select, timed_records, collectives, density)


def _fastest(fn, *args, times=3):
    """The fastest of ``times`` calls of the ``tf.function`` ``fn`` (traced first, not
    timed), its results read back."""
    fn(*args)
    best = float("inf")
    for _ in range(times):
        start = time.perf_counter()
        out = fn(*args)
        tf.nest.map_structure(lambda t: t.numpy(), out)
        best = min(best, time.perf_counter() - start)
    return best


def measure_payload(compressor, collectives, device=None):
    """The agreed ``PayloadCost`` of a payload ``compressor`` (sign, QSGD, bf16:
    ``encode``, ``decode``): one payload of a synthetic memory encoded, and decoded, in a
    ``tf.function`` as a step runs them (``device``: as ``measure_local``)."""
    v = tf.random.stateless_normal([CALIBRATION_NUMEL], seed=[0, 0])
    payload = compressor.encode(v, tf.constant([0, 0]))

    def encode(numel):
        return _fastest(tf.function(lambda: compressor.encode(v[:numel], tf.constant([0, 0])),
                                    autograph=False))

    def decode(numel):
        return _fastest(tf.function(lambda: compressor.decode(payload, numel), autograph=False))
    return calibrate_payload(encode, decode, collectives)


class LinkWatchInFit:
    """The link watch (hvd_dgc/linkwatch.py ``LinkWatcher``) of one Keras optimizer's
    exchange, driven between ``fit``'s batches by hvd_dgc's
    ``BroadcastGlobalVariablesCallback`` or ``DGCCallback`` (keras/callbacks.py
    ``_StepTimer``). A TF step runs its collectives inside its graph, so what is timed is
    the whole train step (its exchange and its compute): a link that got slower or faster
    moves it the same way. A window's agreement is one small blocking allreduce between
    batches, every rank at the same batch. Where the paths follow a new link, ``observe``
    returns True: ``fit`` must trace its step again (the paths are in the graph)."""

    def __init__(self, watch, exchange):
        self.exchange = exchange
        self.watcher = LinkWatcher(watch, HorovodCollectives(exchange.process_set),
                                   in_flight=False)
        self.state = self.watcher.state

    def observe(self, seconds, step):
        """One train step's ``seconds``; True where the paths changed."""
        if not self.watcher.observe(seconds):
            return False
        exchange, planner = self.exchange, self.exchange.planner
        density, launches = exchange.priced_now()
        relink = self.watcher.end_window(planner, density, launches, step)
        if relink is None:
            return False
        was = planner.link
        changed = exchange.relink(relink.link)
        if _hvd.rank() == 0:  # (short unless verbose)
            print(relinked_words(step, relink.link, was, relink.before, relink.after,
                                 planner, density, changed), flush=True)
        return changed
