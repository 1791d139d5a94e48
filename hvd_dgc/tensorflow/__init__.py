"""``import hvd_dgc.tensorflow as hvd``: everything ``horovod.tensorflow`` has, plus DGC.

``hvd.DistributedGradientTape(tape, ...)`` keeps Horovod's signature and sends
each gradient through hvd_dgc/tensorflow/exchange.py (DGC by default).

A tape lives one step, but DGC's memory must outlive it: the memory belongs to
the set of variables differentiated (and the options), kept in a registry
(tape_exchanges.py), so ``hvd.DistributedGradientTape(tape)`` stays a one-line switch
inside or outside ``tf.function``. ``hvd.set_epoch(e)`` drives epoch-based warm-up and
``hvd.compression_stats()`` reports, for every exchange in this process.

``hvd.dgc_state`` is that registry as a ``tf.Module``: put it in your
checkpoint, ``tf.train.Checkpoint(model=..., optimizer=..., dgc=hvd.dgc_state)``,
and the residuals, velocities, step and epoch come back on restore (restore
before the first step: the memory is created then and filled from the
checkpoint). The memory differs per rank, so each rank saves its own file.

``delay=D`` (delayed gradient averaging) keeps each step's collectives in
flight for D steps; ``hvd.flush(optimizer)`` applies what is still in flight
and leaves every rank with the same weights: call it before evaluating or
checkpointing, and at the end of training.
"""

import importlib
from concurrent.futures import ThreadPoolExecutor

from horovod.tensorflow import *  # noqa: F401,F403  (the one-line switch)
from horovod.tensorflow import Average, global_process_set
import tensorflow as tf

from hvd_dgc.config import DGCConfig
from hvd_dgc.resolve import HorovodArguments
from hvd_dgc.autodelay import AutoDelay  # noqa: F401 (delay=hvd.AutoDelay(...))
from hvd_dgc.costmodel import CostModel  # noqa: F401
from hvd_dgc.schedule import DensitySchedule  # noqa: F401
from hvd_dgc.tensorflow.compression import Compression
from hvd_dgc.tensorflow.exchange import HOROVOD_OPS, TENSORFLOW, GradientExchange
from hvd_dgc.tensorflow.tape_exchanges import (  # noqa: F401 (hvd.set_epoch, ...)
    compression_stats, dgc_state, exchange_for, flush, in_flight, set_epoch, variable_ref)

# Horovod's star import bound `elastic` to its own module; ours (Horovod's names, with
# hvd_dgc's state committed) takes its place, as in hvd_dgc.torch
elastic = importlib.import_module("hvd_dgc.tensorflow.elastic")


class _DistributedGradientTape(tf.GradientTape):
    def __init__(self, tape, options, persistent=False, watch_accessed_variables=True):
        super(self.__class__, self).__init__(persistent, watch_accessed_variables)
        self._tape = tape
        self._dgc_options = options
        self._local_sources = set()

    def register_local_source(self, source):
        """As in Horovod: this variable's gradient stays local (no exchange)."""
        self._local_sources.add(variable_ref(source))

    @tf.autograph.experimental.do_not_convert  # as the optimizer's (optimizer.py)
    def gradient(self, target, sources, output_gradients=None, use_generic_names=False):
        flat = tf.nest.flatten(sources)
        gradients = super(self.__class__, self).gradient(target, flat, output_gradients)
        shared = [i for i, s in enumerate(flat) if variable_ref(s) not in self._local_sources]
        variables = [flat[i] for i in shared]
        exchange = exchange_for(variables, self._dgc_options)
        _outside_trace(lambda: exchange.build(variables, [gradients[i] for i in shared]))
        averaged = exchange([gradients[i] for i in shared])
        out = list(gradients)
        for i, g in zip(shared, averaged):
            out[i] = g
        return tf.nest.pack_sequence_as(sources, out)


@tf.autograph.experimental.do_not_convert
def _outside_trace(make):
    """Run ``make`` (an exchange's build: it makes variables) where variables may be
    made. A ``tf.function`` may make variables on its first call only, even under
    ``init_scope``, and Horovod's TF2 elastic example calls its step once without the
    tape first (to make the optimizer's slots), so the tape's exchange is built on the
    second; a thread of its own runs eagerly, outside any trace. Not converted by
    AutoGraph (which would warn, in the user's log, that it cannot convert the
    thread's ``Future.result``): nothing here is a graph op."""
    if not tf.inside_function():
        return make()
    with ThreadPoolExecutor(1, thread_name_prefix="hvd_dgc_build") as pool:
        return pool.submit(make).result()


def DistributedGradientTape(gradtape, device_dense='', device_sparse='',
                            compression=Compression.dgc, sparse_as_dense=False, op=Average,
                            gradient_predivide_factor=1.0, num_groups=0, groups=None,
                            process_set=global_process_set, scale_local_gradients=True,
                            **options):
    """Horovod's DistributedGradientTape with Deep Gradient Compression.

    Horovod's arguments keep their meaning; ``compression`` defaults to
    ``Compression.dgc``; Horovod's ``Compression.none`` / ``fp16`` (which its example
    scripts pass) mean DGC with fp32 values / fp16 values (6-byte records and an fp16
    dense path, as in PyTorch); a compressor's name works too; ``density=1.0`` is dense
    averaging
    (hvd_dgc/switch.py). Rank 0 prints one line saying what runs.
    hvd_dgc's options, by keyword, are those of ``hvd_dgc.torch.DistributedOptimizer``
    (hvd_dgc.config.DGCConfig; ``log_every`` runs in PyTorch only so far). A tape
    does not know the optimizer, so its momentum is not taken over: the memory
    does error feedback and the optimizer applies its own momentum (use
    ``hvd_dgc.tensorflow.keras.DistributedOptimizer`` for momentum correction).
    ``groups`` is accepted for compatibility; each tensor is its own collective.
    An IndexedSlices gradient (an embedding lookup) comes back as IndexedSlices,
    averaged as Horovod averages it (rows and indices allgathered, no DGC);
    ``sparse_as_dense=True`` densifies it first (then DGC).

    ``delay=D``: delayed gradient averaging, as in the PyTorch optimizer: the
    tape returns ``own_i - own_(i-D) + avg_(i-D)``, exact with an optimizer whose
    update is linear in the gradient (SGD; with momentum, each rank's momentum
    also holds its own last D contributions until ``hvd.flush(optimizer)``).
    ``period=p``: every p-th step exchanges; in between the tape returns this rank's
    own gradient (what its memory took in) and sends nothing, and the exchange's
    average replaces those own steps when it is applied.

    ``skip_nonfinite`` (default True): a NaN/Inf gradient on any rank never enters
    the DGC memory. That rank sends inf, every rank sees it in the averages and
    puts back the memory it saved before the step (memory and step unchanged), and
    the tape returns NaN gradients on every rank, so check
    ``tf.math.is_finite`` before applying them or use a LossScaleOptimizer; counted
    in ``compression_stats()["nonfinite_steps"]``. With ``delay`` > 0 the rank that
    has the NaN sends zeros instead (the others applied their part already).
    """
    config = DGCConfig.from_options(options, "tensorflow", "DistributedGradientTape")
    if num_groups:
        groups = groups or num_groups
    # every wrap-time check now, not at the first gradient (the exchange, made for the
    # variables differentiated, resolves them for itself)
    config.resolve(TENSORFLOW, compression, HorovodArguments(
        op, gradient_predivide_factor, 1, groups, HOROVOD_OPS))
    options = dict(compression=compression, op=op,
                   gradient_predivide_factor=gradient_predivide_factor,
                   sparse_as_dense=sparse_as_dense, process_set=process_set, config=config)
    cls = type(gradtape.__class__.__name__, (gradtape.__class__,),
               dict(_DistributedGradientTape.__dict__))
    return cls(gradtape._tape, options, gradtape._persistent,
               gradtape._watch_accessed_variables)
