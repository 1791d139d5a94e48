"""The path of one gradient in TensorFlow, shared by DistributedGradientTape and the
Keras DistributedOptimizer:

    g = local_gradient(grad)              flat float32, clipped at clip_norm / sqrt(N)
    v = memory.accumulate(i, g)           u = m u + g; v += u   (momentum correction)
    k = ceil(numel * density)             density: the warm-up stage, from step/epoch
    path = methods[i][stage]              the shared alpha-beta cost model's choice
                                          (costmodel.choose_aggregation), made in Python
                                          for each stage's k when the memory is built
    sparse: idx = select(v, k); records = pack(v[idx], idx); memory.sent(i, idx)
            avg = scatter_sum(allgather(records)) / N
    region: idx = select(v, k); memory.sent(i, idx)        hvd_dgc/tensorflow/region.py
            sum, unsent = region_reduce(idx, v[idx]); memory.give_back(i, unsent)
            avg = sum / N
    dense:  avg = allreduce(v, Average);  memory.sent_all(i)
    exchange (Compression.sign, qsgd, bf16, powersgd: they run their own collectives,
            hvd_dgc/tensorflow/collective.py):
            step = compressor.exchange(v, ...); memory.keep(i, v - step.sent)
            avg = step.mean

Every rank computes the same stage and the same path, so every rank joins the same
collective inside the same ``tf.switch_case`` branch.

With ``delay=D`` (delayed gradient averaging) the collectives leave the graph
for a worker thread and step i applies ``own_i + avg_(i-D) - own_(i-D)``: see
hvd_dgc/tensorflow/delayed.py.

A ``tf.IndexedSlices`` gradient (an embedding lookup) travels as Horovod sends it,
unless ``sparse_as_dense=True``: its rows and their indices, allgathered, no DGC
(it is sparse already) and no residual; the result is a ``tf.IndexedSlices``
(with an SGD's momentum taken over, the memory's velocity applies it: a dense
gradient).
"""

import os
import sys
import warnings
from typing import NamedTuple

import numpy as np
import tensorflow as tf
import horovod.tensorflow as _hvd
from horovod.tensorflow.mpi_ops import Adasum, Average, Max, Sum, global_process_set

from hvd_dgc import consistency
from hvd_dgc.config import DGCConfig, check_horovod_arguments
from hvd_dgc.config import aggregation_choices
from hvd_dgc.costmodel import CostModel
from hvd_dgc.paths import AGGREGATIONS, PathKind
_DENSE, _HIERARCHICAL, _REGION, _SPARSE = (PathKind.DENSE, PathKind.HIERARCHICAL,
                                           PathKind.REGION, PathKind.ALLGATHER)
from hvd_dgc.schedule import as_schedule, DensitySchedule, num_selected
from hvd_dgc.stats import CompressionStats
from hvd_dgc.masking import masking_density_limit
from hvd_dgc.fp16wire import clip_warning, fp16_bound
from hvd_dgc.switch import dense_requested, idle_warning, resolve_compression, summary
from hvd_dgc.tensorflow.compression import Compression, SparseCompressor, is_sparse
from hvd_dgc.tensorflow.delayed import DENSE, GATHER, REGION, SPARSE, DelayedAveraging
from hvd_dgc.tensorflow.memory import DGCMemory, local_gradient
from hvd_dgc.tensorflow.collective import Comm, ExchangeCompressor, is_exchange
from hvd_dgc.tensorflow.region import region_reduce

__all__ = ["GradientExchange", "variable_name", "SPARSE_GRAD"]

#: The statistics' name for an IndexedSlices gradient's path (as hvd_dgc.torch's).
SPARSE_GRAD = "sparse_grad"

#: Region reduce's records: int32 index and float32 value, whatever ``fp16_values``.
REGION_RECORD_BYTES = 8

#: The path of a compressor running its own collectives (collective.py), after the cost
#: model's methods.
_EXCHANGE = "exchange"
_PATHS = AGGREGATIONS + (_EXCHANGE,)


def variable_name(var, i):
    """What error messages and the config check call a variable (Keras 3: its path)."""
    return getattr(var, "path", None) or getattr(var, "name", None) or f"var{i}"


class GradientExchange(tf.Module):
    """DGC state and the per-step exchange for one set of variables."""

    def __init__(self, compression=Compression.dgc, momentum=0.0, nesterov=False, op=Average,
                 gradient_predivide_factor=1.0, sparse_as_dense=False,
                 process_set=global_process_set, name="hvd_dgc", config=None, adaptive=False,
                 **options):
        """``config``: a ``hvd_dgc.config.DGCConfig``, or hvd_dgc's options by keyword;
        ``adaptive``: the optimizer is not SGD (Adam...), whose default warm-up is longer
        (hvd_dgc.schedule.ADAPTIVE_SENDS)."""
        super().__init__(name=name)
        if config is None:
            config = DGCConfig.from_options(options, "tensorflow", "GradientExchange")
        elif options:
            raise TypeError(f"GradientExchange: pass hvd_dgc's options in config= or by "
                            f"keyword, not both (got {sorted(options)})")
        check_horovod_arguments(op, gradient_predivide_factor, 1, None,
                                (Average, Sum, Adasum), "tf.Variable")
        self.config = config
        density, warmup, aggregation = config.density, config.warmup, config.aggregation
        delay = config.delay
        choice = resolve_compression(compression, Compression,
                                     (SparseCompressor, ExchangeCompressor), "tensorflow")
        compression = choice.compressor
        if choice.fp16 and is_sparse(compression):  # Horovod's Compression.fp16, as torch
            compression = compression(fp16_values=True)
        self.dense_fp16 = choice.fp16  # Compression.fp16: fp16 on the dense path too
        self.aggregation = aggregation
        allowed = aggregation_choices(aggregation, is_sparse(compression), repr(compression),
                                      "hvd_dgc.tensorflow.Compression.dgc")
        self.allowed = tuple(a for a in allowed if a != _HIERARCHICAL)
        if is_exchange(compression):  # a quantiser or PowerSGD: its own collectives
            if density is not None or warmup:
                raise ValueError(f"density/warmup apply to sparse compressors, but "
                                 f"compression={compression!r} compresses every element of "
                                 f"each large tensor. Use compression="
                                 f"hvd_dgc.tensorflow.Compression.dgc to sparsify.")
            if delay and not compression.sent_at_launch:
                raise ValueError(f"compression={compression!r} with delay={delay}: what this "
                                 f"rank sent is known only after its first collective, and a "
                                 f"later correction needs it at once. Use delay=0, or a "
                                 f"one-round compressor (Compression.sign, qsgd, bf16, dgc).")
            schedule = as_schedule(1.0)
        elif dense_requested(density, warmup) and aggregation not in ("allgather", "region"):
            compression, schedule = Compression.none, as_schedule(1.0)
        else:
            schedule = as_schedule(density, warmup, config.warmup_unit,
                                   config.warmup_densities, adaptive=adaptive)
            if not isinstance(schedule, DensitySchedule):
                raise TypeError("hvd_dgc.tensorflow needs density as a number or a "
                                "hvd_dgc.DensitySchedule (evaluated inside the graph), not a "
                                "Python callable")
        self.compression = compression
        self.schedule = schedule
        # the densities a step can have: the warm-up stages', then the final one
        self._densities = (tuple(schedule.warmup_densities) if schedule.warmup > 0
                           else ()) + (schedule.density,)
        self.min_compress_size = config.min_compress_size
        self.momentum, self.nesterov = float(momentum), bool(nesterov)
        self.momentum_masking = config.momentum_masking
        self._mask_limit = masking_density_limit(config.momentum_masking, momentum)
        self.clip_norm = config.clip_norm
        self.cost_model = config.cost_model or CostModel()
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self.delay = delay
        self.skip_nonfinite = config.skip_nonfinite
        self.memory = None
        self.gathered = None  # steps of IndexedSlices gradients (when there are any)
        self.regioned = None  # region reduce's (steps, elements given back), when it may run
        self.exchanged = None  # steps of a compressor's own path (collective.py), if any
        self.slots = None
        self._dga = None
        self._epoch = 0.0
        self._first_step = 0  # rank 0's, for a build after an elastic reset
        self.resuming = False  # an elastic reset happened; DGCCallback reads and clears it

    def set_epoch(self, epoch):
        """Epoch-based warm-up: call at the start of each epoch on every rank."""
        self._epoch = float(epoch)
        if self.memory is not None:
            self.epoch.assign(self._epoch)

    # -- set-up (eager, once) ---------------------------------------------------
    def build(self, variables, grads=None):
        """Create the memory and check every rank agrees; runs outside any trace.
        ``grads`` (this step's, optional) tell which variables have IndexedSlices
        gradients: those get no residual slot (an embedding table can be large)."""
        if self.memory is not None:
            return
        names = [variable_name(v, i) for i, v in enumerate(variables)]
        grads = list(grads) if grads is not None else [None] * len(variables)
        self.sliced = [isinstance(g, tf.IndexedSlices) and not self.sparse_as_dense
                       for g in grads]
        self.shapes = [tuple(int(d) for d in v.shape) for v in variables]
        for name, sliced in zip(names, self.sliced):
            if sliced:
                self._check_slices_allowed(name)
        with tf.init_scope():
            for var, name in zip(variables, names):
                if not tf.as_dtype(var.dtype).is_floating:
                    raise TypeError(f"hvd_dgc: variable '{name}' has dtype {tf.as_dtype(var.dtype).name}; "
                                    f"DGC compresses floating-point gradients only. Mark it "
                                    f"non-trainable or leave it out of the variables.")
            self.numels = [int(np.prod(v.shape)) for v in variables]
            self.names = list(names)
            # per tensor and density stage: k, and the path the cost model chooses for it
            self.ks = [tuple(num_selected(n, d) for d in self._densities) for n in self.numels]
            self._plan()
            # Elastic: a worker added later builds alone, while the others wait in a
            # reset; a collective here would hang it. All run the same script.
            self.elastic = os.environ.get("HOROVOD_ELASTIC") == "1"
            if not self.elastic:
                _check_consistent_config(self._config(), self.process_set)
            self._announce()
            # rank 0's step, when an elastic reset gave it before this build
            self.step = tf.Variable(self._first_step, dtype=tf.int64, trainable=False,
                                    name="step")
            self.epoch = tf.Variable(self._epoch, dtype=tf.float32, trainable=False,
                                     name="epoch")
            # statistics: bytes sent, dense fp32 bytes, elements sent, elements, sparse, dense
            self.counters = tf.Variable(tf.zeros([6], tf.int64), trainable=False,
                                        name="counters")
            self.nonfinite = tf.Variable(0, dtype=tf.int64, trainable=False, name="nonfinite")
            # elastic: the next step first agrees on step and epoch (scratch, see _agree)
            object.__setattr__(self, "agreeing", tf.Variable(
                self.elastic, dtype=tf.bool, trainable=False, name="agreeing"))
            # dense fp16 values sent clipped (hvd_dgc/fp16wire.py): scratch, not checkpointed
            object.__setattr__(self, "fp16_clipped", tf.Variable(
                0, dtype=tf.int64, trainable=False, name="fp16_clipped"))
            if any(self.sliced):  # only then: other checkpoints keep their layout
                self.gathered = tf.Variable(0, dtype=tf.int64, trainable=False,
                                            name="sparse_grad_steps")
            if any(_EXCHANGE in m for m in self.methods):  # a compressor's own collectives
                self.exchanged = tf.Variable(0, dtype=tf.int64, trainable=False,
                                             name="exchange_steps")
                # its per-tensor state (PowerSGD's Q), tracked: checkpoints keep it
                self.slots = [self.compression.slot(shape, name) if _EXCHANGE in m else None
                              for shape, name, m in zip(self.shapes, names, self.methods)]
            self.memory = DGCMemory(self.numels, self.momentum, self.nesterov,
                                    self.momentum_masking,
                                    snapshots=self.skip_nonfinite and not self.delay,
                                    no_residual=self.sliced)
            if self.delay:
                self._dga = DelayedAveraging(self, variables)

    def _plan(self):
        """Each tensor's path at each density stage for this world (the cost model's
        choice: the same inputs on every rank), and region reduce's counters (steps,
        elements given back) when some tensor may take it."""
        self.methods = [self._methods(n, ks, sliced, shape) for n, ks, sliced, shape
                        in zip(self.numels, self.ks, self.sliced, self.shapes)]
        self.built_world = self.world_size()  # what the traced step is made for
        if self.regioned is None and any(_REGION in m for m in self.methods):
            self.regioned = tf.Variable(tf.zeros([2], tf.int64), trainable=False,
                                        name="region_counters")

    # -- elastic Horovod (hvd_dgc/tensorflow/elastic.py) --------------------------
    def replan(self):
        """After an elastic reset (Horovod re-initialised, no collective yet): each
        tensor's path for the new number of ranks; the 1/N scales and the clipping and
        fp16 bounds follow when the step is traced again. The memory stays: this rank's
        residuals are still owed to the model."""
        if self.memory is None:
            return
        with tf.init_scope():
            self._plan()
            self._announce()
            self.agreeing.assign(True)

    def shared_state(self):
        """What decides every rank's density and path, so every rank must hold rank 0's
        after an elastic reset: (step, epoch); None before the first step."""
        if self.memory is None:
            return None
        return int(self.step.numpy()), float(self.epoch.numpy())

    def load_shared_state(self, state):
        """Rank 0's ``shared_state()``; kept for the build when this rank has not stepped
        yet (a worker that joined: its residuals start empty, its step is rank 0's)."""
        if state is None:
            return
        step, epoch = state
        self._epoch = float(epoch)
        if self.memory is None:
            self._first_step = int(step)
        else:
            self.step.assign(step)
            self.epoch.assign(epoch)

    def current_epoch(self):
        """The epoch the warm-up reads (before the first step: the one it will read)."""
        return float(self.epoch.numpy()) if self.memory is not None else self._epoch

    def _methods(self, numel, ks, sliced, shape):
        """The path of one tensor at each density stage (same inputs on every rank)."""
        if is_exchange(self.compression) and numel >= self.min_compress_size and not sliced:
            if self.compression.compressible(shape):
                return (_EXCHANGE,) * len(ks)
        if not is_sparse(self.compression) or numel < self.min_compress_size or sliced:
            return (_DENSE,) * len(ks)
        return tuple(self.cost_model.choose_aggregation(
            numel, k, self.world_size(), 2 if self.dense_fp16 else 4,
            self.compression.value_bytes, allowed=self.allowed) for k in ks)

    def _announce(self):
        """Rank 0, once: what hvd_dgc does here and how to turn it off; every rank: a
        warning where a setting leaves DGC nothing to do (as the PyTorch optimizer)."""
        sparse = is_sparse(self.compression)
        large = [n for n, k in zip(self.numels, self.sliced)
                 if n >= self.min_compress_size and not k]
        kind = self.compression.name if sparse or is_exchange(self.compression) else "dense"
        final = self.schedule.density if sparse else 1.0
        if sparse:
            sparse_at_final = any(m[-1] != _DENSE for m in self.methods)
            message = idle_warning(kind, self.min_compress_size, bool(large), sparse_at_final,
                                   final, self.world_size())
            if message:
                warnings.warn(message, UserWarning)
        elif is_exchange(self.compression) and not large:  # a compressor with nothing to do
            warnings.warn(idle_warning(kind, self.min_compress_size, False, True, 1.0,
                                       self.world_size()), UserWarning)
        if _hvd.rank() == 0:
            warm = self.schedule.describe() if sparse else ""
            print(summary(kind, final, warm, self.min_compress_size, self.dense_fp16,
                          sparse and self.compression.value_bytes == 2, self.delay,
                          len(large), len(self.numels), "tensorflow",
                          {m[-1] for m in self.methods}), flush=True)

    def world_size(self):
        return self.process_set.size()

    def _config(self):
        config = self.config.to_dict(shared=True)
        config.update({  # what the options resolved to here, and the variables
            "compression": repr(getattr(self.compression, "config", lambda: self.compression)()),
            "density": repr(self.schedule.config()), "momentum": self.momentum,
            "nesterov": self.nesterov, "cost_model": repr(self.cost_model.config()),
            "op": repr(self.op), "dense_fp16": self.dense_fp16,
            "variables": list(zip(self.names, self.numels)),
            "indexed_slices_gradients": [n for n, k in zip(self.names, self.sliced) if k]})
        return config

    # -- per step ---------------------------------------------------------------
    def stage(self):
        """This step's index into the densities (the schedule, hvd_dgc.schedule.
        DensitySchedule.__call__, in TF ops): k and the path are looked up by it, so
        they are the ones Python computed."""
        s = self.schedule
        if s.warmup <= 0:
            return tf.constant(0, tf.int32)
        t = tf.cast(self.epoch if s.unit == "epoch" else self.step, tf.float64)
        ends = tf.constant(s.boundaries, tf.float64)  # as Python: count the stages ended
        stage = tf.minimum(tf.reduce_sum(tf.cast(t >= ends, tf.int32)),
                           len(s.warmup_densities) - 1)
        return tf.where(t >= s.warmup, len(s.warmup_densities), stage)

    def density(self, stage=None):
        """The density at ``stage`` (default: this step's)."""
        stage = self.stage() if stage is None else stage
        return tf.gather(tf.constant(self._densities, tf.float64), stage)

    def __call__(self, grads):
        """Averaged gradients for this step's local ``grads`` (one per built variable);
        with ``delay=D``, this rank's own update corrected by the average of step i-D."""
        return self.exchange(grads)[0]

    def exchange(self, grads):
        """``(averaged gradients, skipped)``; ``skipped`` is a boolean tensor, True when
        a non-finite gradient on some rank made every rank skip this step."""
        checked = self._check_world()
        if self.elastic:
            with tf.control_dependencies([checked]):
                agreed = self._agree()
            checked = tf.group(checked, agreed)
        with tf.control_dependencies([checked]):
            stage = self.stage()
        base = getattr(self.compression, "seed", 0)
        at = _At(stage, self.density(stage),
                 tf.stack([tf.cast(self.step, tf.int32) + base, _hvd.rank()]), self.step)
        with tf.control_dependencies([checked]):  # eagerly: None, and no-op
            # in a graph, nothing that leads to a collective starts before the check
            grads = [_after_check(self._local_grad(i, g)) for i, g in enumerate(grads)]
        if self.dense_fp16:
            clipped_before = self.fp16_clipped.read_value()
            with tf.control_dependencies([clipped_before]):
                out, bad = self._exchange_guarded(grads, at)
            with tf.control_dependencies([_values(a) for a in out]):
                self._warn_fp16(clipped_before)
            return out, bad
        return self._exchange_guarded(grads, at)

    def _check_world(self):
        """Stop, before any collective, a step running in another world than the plan
        was made for (an elastic reset): its paths, 1/N scales and bounds would be
        wrong, and ranks that planned differently would wait for each other forever."""
        return tf.debugging.assert_equal(
            _hvd.size_op(process_set_id=self.process_set.process_set_id),
            self.built_world,
            message=f"hvd_dgc: this step was traced for {self.built_world} ranks and "
                    f"runs in a world of another size (an elastic Horovod reset?). Under "
                    f"elastic Horovod use hvd_dgc.tensorflow.keras's DistributedOptimizer "
                    f"with its hvd.elastic.KerasState (model.fit then re-plans and traces "
                    f"its step again); DistributedGradientTape does not support elastic "
                    f"Horovod yet")

    def _agree(self):
        """Under elastic Horovod, the first step after a build or a reset takes the
        largest step and epoch of all ranks (one small allreduce), before they decide
        anyone's density and path. A worker that joined may step before the state's
        sync gives it rank 0's (Horovod's elastic Keras example fits a step before
        making its state, and another in a reset callback): at step 0 of a warm-up its
        path could differ from the others' and the collectives would not match."""
        def agree():
            both = _hvd.allreduce(tf.stack([tf.cast(self.step, tf.float64),
                                            tf.cast(self.epoch, tf.float64)]),
                                  op=Max, name="hvd_dgc.elastic.agree",
                                  process_set=self.process_set)
            with tf.control_dependencies([self.step.assign(tf.cast(both[0], tf.int64)),
                                          self.epoch.assign(tf.cast(both[1], tf.float32)),
                                          self.agreeing.assign(False)]):
                return tf.constant(True)
        return tf.cond(self.agreeing, agree, lambda: tf.constant(False))

    def _warn_fp16(self, before):
        """The first step that sends dense fp16 values clipped says so (as the PyTorch
        side's warning, printed from the graph); later ones are counted in stats()."""
        template = clip_warning("tensorflow", "{}", "{}", self._fp16_bound()) + \
            " Later ones are counted in stats()['fp16_clipped']."
        now = self.fp16_clipped.read_value()

        def say():
            tf.print(tf.strings.format(template, [self.step, now - before]),
                     output_stream=sys.stderr)
            return tf.constant(0)
        tf.cond(tf.logical_and(tf.equal(before, 0), now > 0), say, lambda: tf.constant(0))

    def _exchange_guarded(self, grads, at):
        if not self.skip_nonfinite:
            return self._step(grads, at), tf.constant(False)
        bad_here = [tf.logical_not(tf.math.is_finite(tf.reduce_sum(
            tf.cast(_values(g), tf.float32)))) for g in grads]
        local_bad = tf.reduce_any(bad_here)
        if self.delay:
            # DGA: the other ranks apply their own part of this step before anyone knows.
            # A tensor not finite here stays out of this rank's memory (u and v as they
            # were) and this rank sends zeros for it, as the PyTorch side does.
            self.nonfinite.assign_add(tf.cast(local_bad, tf.int64))
            return self._step(grads, at, dropped=bad_here), tf.constant(False)
        # No extra collective: the memory is saved, a rank with a non-finite gradient
        # sends inf, so every rank's averages show it; then every rank puts its memory back.
        self.memory.snapshot()
        counters = self.counters.read_value()
        clipped = self.fp16_clipped.read_value()
        gathered = self.gathered.read_value() if self.gathered is not None else None
        regioned = self.regioned.read_value() if self.regioned is not None else None
        exchanged = self.exchanged.read_value() if self.exchanged is not None else None
        out = [self._exchange_one(i, grad, at, poison=local_bad)
               for i, grad in enumerate(grads)]
        bad = tf.logical_not(tf.reduce_all(
            [tf.math.is_finite(tf.reduce_sum(_values(a))) for a in out]))

        def skip():
            self.memory.restore()
            self.counters.assign(counters)
            self.fp16_clipped.assign(clipped)
            if gathered is not None:
                self.gathered.assign(gathered)
            if regioned is not None:
                self.regioned.assign(regioned)
            if exchanged is not None:
                self.exchanged.assign(exchanged)
            self.nonfinite.assign_add(1)
            return [_nan_like(a) for a in out]

        def keep():
            self.step.assign_add(1)
            return out

        return tf.cond(bad, skip, keep), bad

    def _step(self, grads, at, dropped=None):
        if self.delay:
            out = self._delayed_step(grads, at, dropped)
        else:
            out = [self._exchange_one(i, grad, at) for i, grad in enumerate(grads)]
        self.step.assign_add(1)
        return out

    def _local_grad(self, i, grad):
        """The gradient as it will travel: dense, or IndexedSlices (Horovod's way)."""
        if grad is None:
            if self.sliced[i]:  # nothing looked up: no rows
                return tf.IndexedSlices(tf.zeros((0,) + self.shapes[i][1:]),
                                        tf.zeros([0], tf.int32),
                                        tf.constant(self.shapes[i], tf.int64))
            return tf.zeros([self.numels[i]])
        if isinstance(grad, tf.IndexedSlices):
            if self.sparse_as_dense:
                return tf.convert_to_tensor(grad)
            self._check_slices_allowed(self.names[i])
            return grad
        if self.sliced[i]:
            raise ValueError(
                f"hvd_dgc: variable '{self.names[i]}' had a sparse (IndexedSlices) gradient "
                f"when hvd_dgc built its memory and has a dense one now, and it has no "
                f"residual slot. Pass sparse_as_dense=True to hvd_dgc's "
                f"DistributedGradientTape / DistributedOptimizer.")
        return grad

    def _check_slices_allowed(self, name):
        if self.delay:
            raise ValueError(
                f"hvd_dgc: variable '{name}' has a sparse (IndexedSlices) gradient (an "
                f"embedding lookup?) and delay={self.delay}: delayed averaging needs dense "
                f"gradients. Pass sparse_as_dense=True to hvd_dgc's DistributedGradientTape "
                f"/ DistributedOptimizer, or delay=0.")

    # -- the gradient's path, shared by the synchronous and the delayed step --------
    def _accumulate(self, i, grad):
        """Clip and accumulate: ``v``, what the memory holds to send."""
        g = local_gradient(grad, self.clip_norm, self.world_size())
        return self.memory.accumulate(i, g)

    def _k(self, i, at):
        """The number of values tensor i selects at this step's density stage."""
        return tf.gather(tf.constant(self.ks[i], tf.int32), at.stage)

    def _choose(self, i, at, branches):
        """Run ``branches[path]`` for this step's path of tensor i. Every rank is at the
        same stage, so every rank takes the same branch and joins the same collective."""
        methods = self.methods[i]
        used = sorted(set(methods), key=_PATHS.index)
        if len(used) == 1:
            return branches[used[0]]()
        codes = tf.constant([used.index(m) for m in methods], tf.int32)
        return tf.switch_case(tf.gather(codes, at.stage), [branches[m] for m in used])

    def _select(self, i, v, k, at, path):
        """Sparse paths: indices and values to send; the memory forgets them."""
        indices = self.compression.select(v, k, at.seed)
        values = tf.gather(v, indices)
        self.memory.sent(i, indices, mask_momentum=at.density <= self._mask_limit)
        sent = tf.cast(tf.shape(indices)[0], tf.int64)
        numel = self.numels[i]
        record = self.compression.record_bytes if path == _SPARSE else REGION_RECORD_BYTES
        self.counters.assign_add(tf.stack([record * sent,
                                           4 * numel, sent, numel,
                                           1 if path == _SPARSE else 0, 0]))
        if path == _REGION:
            self.regioned.assign_add(tf.constant([1, 0], tf.int64))
        return indices, values

    def _region_done(self, i, kept, returned_indices, returned_values):
        """Region reduce's owner part: its unsent sums back into its residual (error
        feedback), and the kept records it sent on counted as bytes sent."""
        self.memory.give_back(i, returned_indices, returned_values)
        self.counters.assign_add(tf.stack([REGION_RECORD_BYTES * kept, 0, 0, 0, 0, 0]))
        self.regioned.assign_add(tf.stack([tf.constant(0, tf.int64),
                                           tf.size(returned_indices, out_type=tf.int64)]))

    def _dense_payload(self, i, v):
        """Dense path: all of ``v`` leaves; with Horovod's Compression.fp16 as float16, at
        most fp16wire.fp16_bound of it, the rest (and fp16's rounding) staying in the
        residual, as on the PyTorch side (hvd_dgc/fp16wire.py)."""
        numel = self.numels[i]
        fp16 = self.dense_fp16
        self.counters.assign_add(tf.constant([(2 if fp16 else 4) * numel, 4 * numel, numel,
                                              numel, 0, 1], tf.int64))
        if not fp16:
            self.memory.sent_all(i)
            return v
        bound = self._fp16_bound()
        finite = tf.math.is_finite(v)
        self.fp16_clipped.assign_add(tf.math.count_nonzero(
            finite & (tf.abs(v) > bound), dtype=tf.int64))
        payload = tf.cast(tf.where(finite, tf.clip_by_value(v, -bound, bound), v), tf.float16)
        self.memory.keep(i, tf.where(finite, v - tf.cast(payload, tf.float32), 0.0))
        return payload

    def _count_exchange(self, numel, sent_bytes):
        """Statistics of the exchange path (a compressor's own collectives)."""
        self.counters.assign_add(tf.stack([tf.cast(sent_bytes, tf.int64),
                                           tf.constant(4 * numel, tf.int64), numel, numel,
                                           0, 0]))
        self.exchanged.assign_add(1)

    def _fp16_bound(self):
        """What one rank may put on the dense path's fp16 allreduce (hvd_dgc/fp16wire.py)."""
        return fp16_bound(self.world_size(), self._scales()[0])

    def _scales(self):
        """(prescale, postscale) of Horovod's Average with gradient_predivide_factor."""
        if self.op == Average:
            return 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        return 1.0, 1.0

    def _gathered_scale(self):
        """Factor turning the sum of every rank's (prescaled) records into the result."""
        return self._scales()[1] / self.world_size() if self.op == Average else 1.0

    def _region_scale(self):
        """Factor turning region reduce's sum into the result: its sums are formed once,
        on the owners, from unscaled values, so the predivide factor plays no part."""
        return 1.0 / self.world_size() if self.op == Average else 1.0

    def _exchange_one(self, i, grad, at, poison=None):
        """``poison``: this rank had a non-finite gradient; it sends inf (skip_nonfinite)."""
        if isinstance(grad, tf.IndexedSlices):
            return self._gather_slices(i, grad, poison)
        numel = self.numels[i]
        v, k = self._accumulate(i, grad), self._k(i, at)
        name = f"hvd_dgc.{i}"
        pre, post = self._scales()

        def dense():
            payload = self._dense_payload(i, v)
            if poison is not None:
                payload = tf.where(poison, tf.cast(float("inf"), payload.dtype), payload)
            avg = _hvd.allreduce(payload, op=self.op, name=name + ".dense", prescale_factor=pre,
                                 postscale_factor=post, process_set=self.process_set)
            return tf.cast(avg, tf.float32)

        def sparse():
            indices, values = self._select(i, v, k, at, _SPARSE)
            if poison is not None:
                values = tf.where(poison, float("inf"), values)
            comp = self.compression
            records = comp.to_wire(comp.pack(values * pre, indices))
            gathered = comp.from_wire(_hvd.allgather(records, name=name + ".sparse",
                                                     process_set=self.process_set))
            return comp.scatter_sum(gathered, numel) * self._gathered_scale()

        def region():
            indices, values = self._select(i, v, k, at, _REGION)
            if poison is not None:  # inf is the largest sum: some owner keeps and sends it
                values = tf.where(poison, float("inf"), values)
            res = region_reduce(indices, values, numel, k, name + ".region", self.process_set)
            self._region_done(i, res.kept, res.returned_indices, res.returned_values)
            return res.total * self._region_scale()

        def exchanged():  # a compressor running its own collectives (collective.py)
            send = v if poison is None else tf.where(poison, np.inf, v)
            res = self.compression.exchange(send, self.shapes[i], self.slots[i],
                                            Comm(self.process_set, name), at)
            self.memory.keep(i, v - res.sent)  # error feedback
            self._count_exchange(numel, res.bytes)
            return res.mean if self.op == Average else res.mean * self.world_size()

        out = self._choose(i, at, {_DENSE: dense, _SPARSE: sparse, _REGION: region,
                                   _EXCHANGE: exchanged})
        return tf.reshape(out, tf.shape(grad))

    def _gather_slices(self, i, grad, poison=None):
        """Horovod's average of an IndexedSlices gradient: every rank's rows and indices
        allgathered, as they are (duplicates kept, so the optimizer sees what Horovod's
        would); values / N for Average. No DGC and no residual: it is sparse already.
        With an SGD's momentum taken over, the memory's velocity applies the momentum
        the SGD would have applied to these slices (a dense gradient)."""
        values = grad.values
        if poison is not None:
            values = tf.where(poison, tf.cast(float("inf"), values.dtype), values)
        name = f"hvd_dgc.{i}.slices"
        rows = _hvd.allgather(values, name=name + ".values", process_set=self.process_set)
        indices = _hvd.allgather(grad.indices, name=name + ".indices",
                                 process_set=self.process_set)
        if self.op == Average:
            rows = rows / tf.cast(self.world_size(), rows.dtype)
        sent = tf.size(values, out_type=tf.int64)
        index_bytes = tf.size(grad.indices, out_type=tf.int64) * grad.indices.dtype.size
        numel = self.numels[i]  # counted as sent bytes against dense fp32, as the others
        self.counters.assign_add(tf.stack([sent * values.dtype.size + index_bytes, 4 * numel,
                                           sent, numel, 0, 0]))
        if self.gathered is not None:
            self.gathered.assign_add(1)
        shape = grad.dense_shape if grad.dense_shape is not None else \
            tf.constant(self.shapes[i], tf.int64)
        avg = tf.IndexedSlices(rows, indices, shape)
        if not self.memory.momentum:
            return avg
        g = tf.reshape(tf.cast(tf.convert_to_tensor(avg), tf.float32), [-1])
        return tf.reshape(self.memory.velocity(i, g), self.shapes[i])

    def _delayed_step(self, grads, at, dropped=None):
        """DGA (hvd_dgc/tensorflow/delayed.py): launch this step, apply own + the
        correction of the step launched ``delay`` steps ago. ``dropped[i]``: tensor i
        is not finite on this rank; it sends zeros and its memory does not move."""
        paths, payloads, owns, ks = [], [], [], []
        pre, _ = self._scales()
        for i, grad in enumerate(grads):
            numel, k = self.numels[i], self._k(i, at)

            def run(i=i, grad=grad, k=k, numel=numel):
                v = self._accumulate(i, grad)

                def dense():
                    own = tf.cast(self._dense_payload(i, v), tf.float32)
                    return tf.constant(DENSE), tf.bitcast(own, tf.int32), own

                def sparse(path=_SPARSE, flag=SPARSE, scale=pre):
                    indices, values = self._select(i, v, k, at, path)
                    if path == _SPARSE:  # own: what the others will read (fp16_values)
                        values = self.compression.wire_values(values * scale) / scale
                    records = self.compression.pack(values * scale, indices)
                    own = tf.scatter_nd(tf.expand_dims(indices, 1), values, [numel])
                    return tf.constant(flag), tf.reshape(records, [-1]), own

                def region():  # region's values travel unscaled
                    return sparse(_REGION, REGION, 1.0)

                def exchanged():  # a one-round compressor's payload, as int32 words
                    payload, own = self.compression.launch(v, at)
                    self.memory.keep(i, v - own)  # error feedback
                    self._count_exchange(numel, self.compression.payload_bytes(numel))
                    return tf.constant(GATHER), _words(payload), own

                return self._choose(i, at, {_DENSE: dense, _SPARSE: sparse, _REGION: region,
                                            _EXCHANGE: exchanged})

            def drop(i=i, numel=numel):  # the same path as every rank, carrying nothing
                zero = tf.zeros([numel])
                nothing = tf.reshape(SparseCompressor.pack(tf.zeros([1]),
                                                           tf.zeros([1], tf.int32)), [-1])
                return self._choose(i, at, {
                    _DENSE: lambda: (tf.constant(DENSE), tf.bitcast(zero, tf.int32), zero),
                    _SPARSE: lambda: (tf.constant(SPARSE), nothing, zero),
                    _REGION: lambda: (tf.constant(REGION), nothing, zero),
                    _EXCHANGE: lambda: (tf.constant(GATHER),
                                        _words(self.compression.launch(zero, at)[0]), zero)})

            path, payload, own = run() if dropped is None else tf.cond(dropped[i], drop, run)
            paths.append(path)
            payloads.append(payload)
            owns.append(own)
            ks.append(k)
        launched = tf.py_function(self._dga.launch,
                                  [self.step, tf.stack(paths), tf.stack(ks)] + payloads,
                                  Tout=tf.int32)
        with tf.control_dependencies([launched]):
            parts = tf.py_function(self._dga.correction, [self.step - self.delay],
                                   Tout=[tf.int32, tf.float32, tf.int32] * len(grads)
                                   + [tf.int64])
        out = []
        for i, (grad, own) in enumerate(zip(grads, owns)):
            records, dense, returned = parts[3 * i: 3 * i + 3]
            records.set_shape([None, 2])
            # the dense part, or zeros, plus the records scattered (as the sync path does)
            base = tf.cond(tf.size(dense) > 0, lambda d=dense: d,
                           lambda n=self.numels[i]: tf.zeros([n]))
            correction = tf.tensor_scatter_nd_add(base, records[:, :1],
                                                  tf.bitcast(records[:, 1], tf.float32))
            out.append(tf.reshape(own + tf.reshape(correction, [-1]), tf.shape(grad)))
            if self.regioned is not None:  # step i-D's region reduce, given back now
                returned.set_shape([None, 2])
                self._region_done(i, tf.constant(0, tf.int64), returned[:, 0],
                                  tf.bitcast(returned[:, 1], tf.float32))
        if self.regioned is not None:
            self.counters.assign_add(tf.stack([REGION_RECORD_BYTES * parts[-1],
                                               0, 0, 0, 0, 0]))
        return out

    @property
    def in_flight(self):
        """Steps whose averages have not been applied yet (delay > 0)."""
        return self._dga.in_flight if self._dga is not None else 0

    def flush(self, apply, iterations=None):
        """Wait for every step in flight, ``apply(corrections, variables)`` them (one
        optimizer step of ``avg - own``; the optimizer's ``iterations`` variable, if
        given, is left as it was: the flush is not a training step), then average
        the variables across ranks: equal in exact arithmetic after the corrections,
        they differ in rounding."""
        corrections = self._dga.drain() if self._dga is not None else None
        if corrections is None:
            return False
        variables = self._dga.variables
        before = int(iterations.numpy()) if iterations is not None else None
        apply([tf.reshape(c, v.shape) for c, v in zip(corrections, variables)], variables)
        if iterations is not None:
            iterations.assign(before)
        if self.world_size() > 1:
            averaged = _hvd.grouped_allreduce([tf.convert_to_tensor(v) for v in variables],
                                              op=Average, name="hvd_dgc.flush",
                                              process_set=self.process_set)
            for var, value in zip(variables, averaged):
                var.assign(value)
        return True

    def stats(self):
        """Bytes sent vs dense fp32, density and path counts (this rank), as a dict."""
        c = [int(x) for x in self.counters.numpy()]
        gathered = int(self.gathered.numpy()) if self.gathered is not None else 0
        regioned = [int(x) for x in self.regioned.numpy()] if self.regioned is not None \
            else [0, 0]
        stats = CompressionStats()
        exchanged = int(self.exchanged.numpy()) if self.exchanged is not None else 0
        paths = (("sparse", c[4]), ("dense", c[5]), (SPARSE_GRAD, gathered),
                 (_REGION, regioned[0]), (_EXCHANGE, exchanged))
        stats.load_state_dict({"steps": int(self.step.numpy()), "bytes_sent": c[0],
                               "dense_bytes": c[1], "elements_sent": c[2],
                               "elements_total": c[3], "returned_elements": regioned[1],
                               "paths": {k: n for k, n in paths if n}})
        out = stats.summary()
        out.pop("last_step")
        out.update(step=int(self.step.numpy()), epoch=float(self.epoch.numpy()),
                   current_density=float(self.density().numpy()),
                   world_size=self.world_size(), nonfinite_steps=int(self.nonfinite.numpy()),
                   fp16_clipped=int(self.fp16_clipped.numpy()))
        return out


class _At(NamedTuple):
    """Where a step is: its density stage (k and the path are looked up by it), the
    density (momentum masking depends on it), the random seed (selection, QSGD) and the
    step (PowerSGD's start_iter)."""

    stage: tf.Tensor
    density: tf.Tensor
    seed: tf.Tensor
    step: tf.Tensor


def _after_check(grad):
    """``grad`` through an identity, so it depends on the control context it is made in."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(tf.identity(grad.values), grad.indices, grad.dense_shape)
    return tf.identity(grad)


def _words(payload):
    """A uint8 payload as int32 words (zero-padded): one dtype for every delayed payload."""
    pad = -int(payload.shape[0]) % 4
    return tf.bitcast(tf.reshape(tf.pad(payload, [[0, pad]]), [-1, 4]), tf.int32)


def _values(grad):
    """What a non-finite check looks at: an IndexedSlices' rows, or the tensor."""
    return grad.values if isinstance(grad, tf.IndexedSlices) else grad


def _nan_like(grad):
    """The skipped step's gradient: NaN, shaped (and sliced) as the real one."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(tf.fill(tf.shape(grad.values), tf.constant(float("nan"),
                                                                            grad.values.dtype)),
                                grad.indices, grad.dense_shape)
    return tf.fill(tf.shape(grad), tf.constant(float("nan"), grad.dtype))


def _check_consistent_config(config, process_set):
    """One allgather before the first step (see hvd_dgc/consistency.py)."""
    blob = np.frombuffer(consistency.encode(config), np.uint8)
    sizes = _hvd.allgather(tf.constant([blob.size], tf.int64), name="hvd_dgc.config.size",
                           process_set=process_set).numpy()
    everything = _hvd.allgather(tf.constant(blob), name="hvd_dgc.config",
                                process_set=process_set).numpy()
    configs = consistency.decode_all(sizes.tolist(), everything.tobytes())
    ranks = process_set.ranks if process_set.ranks else list(range(len(configs)))
    consistency.check_same(configs, ranks, "hvd_dgc.tensorflow")
