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

Up to D+1 steps' collectives run at once (one thread each for the sparse and
the dense group of a step), so Horovod negotiates and moves them together, as
it does for the PyTorch side's asynchronous handles: one thread in turn would
pay every step's round trips one after another. The threads take the
collectives in launch order, the same on every rank, so they always meet.
Each runs as a small tf.function (eager Horovod ops cannot overlap: see
``_function``), which needs a second inter-op thread: the step's graph holds
one while it waits (checked when the exchange is built).

The correction is exact for optimizers whose update is linear in the gradient
(SGD); with the Keras optimizer DGC takes SGD's momentum over, as on the
PyTorch side.
"""

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import tensorflow as tf
import horovod.tensorflow as _hvd
from horovod.tensorflow.mpi_ops import Average


__all__ = ["DelayedAveraging", "SPARSE", "DENSE"]

DENSE, SPARSE = 0, 1  # path flags carried next to each payload


class DelayedAveraging:
    """The collectives of one GradientExchange's last ``delay`` steps, in flight.

    Payloads arrive as flat int32 tensors: sparse records ``[index, value bits]``
    or a dense float32 tensor's bits, so one ``tf.cond`` can return either. Only
    the collectives and cheap work run on the threads; the scatter into dense
    tensors happens in the graph, as on the synchronous path."""

    def __init__(self, exchange, variables):
        _check_inter_op_threads(exchange.delay)
        self.exchange = exchange
        self.variables = list(variables)  # for flush(); not tracked by any checkpoint
        self._inflight = {}               # step -> [Future], each of {tensor: (records, dense)}
        self._pool = ThreadPoolExecutor(2 * (exchange.delay + 1),
                                        thread_name_prefix="hvd_dgc_dga")
        self._functions = {}  # (name, count) -> tf.function running one grouped collective

    @property
    def in_flight(self):
        return len(self._inflight)

    # -- called from the graph (tf.py_function) ---------------------------------
    def launch(self, step, paths, *payloads):
        step, paths = int(step), paths.numpy()
        arrays = [p.numpy() for p in payloads]
        # a name per slot: at most delay+1 steps are in flight, all on different slots
        name = f"hvd_dgc.dga{step % (self.exchange.delay + 1)}"
        futures = []
        for path, collective in ((SPARSE, self._gather), (DENSE, self._reduce)):
            chosen = [i for i, p in enumerate(paths) if p == path]
            if chosen:
                futures.append(self._pool.submit(collective, name, chosen, arrays))
        self._inflight[step] = futures
        return np.int32(step)

    def correction(self, step):
        """``avg - own`` of the launch at ``step``, per tensor as a pair: records to
        scatter (sparse path) and a dense part (dense path), the other one empty;
        both empty for a step never launched (before the first, or flushed before a
        checkpoint this run resumed from). The graph turns them into one tensor."""
        parts = self._result(self._inflight.pop(int(step), []))
        return [part for pair in parts for part in pair]

    def _result(self, futures):
        parts = [(_NO_RECORDS, _NO_DENSE)] * len(self.exchange.numels)
        for future in futures:
            for i, pair in future.result().items():
                parts[i] = pair
        return parts

    # -- the threads: collectives, and only cheap work besides ------------------------
    def _gather(self, name, chosen, arrays):
        ex = self.exchange
        pre, scale = ex._scales()[0], ex._gathered_scale()
        mine = [arrays[i].reshape(-1, 2) for i in chosen]
        gather = self._function(name + ".sparse", len(mine), tf.TensorSpec([None, 2], tf.int32),
                                lambda t, n: _hvd.grouped_allgather(
                                    t, name=n, process_set=ex.process_set))
        gathered = gather(*mine)
        # avg - own as records: everyone's scaled, then this rank's negated
        return {i: (np.concatenate([_scaled(everyone.numpy(), scale), _scaled(own, -1 / pre)]),
                    _NO_DENSE) for i, own, everyone in zip(chosen, mine, gathered)}

    def _reduce(self, name, chosen, arrays):
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
        return {i: (_NO_RECORDS, avg.numpy().astype(np.float32, copy=False) - mine)
                for i, mine, avg in zip(chosen, own, reduced)}

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
        total = [np.zeros([n], np.float32) for n in self.exchange.numels]
        for step in sorted(self._inflight):
            for t, (records, dense) in zip(total, self._result(self._inflight.pop(step))):
                if dense.size:
                    t += dense
                else:
                    np.add.at(t, records[:, 0], records[:, 1].view(np.float32))
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
