"""The link probe (hvd_dgc/linkprobe.py) with Horovod's TensorFlow allreduce (eager), and
DGC's own work on this device (hvd_dgc/localcost.py) with the compressor's own selection
and records, or a payload compressor's encoding and decoding, in a ``tf.function`` as a
step runs them: ``cost_model="measure"``. And the link watched while Keras' ``fit``
trains (hvd_dgc/linkwatch.py, ``LinkWatcher``)."""

import time

import tensorflow as tf
import horovod.tensorflow as _hvd
from horovod.tensorflow.mpi_ops import Max, Sum

from hvd_dgc.linkprobe import measure_link
from hvd_dgc.linkwatch import LinkWatchState, judge_probe, relinked_words
from hvd_dgc.localcost import CALIBRATION_NUMEL, calibrate, calibrate_payload
from hvd_dgc.tensorflow.memory import write_at

__all__ = ["measure", "measure_local", "measure_payload", "LinkWatcher"]


def _agree(process_set, name):
    def agree(values):
        return _hvd.allreduce(tf.constant(values, tf.float64), op=Max, name=name,
                              process_set=process_set).numpy().tolist()
    return agree


def measure(process_set, peers=()):
    """The agreed ``LinkMeasurement`` of ``process_set``'s ranks (None for one rank), and
    inside this rank's host where ``peers`` (its global ranks, hierarchical DGC's) are
    several; eager, outside any trace, every rank at the same point (the exchange's
    build)."""
    def allreduce(numel):
        tensor = tf.zeros([numel])
        start = time.perf_counter()
        _hvd.allreduce(tensor, op=Sum, name=f"hvd_dgc.probe.{numel}",
                       process_set=process_set).numpy()
        return time.perf_counter() - start

    def allgather(numel):
        tensor = tf.zeros([numel])
        start = time.perf_counter()
        _hvd.allgather(tensor, name=f"hvd_dgc.probe.gather.{numel}",
                       process_set=process_set).numpy()
        return time.perf_counter() - start

    def alltoall(numel):  # (hierarchical DGC's first round: nothing across hosts)
        splits = [numel if r in peers and r != _hvd.rank() else 0
                  for r in range(process_set.size())]
        tensor = tf.zeros([sum(splits)])
        start = time.perf_counter()
        _hvd.alltoall(tensor, splits=tf.constant(splits, tf.int32),
                      name=f"hvd_dgc.probe.host.{numel}", process_set=process_set)[0].numpy()
        return time.perf_counter() - start
    return measure_link(allreduce, _agree(process_set, "hvd_dgc.probe.agree"),
                        process_set.size(), allgather=allgather,
                        alltoall=alltoall if len(peers) > 1 else None,
                        local_size=len(peers))


def measure_local(compressor, process_set, density):
    """The agreed ``LocalCost`` of a sparse ``compressor`` (``select``, ``pack``,
    ``scatter_sum``): its selection over a synthetic memory, and the records taken out
    of the memory, packed and summed, each in a ``tf.function`` (traced first)."""
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
    return calibrate(timed_select, timed_records,
                     _agree(process_set, "hvd_dgc.calibrate.agree"), density)


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


def measure_payload(compressor, process_set):
    """The agreed ``PayloadCost`` of a payload ``compressor`` (sign, QSGD, bf16:
    ``encode``, ``decode``): one payload of a synthetic memory encoded, and decoded, in a
    ``tf.function`` as a step runs them."""
    v = tf.random.stateless_normal([CALIBRATION_NUMEL], seed=[0, 0])
    payload = compressor.encode(v, tf.constant([0, 0]))

    def encode(numel):
        return _fastest(tf.function(lambda: compressor.encode(v[:numel], tf.constant([0, 0])),
                                    autograph=False))

    def decode(numel):
        return _fastest(tf.function(lambda: compressor.decode(payload, numel), autograph=False))
    return calibrate_payload(encode, decode, _agree(process_set, "hvd_dgc.calibrate.agree"))


class LinkWatcher:
    """The link watch of one Keras optimizer's exchange, driven between ``fit``'s batches
    by hvd_dgc's ``BroadcastGlobalVariablesCallback`` or ``DGCCallback`` (keras/callbacks.py
    ``_StepTimer``; hvd_dgc/linkwatch.py says what and why). A TF step runs its
    collectives inside its graph, so what is timed is the whole train step (its
    exchange and its compute): a link that got slower or faster moves it the same way.
    At a window's end the ranks agree on its sums (max; one small blocking allreduce
    between batches, every rank at the same batch) and, where they say the link
    changed, probe it there; where the new numbers move the step's exchange on its
    paths enough, each tensor's path is chosen afresh and ``observe`` returns True:
    ``fit`` must trace its step again (the paths are in the graph)."""

    made = 0  # watchers made in this process: each names its collectives apart

    def __init__(self, watch, exchange):
        self.state = LinkWatchState(watch)
        self.exchange = exchange
        LinkWatcher.made += 1
        self._name = f"hvd_dgc.linkwatch.{LinkWatcher.made}"

    def observe(self, seconds, step):
        """One train step's ``seconds``; True where the paths changed."""
        state = self.state
        state.observe(seconds)
        if not state.window_done():
            return False
        exchange, planner = self.exchange, self.exchange.planner
        density, launches = exchange.priced_now()
        now = (density, planner.generation)
        agreed = tuple(_hvd.allreduce(tf.constant(state.take_window(), tf.float64), op=Max,
                                      name=self._name,
                                      process_set=exchange.process_set).numpy().tolist())
        moved = state.decide(agreed, now, now)
        if not moved:
            return False
        link = measure(exchange.process_set)
        relinked, before, after = judge_probe(planner, link, density, launches,
                                              state.watch.change, moved)
        changed = False
        if relinked:
            was = planner.link
            changed = exchange.relink(link)
            if _hvd.rank() == 0:
                print(relinked_words(step, link, was, before, after, planner, density,
                                     changed), flush=True)  # (short unless verbose)
        state.probed(relinked, step)
        return changed
