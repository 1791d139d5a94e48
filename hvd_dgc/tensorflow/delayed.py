"""Delayed gradient averaging (Zhu et al., NeurIPS 2021) for TensorFlow.

A TF step runs its graph to completion, and Horovod's TF collectives return no
handle that outlives it, so the collectives cannot simply be left in flight
inside the graph. Instead the graph hands each step's payloads to worker
threads (``tf.py_function``), which run Horovod's eager collectives while the
next steps compute, and asks for the step launched ``delay`` steps ago, which
is long done unless the link is slower than ``delay`` steps of compute:

    step i (graph):  own_i, payload_i = DGC(g_i)          hvd_dgc/tensorflow/exchange.py
                     launch(i, payload_i)                  -> threads: allgather, allreduce
                     c = correction(i - D)                 avg_(i-D) - own_(i-D)
                     update_i = own_i + c                  fed to the optimizer

Up to D+1 steps' collectives run at once (one thread each for the allgather,
the region reduce and the dense group of a step), so Horovod negotiates and moves them together, as
it does for the PyTorch side's asynchronous handles: one thread in turn would
pay every step's round trips one after another. The threads take the
collectives in launch order, the same on every rank, so they always meet.
Each runs as a small tf.function (eager Horovod ops cannot overlap: see
``_function``), which needs a second inter-op thread: the step's graph holds
one while it waits (checked when the exchange is built).

Region reduce's owners give their unsent sums back into their memory when the
graph takes step i-D's correction (as the PyTorch side does when it collects).

The correction is exact for optimizers whose update is linear in the gradient
(SGD); with the Keras optimizer DGC takes SGD's momentum over, as on the
PyTorch side.
"""

import os
from concurrent.futures import ThreadPoolExecutor

from typing import NamedTuple

import numpy as np
import tensorflow as tf
import horovod.tensorflow as _hvd
from horovod.tensorflow.mpi_ops import Average

from hvd_dgc.tensorflow.region import region_reduce

__all__ = ["DelayedAveraging", "SPARSE", "DENSE", "REGION", "GATHER"]

# path flags carried next to each payload (GATHER: a one-round compressor's payload,
# hvd_dgc/tensorflow/collective.py)
DENSE, SPARSE, REGION, GATHER = 0, 1, 2, 3


class _Correction(NamedTuple):
    """``avg - own`` of one tensor of one launch, and what region reduce gives back."""

    records: np.ndarray   # [m, 2] int32 (index, value bits) to scatter-add (allgather)
    dense: np.ndarray     # or a dense float32 part (dense allreduce, region reduce)
    returned: np.ndarray  # [r, 2] records this rank, as owner, adds to its residual
    kept: int = 0         # records this rank kept, as owner, and sent on


class DelayedAveraging:
    """The collectives of one GradientExchange's last ``delay`` steps, in flight.

    Payloads arrive as flat int32 tensors: sparse records ``[index, value bits]``
    or a dense float32 tensor's bits, so one ``tf.switch_case`` can return either. Only
    the collectives and cheap work run on the threads; the scatter into dense
    tensors happens in the graph, as on the synchronous path."""

    def __init__(self, exchange, variables):
        _check_inter_op_threads(exchange.delay)
        self.exchange = exchange
        self.variables = list(variables)  # for flush(); not tracked by any checkpoint
        self._inflight = {}               # step -> [Future], each of {tensor: (records, dense)}
        self._pool = ThreadPoolExecutor(3 * (exchange.delay + 1),
                                        thread_name_prefix="hvd_dgc_dga")
        self._functions = {}  # (name, count) -> tf.function running one grouped collective

    @property
    def in_flight(self):
        return len(self._inflight)

    # -- called from the graph (tf.py_function) ---------------------------------
    def launch(self, step, paths, ks, *payloads):
        step, paths, ks = int(step), paths.numpy(), ks.numpy()
        arrays = [p.numpy() for p in payloads]
        # a name per slot: at most delay+1 steps are in flight, all on different slots
        name = f"hvd_dgc.dga{step % (self.exchange.delay + 1)}"
        futures = []
        for path, collective in ((SPARSE, self._gather), (REGION, self._region),
                                 (DENSE, self._reduce), (GATHER, self._exchange)):
            chosen = [i for i, p in enumerate(paths) if p == path]
            if chosen:
                futures.append(self._pool.submit(collective, name, chosen, arrays, ks))
        self._inflight[step] = futures
        return np.int32(step)

    def correction(self, step):
        """``avg - own`` of the launch at ``step``, per tensor as three parts: records to
        scatter (allgather) and a dense part (dense, region), the other one empty, and
        the records region reduce gives back to this rank's residual; all empty for a
        step never launched (before the first, or flushed before a checkpoint this run
        resumed from). The graph turns them into one tensor. Last: the records this rank
        kept as region owner (bytes it sent)."""
        parts = self._result(self._inflight.pop(int(step), []))
        return [x for c in parts for x in c[:3]] + [np.int64(sum(c.kept for c in parts))]

    def _result(self, futures):
        parts = [_Correction(_NO_RECORDS, _NO_DENSE, _NO_RECORDS)] * len(self.exchange.numels)
        for future in futures:
            for i, correction in future.result().items():
                parts[i] = correction
        return parts

    # -- the threads: collectives, and only cheap work besides ------------------------
    def _gather(self, name, chosen, arrays, ks):
        ex = self.exchange
        pre, scale = ex._scales()[0], ex._gathered_scale()
        mine = [arrays[i].reshape(-1, 2) for i in chosen]
        comp = ex.compression  # records travel as comp.to_wire makes them (fp16 values)
        gather = self._function(name + ".sparse", len(mine), tf.TensorSpec([None, 2], tf.int32),
                                lambda t, n: [comp.from_wire(g) for g in _hvd.grouped_allgather(
                                    [comp.to_wire(x) for x in t], name=n,
                                    process_set=ex.process_set)])
        gathered = gather(*mine)
        # avg - own as records: everyone's scaled, then this rank's negated
        return {i: _Correction(np.concatenate([_scaled(everyone.numpy(), scale),
                                               _scaled(own, -1 / pre)]), _NO_DENSE, _NO_RECORDS)
                for i, own, everyone in zip(chosen, mine, gathered)}

    def _region(self, name, chosen, arrays, ks):
        """Region reduce (hvd_dgc/tensorflow/region.py) of the chosen tensors, in one
        function so their collectives go together; avg - own as a dense part."""
        ex = self.exchange
        key = (name + ".region", tuple(chosen))
        reduce = self._functions.get(key)
        if reduce is None:
            numels = [ex.numels[i] for i in chosen]

            def run(k, *records):
                return [region_reduce(r[:, 0], tf.bitcast(r[:, 1], tf.float32), n, k[j],
                                      f"{name}.region.{i}", ex.process_set)
                        for j, (i, r, n) in enumerate(zip(chosen, records, numels))]
            reduce = tf.function(run, input_signature=[tf.TensorSpec([len(chosen)], tf.int32)]
                                 + [tf.TensorSpec([None, 2], tf.int32)] * len(chosen))
            self._functions[key] = reduce
        mine = [arrays[i].reshape(-1, 2) for i in chosen]
        results = reduce(np.asarray([ks[i] for i in chosen], np.int32), *mine)
        scale = np.float32(ex._region_scale())
        out = {}
        for i, own_records, res in zip(chosen, mine, results):
            correction = res.total.numpy() * scale
            correction[own_records[:, 0]] -= own_records[:, 1].view(np.float32)  # distinct
            returned = np.stack([res.returned_indices.numpy(),
                                 res.returned_values.numpy().view(np.int32)], axis=1)
            out[i] = _Correction(_NO_RECORDS, correction, returned, int(res.kept))
        return out

    def _reduce(self, name, chosen, arrays, ks):
        ex = self.exchange
        pre, post = ex._scales()
        own = [arrays[i].view(np.float32) for i in chosen]
        fp16 = ex.dense_fp16
        reduce = self._function(name + ".dense", len(own),
                                tf.TensorSpec([None], tf.float16 if fp16 else tf.float32),
                                lambda t, n: _hvd.grouped_allreduce(
                                    t, op=ex.op, name=n, prescale_factor=pre,
                                    postscale_factor=post, process_set=ex.process_set))
        reduced = reduce(*[v.astype(np.float16) if fp16 else v for v in own])
        return {i: _Correction(_NO_RECORDS, avg.numpy().astype(np.float32, copy=False) - mine,
                               _NO_RECORDS) for i, mine, avg in zip(chosen, own, reduced)}

    def _exchange(self, name, chosen, arrays, ks):
        """A one-round compressor's payloads (sign, QSGD, bf16), allgathered; every rank
        decodes them in rank order; avg - own as a dense part (own: this rank's payload
        decoded, as the graph did)."""
        ex = self.exchange
        comp, world = ex.compression, ex.world_size()
        mine = [arrays[i].view(np.uint8)[:comp.payload_bytes(ex.numels[i])] for i in chosen]
        gather = self._function(name + ".exchange", len(mine), tf.TensorSpec([None], tf.uint8),
                                lambda t, n: _hvd.grouped_allgather(
                                    t, name=n, process_set=ex.process_set))
        out = {}
        for i, own, everyone in zip(chosen, mine, gather(*mine)):
            n = ex.numels[i]
            mean = comp.finish(everyone, n, world)
            if ex.op != Average:
                mean = mean * world
            correction = mean - comp.decode(tf.constant(own), n)
            out[i] = _Correction(_NO_RECORDS, correction.numpy(), _NO_RECORDS)
        return out

    def _function(self, name, count, spec, collective):
        """``collective(tensors, name)`` as a tf.function with its own graph node. Eager
        Horovod ops are all named after their op type (TF's eager kernels ignore
        ``name=``), so two eager allgathers in flight at once would collide."""
        fn = self._functions.get((name, count))
        if fn is None:
            fn = tf.function(lambda *tensors: collective(list(tensors), name),
                             input_signature=[spec] * count)
            self._functions[(name, count)] = fn
        return fn

    # -- end of training, evaluation, checkpoint ----------------------------------
    def drain(self):
        """Wait for every launch still in flight; the sum of their corrections per
        tensor (flat float32), or None when nothing was in flight."""
        if not self._inflight:
            return None
        ex = self.exchange
        total = [np.zeros([n], np.float32) for n in ex.numels]
        for step in sorted(self._inflight):
            for i, (t, c) in enumerate(zip(total, self._result(self._inflight.pop(step)))):
                if c.dense.size:
                    t += c.dense
                else:
                    np.add.at(t, c.records[:, 0], c.records[:, 1].view(np.float32))
                if ex.regioned is not None:
                    ex._region_done(i, tf.constant(c.kept, tf.int64), c.returned[:, 0],
                                    tf.constant(c.returned[:, 1].view(np.float32)))
        return total


def _check_inter_op_threads(delay):
    """The step's graph holds one inter-op thread while it waits for step i-D; the
    collectives' functions need another to start on."""
    configured = tf.config.threading.get_inter_op_parallelism_threads()
    threads = configured or os.cpu_count() or 1
    if threads < 2:
        raise RuntimeError(
            f"hvd_dgc: delay={delay} in TensorFlow needs at least 2 inter-op threads (this "
            f"process has {threads}{' (set by the user)' if configured else ', one per CPU'}): "
            f"one waits inside the training step for the average of step i-{delay}, another "
            f"starts the collectives. Call tf.config.threading."
            f"set_inter_op_parallelism_threads(2) (or more) before TensorFlow runs anything, "
            f"or use delay=0.")


_NO_RECORDS = np.zeros([0, 2], np.int32)
_NO_DENSE = np.zeros([0], np.float32)


def _scaled(records, factor):
    """Records ``[index, value bits]`` with their values multiplied by ``factor``."""
    out = records.copy()
    out[:, 1] = (records[:, 1].view(np.float32) * np.float32(factor)).view(np.int32)
    return out
