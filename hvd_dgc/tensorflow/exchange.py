"""The path of one gradient in TensorFlow, shared by DistributedGradientTape and the
Keras DistributedOptimizer. At wrap time the options are resolved and checked
(hvd_dgc/config.py ``DGCConfig.resolve``); at the first step the planner
(hvd_dgc/plan.py, shared with PyTorch) gives each tensor a path per density stage.
Then, every step, inside the user's ``tf.function`` or eagerly:

    GradientExchange.exchange(grads)
      stage = the warm-up stage             in TF ops, from step or epoch: the same on
                                            every rank (elastic: agreed first)
      grad = local_grad(grad)               dense, or IndexedSlices as Horovod sends it
      ExchangePaths.step(grads)             hvd_dgc/tensorflow/paths.py; per tensor:
        v = memory.accumulate(clip(grad))     u = m u + g; v += u (momentum correction;
                                              hierarchical DGC: of its host's sum of a
                                              slice, after an alltoall in the host;
                                              a dense tensor whose memory is settled:
                                              the gradient itself, DensePath.shortcut)
        path = the planner's for the stage    a tf.switch_case every rank takes alike:
                                              DensePath, AllgatherPath, RegionPath,
                                              HierarchicalPath, ExchangePath
                                              (IndexedSlices: SparseGradPath)
        path.take(i, v, k, at)                what leaves the memory (it keeps the rest:
                                              error feedback), counted in the statistics
        path.launch / advance / collect       Horovod's collectives (a bucket's tensors,
                                              fusion_threshold: one grouped collective)
        path.average(...)                     the average (region's owners give back
                                              what they did not send on)
      a NaN/Inf on any rank                 every rank puts its memory back, skips
                                            (guard.py)
      ExchangePaths.finish(averages)        kept: the shortcut's tensors get their
                                            momentum, u = m u + avg (memory.settle)
      step += 1

With ``delay=D`` (delayed gradient averaging) the same path classes take in the graph
and collect on worker threads, and step i applies ``own_i + avg_(i-D) - own_(i-D)``:
hvd_dgc/tensorflow/delayed.py. The statistics are named fields kept in the variables
checkpoints have always had: hvd_dgc/tensorflow/statistics.py.
"""

import os

import numpy as np
import tensorflow as tf
import horovod.tensorflow as _hvd
from horovod.tensorflow.mpi_ops import Adasum, Average, Max, Sum, global_process_set

from hvd_dgc.consistency import check_consistent
from hvd_dgc.config import DGCConfig
from hvd_dgc.resolve import Framework, HorovodArguments
from hvd_dgc.linkprobe import probe_link
from hvd_dgc.linkwatch import LinkWatch, as_link_watch, link_watch_idle
from hvd_dgc.masking import masking_density_limit
from hvd_dgc.paths import PathKind
from hvd_dgc.fusion import fusion_threshold
from hvd_dgc.plan import Planner, TensorInfo, hierarchical_hosts, stage_densities
from hvd_dgc.plan_words import PlanWords
from hvd_dgc.say import rank0_once
from hvd_dgc.script_calls import ScriptCalls
from hvd_dgc.seam import host_peers
from hvd_dgc.tensorflow.collective import ExchangeCompressor
from hvd_dgc.tensorflow.compression import Compression, SparseCompressor
from hvd_dgc.tensorflow.delayed import DelayedAveraging, OwnStepsInCheckpoint
from hvd_dgc.tensorflow.guard import NonFiniteGuard, values
from hvd_dgc.tensorflow.link import LinkWatchInFit, measure_local, measure_payload
from hvd_dgc.tensorflow.memory import DGCMemory
from hvd_dgc.tensorflow.names import tensor_names
from hvd_dgc.tensorflow.paths import At, ExchangePath, ExchangePaths, PathContext, Wire, \
    host_slice
from hvd_dgc.tensorflow.plan_trial import DenseTrial
from hvd_dgc.tensorflow.seam import HorovodCollectives
from hvd_dgc.tensorflow.statistics import Statistics

__all__ = ["GradientExchange", "TENSORFLOW", "HOROVOD_OPS"]

#: What ``DGCConfig.resolve`` knows of TensorFlow.
TENSORFLOW = Framework("tensorflow", Compression, (SparseCompressor, ExchangeCompressor))
#: Horovod's (Average, Sum, Adasum) for TensorFlow.
HOROVOD_OPS = (Average, Sum, Adasum)
#: How a script sets the epoch, by whether it has a tape (the words of the fix).
_EPOCH_FIX = {True: "Call hvd.set_epoch(epoch) at the start of each epoch",
              False: "Pass hvd.callbacks.DGCCallback() to model.fit (or any of hvd_dgc's "
                     "Keras callbacks: its BroadcastGlobalVariablesCallback advances the "
                     "epoch too), or call optimizer.set_epoch(epoch) at each epoch of your "
                     "own loop"}


class ExchangeSetUp:
    """The exchange's set-up at its first step (eager, once): the plan every rank agrees on,
    then its variables, memory, guard, paths and delayed averaging. A part of
    ``GradientExchange``: what it sets here, the step and the plan's changes read."""

    def build(self, variables, grads=None):
        """Create the memory and check every rank agrees; runs outside any trace.
        ``grads`` (this step's, optional) tell which variables have IndexedSlices
        gradients: those get no residual slot (an embedding table can be large)."""
        if self.memory is not None:
            return
        names = tensor_names(variables)
        sliced = self._sliced(names, grads)
        with tf.init_scope():
            for var, name in zip(variables, names):
                dtype = tf.as_dtype(var.dtype)
                if not dtype.is_floating:
                    raise TypeError(f"hvd_dgc: variable '{name}' has dtype {dtype.name}; DGC "
                                    f"compresses floating-point gradients only. Mark it "
                                    f"non-trainable or leave it out of the variables.")
            self.tensors = tuple(
                TensorInfo(i, name, int(np.prod(v.shape)), tuple(int(d) for d in v.shape), s)
                for i, (v, name, s) in enumerate(zip(variables, names, sliced)))
            self._plan()
            self._create_state(variables, sliced)
            if self.lags:
                self._create_delayed(variables)
            self._planned()

    def _sliced(self, names, grads):
        """Which variables get IndexedSlices gradients (no residual slot), checked."""
        grads = list(grads) if grads is not None else [None] * len(names)
        sliced = [isinstance(g, tf.IndexedSlices) and not self.sparse_as_dense for g in grads]
        if any(sliced) and self.resolved.zero_one and self.lags:
            self.resolved = _every_step(self.resolved, names[sliced.index(True)])
        for name, is_sliced in zip(names, sliced):
            if is_sliced:
                _check_slices_allowed(self.resolved.config, name)
        return sliced

    def _plan(self):
        """The planner: every rank's agreement, the hosts, the link measured, Adam's
        freeze, the link watch and the plan trial."""
        # Elastic: a worker added later builds alone, while the others wait in a
        # reset; a collective here would hang it. All run the same script.
        self.elastic = os.environ.get("HOROVOD_ELASTIC") == "1"
        # A tape's step lives in the user's tf.function, which is not traced again
        # after an elastic reset (Horovod's TF2 elastic example keeps it at module
        # level): its graph must hold for every world size (traced_once).
        self.traced_once = self.elastic and self.is_tape
        if self.traced_once:
            _check_traced_once(self.resolved, self.compression)
            self.wire = self.wire._replace(agnostic=True)
        self.planner = Planner(self.resolved, self.tensors, self._planning_world())
        if self.traced_once:
            self.planner.exclude(PathKind.REGION)
        if not self.elastic:
            check_consistent(HorovodCollectives(self.process_set),
                             self.planner.consistency(momentum=self.momentum,
                                                      nesterov=self.nesterov,
                                                      op=repr(self.op)),
                             "hvd_dgc.tensorflow")
        peers = self._host_peers()
        if peers:  # several hosts of several ranks: hierarchical DGC may run
            self.wire = self.wire._replace(peers=peers)
            self.planner.replan(self.world_size(), local_size=len(peers))
        if self.planner.measure and self.elastic:
            # a worker that joins builds alone: the link is measured at each sync
            # of the elastic state instead, where every rank is (measure_at_sync)
            if self._measured_at_sync is not None:
                self.planner.measured(*self._measured_at_sync)
            else:
                self.planner.unmeasured = ("link assumed (1 Gbit/s, 50 us per "
                                           "message) until the elastic state's sync")
        elif self.planner.measure:  # every rank agreed to probe (the default)
            self.planner.measured(*self._probed())
        if self.adam is not None:  # later, or never, where all goes dense before
            self.adam.freeze_at(self.planner.adam_freeze(self.resolved.chosen_lagging))
        # 0/1 Adam's default period dropped where Adam is not taken over (plan.py)
        self.resolved = self.planner.settled()
        if self.planner.measure and not self.elastic:  # (after the period settled)
            self.watcher = self._link_watcher()
            self.trial = self._plan_trial()
        elif self.config.link_watch not in (None, False):  # asked for: say why not
            rank0_once(link_watch_idle(self.config, self.planner.measure,
                                       self.resolved.sparse, elastic=self.elastic,
                                       tape=self.is_tape),
                       UserWarning, key="hvd_dgc.link_watch_idle")

    def _create_state(self, variables, sliced):
        """The step, the epoch, the statistics, the memory, the compressor's slots, the
        guard and the paths."""
        # rank 0's step, when an elastic reset gave it before this build
        self.step = tf.Variable(self._first_step, dtype=tf.int64, trainable=False,
                                name="step")
        self.epoch = tf.Variable(self._epoch, dtype=tf.float32, trainable=False,
                                 name="epoch")
        self.statistics = Statistics(self, min_compress_size=self.config.min_compress_size)
        # elastic: the next step first agrees on step and epoch (scratch, see _agree)
        object.__setattr__(self, "agreeing", tf.Variable(
            self.elastic, dtype=tf.bool, trainable=False, name="agreeing"))
        self.memory = DGCMemory(self._held(), self.momentum,
                                self.nesterov, self.config.momentum_masking,
                                snapshots=self.may_skip,
                                no_residual=sliced, preconditioner=None
                                if self.adam is None else self.adam.bind(
                                    self, variables, sliced))
        # a compressor's per-tensor state (PowerSGD's Q), tracked: checkpoints keep it
        slots = ExchangePath.slots(self.compression, self.planner)
        if slots is not None:
            self.slots = slots
        self.guard = NonFiniteGuard(self.memory, self.statistics, self.step)
        self.paths = ExchangePaths(PathContext(
            self.wire, self.compression, self.memory, self.statistics, self.tensors,
            slots, masking_density_limit(self.config.momentum_masking, self.momentum),
            self.dense_fp16, self.config.clip_norm), self.planner,
            fusion_threshold(self.config.fusion_threshold))

    def _create_delayed(self, variables):
        """Delayed averaging's queue, and what a checkpoint keeps of it."""
        config = self.resolved.config
        self.dga = DelayedAveraging(self.paths, config.fixed_delay, variables,
                                    self.period, config.auto_delay)
        # tracked: a checkpoint between exchanges carries this rank's own steps
        self.own_steps = OwnStepsInCheckpoint(self.dga)
        if self.dga.auto is not None:
            # delay="auto"'s D, tracked: a checkpoint goes on from the D it had
            self.auto_delay = tf.Variable(self.dga.auto.delay, dtype=tf.int64,
                                          trainable=False, name="auto_delay")
            self.dga.keep_delay_in(self.auto_delay)
            if self._first_delay is not None:
                self.dga.resume_delay(int(self._first_delay))  # rank 0's (elastic)

    def _host_peers(self):
        """The global ranks sharing this rank's host, sorted, where hierarchical DGC may
        run (plan.py hierarchical_hosts says where; forced where it cannot, refused with
        why); else (). One allgather at wrap time, after the config check (every rank
        gets here alike). Not with Adam taken over in TensorFlow yet: its memory holds
        the host's sum of a slice, which no rank's preconditioner scales."""
        unsupported = None
        if self.adam is not None:
            unsupported = "in TensorFlow it does not run with Adam's variance taken over yet"
        if not hierarchical_hosts(
                self.resolved, _hvd.local_size(), _hvd.cross_size(),
                self.process_set.process_set_id == global_process_set.process_set_id,
                self.elastic, unsupported):
            return ()
        return host_peers(HorovodCollectives(self.process_set), _hvd.cross_rank())

    def _held(self):
        """Elements of each tensor this rank's memory holds: all of it, or on
        hierarchical DGC (every stage, Planner.hierarchical) its slice of the host's."""
        held = []
        for t in self.tensors:
            if PathKind.HIERARCHICAL in self.planner.stage_paths(t):
                lo, hi = host_slice(t.numel, self.wire.peers)
                held.append(hi - lo)
            else:
                held.append(t.numel)
        return held

    def _planning_world(self):
        """The world the paths are chosen for: this one; for a step traced once for every
        world, at least 2 ranks (a world of one would plan no exchange, and a worker may
        join later)."""
        world = self.world_size()
        return max(2, world) if self.traced_once else world

    def _planned(self):
        """After a plan for this world: the statistics' fields for its paths, the world
        the traced step is made for, and the words at wrap time."""
        self.statistics.cover(self.paths.kinds())
        self.built_world = self.world_size()
        keras = not self.is_tape
        self.calls.lagging = self.config.lagging if keras and self.lags else ""
        self.calls.link_watch = self.config.link_watch \
            if keras and self.watcher is not None else None
        # rank 0 only: one line (the full plan with verbose), each warning once
        delay = self.dga.describe_delay() if self.dga is not None else self.delay
        PlanWords(self.planner).announce("tensorflow", delay, self.period)


class ExchangePlanChanges:
    """Where the plan changes after the set-up (eager, between steps): an elastic reset's
    world, the link measured at an elastic sync or found changed by the link watch, and
    the plan trial's all-dense steps. A part of ``GradientExchange``."""

    def replan(self):
        """After an elastic reset (Horovod re-initialised, no collective yet): each
        tensor's path for the new number of ranks; the 1/N scales and the clipping and
        fp16 bounds follow when the step is traced again. The memory stays: this rank's
        residuals are still owed to the model."""
        if self.memory is None:
            return
        self.abandon()
        with tf.init_scope():
            if not self.traced_once:  # (else the traced paths stay: they hold anywhere)
                self.planner.replan(self.world_size())
                self.paths.replan(self.planner)
                self._planned()
            self.agreeing.assign(True)
            self.memory.unsettle()  # a worker that joined holds none of the others' u

    def measure_at_sync(self):
        """Elastic Horovod: every rank is in the state's sync, so the link of this world
        is measured there (a worker that joins builds alone, and a probe at its build
        would wait for the others). Before the build the numbers wait for it; after,
        every choice is made afresh. Returns whether the paths changed (the traced step
        holds them: it must be traced again)."""
        if self.resolved.cost_model != "measure" or self.traced_once:
            return False  # (a step traced once keeps the paths it was traced with)
        with tf.init_scope():
            link, local = self._measured_at_sync = self._probed()
        if self.memory is None:
            return False
        before = [tuple(stages) for stages in self.paths.stages]
        self.planner.unmeasured = ""
        with tf.init_scope():
            self.planner.measured(link, local)
            self.paths.replan(self.planner)
            self.statistics.cover(self.paths.kinds())
        line = PlanWords(self.planner).sync_line(self.world_size())
        if _hvd.rank() == 0 and line:  # (short; the full story with verbose)
            print(line, flush=True)
        return [tuple(stages) for stages in self.paths.stages] != before

    def _link_watcher(self):
        """The link watch where it can act (hvd_dgc/torch/optimizer.py's conditions): the
        link measured, DGC choosing paths, each step waiting for its own averages (no
        delay or period), and a step ``fit`` can trace again: a Keras optimizer's (a
        tape's step lives in the script's own ``tf.function``)."""
        watch = as_link_watch(self.config.link_watch)
        if watch is None or not self.process_set.included():
            return None
        if self._paths_can_follow():
            return LinkWatchInFit(watch, self)
        if self.config.link_watch is not None:  # the script asked for it: say why not
            rank0_once(link_watch_idle(self.config, self.planner.link is not None,
                                       self.resolved.sparse, tape=self.is_tape),
                       UserWarning, key="hvd_dgc.link_watch_idle")
        return None

    def _plan_trial(self):
        """The trial of the sums' plan against all dense by the step's own time
        (plan_trial.py), where the link watch could act and ``timeline`` is not False."""
        return DenseTrial(self) if self.config.timeline is not False and \
            self._paths_can_follow() else None

    def _paths_can_follow(self):
        """Whether the paths may change under a running ``fit``: the link measured, DGC
        choosing paths, each step waiting for its own averages (no delay or period),
        and a step ``fit`` can trace again (a Keras optimizer's)."""
        return self.planner.link is not None and self.resolved.sparse and not self.lags \
            and self.process_set.included() and not self.is_tape

    def _replanned(self, change):
        """``change()`` the planner (under init_scope), then each tensor's path and the
        buckets afresh. Returns whether they changed: the step holds them, so ``fit``
        must trace it again."""
        before = ([tuple(s) for s in self.paths.stages], self.paths.buckets)
        with tf.init_scope():
            change()
            self.paths.replan(self.planner)
            self.statistics.cover(self.paths.kinds())
        return ([tuple(s) for s in self.paths.stages], self.paths.buckets) != before

    def force_dense(self, density, on):
        """A trial's plan: every flat tensor dense at ``density`` (``on``), or the sums'
        plan there again (Planner.force_dense); whether the paths changed."""
        return self._replanned(lambda: self.planner.force_dense(density, on))

    def priced_now(self):
        """``(density, launches)`` of the next step, as the watch prices its exchange
        (eager): a bucket is one Horovod operation, a tensor outside one its own."""
        stage = int(self.stage().numpy())
        buckets = self.paths.buckets[stage]
        launches = len(set(buckets.values())) + sum(t.key not in buckets for t in self.tensors)
        return self.densities[stage], launches

    def relink(self, link):
        """The link watch measured ``link`` (every rank alike): the planner moves to it,
        each tensor's path and the buckets are chosen afresh (Planner.relink). Returns
        whether they changed: the step holds them, so ``fit`` must trace it again."""
        return self._replanned(lambda: self.planner.relink(link))

    def _probed(self):
        return _probe(self.process_set, self.wire.peers, self.compression, self.resolved)


class ExchangeStep:
    """One step of the exchange, traced into the step's graph or run eagerly: the warm-up
    stage, the checks before any collective, the guard, the paths, delayed averaging. A
    part of ``GradientExchange``."""

    def stage(self):
        """This step's index into the densities (the schedule, hvd_dgc.schedule.
        DensitySchedule.__call__, in TF ops): k and the path are looked up by it, so
        they are the ones Python computed."""
        s = self.schedule
        freeze = getattr(s, "freeze", None)  # Adam taken over: FrozenAdamSchedule
        if freeze is None:
            return _stage(s, self.step, self.epoch)
        # density 1 (exact Adam) to the freeze, then the inner schedule from its start
        inner = _stage(s.inner, self.step - freeze, self.epoch)
        return tf.where(self.step < freeze, 0, 1 + inner)

    def density(self, stage=None):
        """The density at ``stage`` (default: this step's)."""
        stage = self.stage() if stage is None else stage
        return tf.gather(tf.constant(self.densities, tf.float64), stage)

    def exchange(self, grads, size=None):
        """``(averaged gradients, skipped)``; ``skipped`` is a boolean tensor, True when
        a non-finite gradient on some rank made every rank skip this step. ``size``:
        the Keras optimizer's ``(rate, decays)`` for this step (delayed.py ``step``:
        what it multiplies the update by, and the decoupled decays before it), where
        delayed averaging takes own steps back; None with a tape, whose optimizer is
        the script's."""
        checked = tf.group() if self.traced_once else self._check_world()
        if self.elastic:
            with tf.control_dependencies([checked]):
                agreed = self._agree()
            checked = tf.group(checked, agreed)
        with tf.control_dependencies([checked]):
            stage = self.stage()
        base = getattr(self.compression, "seed", 0)
        at = At(stage, self.density(stage),
                tf.stack([tf.cast(self.step, tf.int32) + base, _hvd.rank()]), self.step)
        with tf.control_dependencies([checked]):  # eagerly: None, and no-op
            # in a graph, nothing that leads to a collective starts before the check
            grads = [_after_check(self._local_grad(i, g)) for i, g in enumerate(grads)]
        if self.adam is not None:  # refresh_variance: this rank's v (tensorflow/adam.py)
            self.adam.observe(grads)
        if self.dense_fp16:
            clipped_before = self.statistics.fp16_clipped.read_value()
            with tf.control_dependencies([clipped_before]):
                out, bad = self._guarded(grads, at, size)
            with tf.control_dependencies([values(a) for a in out]):
                self.statistics.warn_fp16(clipped_before, self.step, self.wire.fp16_bound())
        else:
            out, bad = self._guarded(grads, at, size)
        # Python calls in the step are traced on every rank alike, and rank 0 alone speaks:
        # a call in rank 0's graph only left a 2-rank Keras fit with a lagging Adam
        # take-over waiting for good (tests/tensorflow/tf_adam.py fit_digits).
        if self.config.log_every:
            with tf.control_dependencies([values(a) for a in out]):
                tf.py_function(self._log, [self.step.read_value()], [])
        at_step = self.calls.at_step()
        if at_step:
            with tf.control_dependencies([values(a) for a in out]):
                self._trace_check(at_step)
        return out, bad

    def _trace_check(self, at_step):
        """At step ``at_step``, rank 0 says once what the script has not done by then
        (script_calls.py): a Python call each step, on every rank, that compares two
        numbers. (Not a ``tf.cond``: a functional If beside the step's collectives left
        a 2-rank run with 2 inter-op threads waiting for good.)"""
        def judge(step, epoch):
            if int(step) == at_step:
                self.calls.judge(int(step), float(epoch))
        tf.py_function(judge, [self.step.read_value(), self.epoch.read_value()], [])

    def _log(self, step):
        """``log_every``: rank 0 prints the statistics after every N-th step, as PyTorch's
        optimizer does (hvd_dgc/torch/statistics.py ``Progress.maybe_log``)."""
        step = int(step)
        if step and step % self.config.log_every == 0 and _hvd.rank() == 0:
            print(f"[hvd_dgc] step {step}: "
                  f"{self.statistics.format(step, float(self.density().numpy()))}", flush=True)

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
                    f"its step again), or DistributedGradientTape under horovodrun's "
                    f"elastic mode (its step then holds in every world)")

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

    @property
    def may_skip(self):
        """Whether a non-finite gradient can make every rank skip a step (guard.py): in
        a synchronous step, and in Adam's exact warm-up with delay (synchronous too);
        under delayed averaging the rank that has it drops it instead."""
        return self.skip_nonfinite and (not self.lags or self.adam is not None)

    def _guarded(self, grads, at, size):
        """skip_nonfinite: a NaN/Inf gradient never enters the memory (guard.py)."""
        if not self.skip_nonfinite:
            return self._step(grads, at, size), tf.constant(False)
        if not self.lags:
            return self._skipping(grads, at)
        if self.adam is None:
            return self._delayed(grads, at, self.guard.drop(grads), size), tf.constant(False)

        def warm_up():  # Adam's exact steps: synchronous, skipped as such
            out, bad = self._skipping(grads, at)
            return out + [bad]

        def frozen():
            return self._delayed(grads, at, self.guard.drop(grads), size) + [tf.constant(False)]
        *out, bad = tf.cond(self.adam.frozen(), frozen, warm_up)
        return out, bad

    def _skipping(self, grads, at):
        """A synchronous step every rank skips when any rank's gradient is not finite
        (the guard counts the step when it is kept)."""
        return self.guard.skip(grads, lambda poison: self.paths.step(grads, at, poison),
                               self.paths.finish, self.paths.shortcuts)

    def _synchronous(self, grads, at):
        return self.paths.finish(self.paths.step(grads, at))

    def _step(self, grads, at, size):
        """A step without the guard: synchronous, or delayed averaging; with Adam taken
        over, delayed from its freeze on (its exact warm-up is not linear in the
        gradient, so nothing of it may be replaced later: every rank takes the same
        branch, the step being theirs)."""
        if not self.lags:
            out = self._synchronous(grads, at)
        elif self.adam is None:
            out = self.dga.step(grads, at, size=size)
        else:
            out = tf.cond(self.adam.frozen(),
                          lambda: self.dga.step(grads, at, size=size),
                          lambda: self._synchronous(grads, at))
        self.step.assign_add(1)
        return out

    def _delayed(self, grads, at, dropped, size):
        """A delayed step, this rank's non-finite tensors ``dropped`` (guard.py)."""
        out = self.dga.step(grads, at, dropped, size)
        self.step.assign_add(1)
        return out

    def _local_grad(self, i, grad):
        """The gradient as it will travel: dense, or IndexedSlices (Horovod's way)."""
        tensor = self.tensors[i]
        if grad is None:
            if tensor.sliced:  # nothing looked up: no rows
                return tf.IndexedSlices(tf.zeros((0,) + tensor.shape[1:]),
                                        tf.zeros([0], tf.int32),
                                        tf.constant(tensor.shape, tf.int64))
            return tf.zeros([tensor.numel])
        if isinstance(grad, tf.IndexedSlices):
            if self.sparse_as_dense:
                return tf.convert_to_tensor(grad)
            _check_slices_allowed(self.resolved.config, tensor.name)
            return grad
        if tensor.sliced:
            raise ValueError(
                f"hvd_dgc: variable '{tensor.name}' had a sparse (IndexedSlices) gradient "
                f"when hvd_dgc built its memory and has a dense one now, and it has no "
                f"residual slot. Pass sparse_as_dense=True to hvd_dgc's "
                f"DistributedGradientTape / DistributedOptimizer.")
        return grad


class GradientExchange(ExchangeSetUp, ExchangePlanChanges, ExchangeStep, tf.Module):
    """DGC state and the per-step exchange for one set of variables: the options and the
    state (checkpoints, elastic Horovod, the flush, the statistics) here, its set-up,
    the plan's changes and its step in the three classes above, by concern."""

    def __init__(self, compression=None, momentum=0.0, nesterov=False, op=Average,
                 gradient_predivide_factor=1.0, sparse_as_dense=False,
                 process_set=global_process_set, name="hvd_dgc", config=None, optimizer=None,
                 backward_passes_per_step=1, groups=None, **options):
        """``config``: a ``hvd_dgc.config.DGCConfig``, or hvd_dgc's options by keyword;
        ``optimizer``: ``(is_sgd, class name)`` of the Keras optimizer wrapped, None for a
        tape (delayed averaging needs SGD; another optimizer's default warm-up is
        longer); Horovod's arguments as the wrapper got them, checked here."""
        super().__init__(name=name)
        if config is None:
            config = DGCConfig.from_options(options, "tensorflow", "GradientExchange")
        elif options:
            raise TypeError(f"GradientExchange: pass hvd_dgc's options in config= or by "
                            f"keyword, not both (got {sorted(options)})")
        self.resolved = config.resolve(TENSORFLOW, compression, HorovodArguments(
            op, gradient_predivide_factor, backward_passes_per_step, groups, HOROVOD_OPS),
            optimizer)
        self.momentum, self.nesterov = float(momentum), bool(nesterov)
        self.sparse_as_dense = sparse_as_dense
        self.passes = backward_passes_per_step  # (summed by the Keras optimizer)
        self.wire = Wire(process_set, op, gradient_predivide_factor)
        self.is_tape = optimizer is None  # (a Keras optimizer's step is traced again)
        if self.is_tape and isinstance(config.link_watch, LinkWatch):
            raise ValueError(
                f"link_watch={config.link_watch!r}: DistributedGradientTape's step is "
                f"traced into your tf.function, where its paths cannot follow a link that "
                f"changes (the link is measured at wrap time); use Keras' model.fit with "
                f"hvd.callbacks.DGCCallback() for a watched link, or drop link_watch.")
        self.traced_once = False  # (build: a tape under elastic Horovod)
        self.densities = stage_densities(self.resolved.schedule)
        # the calls this set-up needs of the script (set_epoch; in Keras flush, and a
        # callback of hvd_dgc's timing fit's steps: keras/callbacks.py), judged at a step
        self.calls = ScriptCalls(self.resolved.schedule, _EPOCH_FIX[self.is_tape])
        self.memory = None
        self.dga = None  # DelayedAveraging, with delay > 0
        self.adam = None  # Keras' Adam taken over (tensorflow/adam.py): take_over_adam
        self._epoch = 0.0
        self._first_step = 0  # rank 0's, for a build after an elastic reset
        self._first_delay = None  # and the D its delay="auto" had reached
        self._measured_at_sync = None  # elastic: (link, local cost) of the last sync
        self.watcher = None  # Keras, the link measured: its watch (keras/callbacks.py
        #                      _StepTimer drives it); claimed by a DGCCallback in its fit:
        self.watch_claimed = False
        self.trial = None  # Keras, the link measured: the plans tried by the step's time
        self.resuming = False  # an elastic reset happened; DGCCallback reads and clears it

    # what the options resolved to
    config = property(lambda self: self.resolved.config)
    compression = property(lambda self: self.resolved.compressor)
    schedule = property(lambda self: self.resolved.schedule)
    dense_fp16 = property(lambda self: self.resolved.dense_fp16)
    delay = property(lambda self: self.resolved.config.delay)
    period = property(lambda self: self.resolved.config.period)
    # a rank steps with its own contribution before the average comes (delay, period)
    lags = property(lambda self: bool(self.resolved.config.lagging))
    skip_nonfinite = property(lambda self: self.resolved.config.skip_nonfinite)
    op = property(lambda self: self.wire.op)
    process_set = property(lambda self: self.wire.process_set)
    # what the first step built, by variable
    names = property(lambda self: [t.name for t in self.tensors])
    numels = property(lambda self: [t.numel for t in self.tensors])

    def world_size(self):
        return self.process_set.size()

    def set_epoch(self, epoch):
        """Epoch-based warm-up: call at the start of each epoch on every rank."""
        self._epoch = float(epoch)
        self.calls.epoch_set = True
        if self.memory is not None:
            self.epoch.assign(self._epoch)

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        """A SavedModel (Keras 2's ``model.save`` in TF's format) leaves the own steps out:
        their tensors come from Python at the moment a checkpoint is written."""
        children = super()._trackable_children(save_type, **kwargs)
        if save_type != "checkpoint":
            children.pop("own_steps", None)
        return children

    # -- elastic Horovod (hvd_dgc/tensorflow/elastic.py) --------------------------
    def elastic_refusal(self):
        """Why these settings cannot run under elastic Horovod (None: they can). Delayed
        averaging and ``period`` can: every commit flushes first (elastic.py), so a
        restore goes back to weights every rank agrees on, and what was in flight since
        is dropped (``abandon``) with the steps that are done again. So can
        ``backward_passes_per_step``: the commit keeps the passes' sums and count, and
        the first calls after a reset agree on the count (keras ``_Accumulation``)."""
        return None

    def abandon(self):
        """An elastic restore or reset: drop the steps in flight (delay, period)."""
        if self.dga is not None:
            self.dga.abandon()

    def shared_state(self):
        """What decides every rank's density and path, so every rank must hold rank 0's
        after an elastic reset: (step, epoch, the D delay="auto" has reached or None);
        None before the first step."""
        if self.memory is None:
            return None
        auto = self.dga.auto if self.dga is not None else None
        return (int(self.step.numpy()), float(self.epoch.numpy()),
                None if auto is None else int(auto.delay))

    def load_shared_state(self, state):
        """Rank 0's ``shared_state()``; kept for the build when this rank has not stepped
        yet (a worker that joined: its residuals start empty, its step is rank 0's)."""
        if state is None:
            return
        step, epoch, delay = state
        self._epoch = float(epoch)
        if self.memory is None:
            self._first_step, self._first_delay = int(step), delay
        else:
            self.step.assign(step)
            self.epoch.assign(epoch)
            self.memory.unsettle()
            if delay is not None and self.dga is not None and self.dga.auto is not None:
                self.dga.resume_delay(int(delay))

    def current_epoch(self):
        """The epoch the warm-up reads (before the first step: the one it will read)."""
        return float(self.epoch.numpy()) if self.memory is not None else self._epoch

    def __call__(self, grads):
        """Averaged gradients for this step's local ``grads`` (one per built variable);
        with ``delay=D``, this rank's own update corrected by the average of step i-D."""
        return self.exchange(grads)[0]

    def take_over_adam(self, adam):
        """Keras' Adam or AdamW taken over (tensorflow/adam.py ``AdamTakeOver``): its
        first moment is the memory's momentum once its variance is frozen."""
        self.adam = adam
        self.momentum = adam.beta1

    # -- delayed averaging's end, statistics -------------------------------------
    @property
    def in_flight(self):
        """Steps whose averages have not been applied yet (delay > 0, or period > 1
        between exchanges)."""
        return self.dga.in_flight if self.dga is not None else 0

    def flush(self, apply, iterations=None, rate=-1.0):
        """Wait for every step in flight, ``apply(corrections, variables)`` them (one
        optimizer step of ``avg - own``; the optimizer's ``iterations`` variable, if
        given, is left as it was: the flush is not a training step), then average
        the variables across ranks: equal in exact arithmetic after the corrections,
        they differ in rounding. With nothing in flight it only averages them where
        ranks step with their own contributions (``period`` > 1 right after an
        exchange: each rank replaced its own steps in its own rounding). ``rate``: what
        ``apply`` multiplies the corrections by (each is taken back at its own step's
        size: hvd_dgc/lagging.py; below 0: unknown)."""
        self.calls.flushed = True
        if self.dga is None:
            return False
        corrections = self.dga.drain(float(rate))
        variables = self.dga.variables
        if corrections is not None:
            before = int(iterations.numpy()) if iterations is not None else None
            apply([tf.reshape(c, v.shape) for c, v in zip(corrections, variables)],
                  variables)
            if iterations is not None:
                iterations.assign(before)
        if self.world_size() > 1 and (corrections is not None or self.period > 1):
            averaged = _hvd.grouped_allreduce([tf.convert_to_tensor(v) for v in variables],
                                              op=Average, name="hvd_dgc.flush",
                                              process_set=self.process_set)
            for var, value in zip(variables, averaged):
                var.assign(value)
        return corrections is not None

    def stats(self):
        """Bytes sent vs dense fp32, density and path counts (this rank), as a dict."""
        out = self.statistics.summary(int(self.step.numpy()))
        out.update(step=int(self.step.numpy()), epoch=float(self.epoch.numpy()),
                   current_density=float(self.density().numpy()),
                   world_size=self.world_size())
        if self.adam is not None:  # which phase runs: "exact Adam" / "frozen variance"
            out.update(self.adam.stats(int(self.step.numpy())))
        if self.dga is not None:  # the D in force, the period, delay="auto"'s decisions
            out.update(self.dga.stats())
        if self.watcher is not None:  # probes of the link and where the paths followed
            out.update(self.watcher.state.stats())
        if self.trial is not None:  # the plans tried by the step's own time, and kept
            out.update(self.trial.stats())
        return out


def _stage(schedule, step, epoch):
    """A DensitySchedule's stage at ``step`` / ``epoch``, in TF ops (as its Python
    ``__call__`` counts the stages ended); its final density's index after the warm-up."""
    s = schedule
    if s.warmup <= 0:
        return tf.constant(0, tf.int32)
    t = tf.cast(epoch if s.unit == "epoch" else step, tf.float64)
    ends = tf.constant(s.boundaries, tf.float64)
    stage = tf.minimum(tf.reduce_sum(tf.cast(t >= ends, tf.int32)),
                       len(s.warmup_densities) - 1)
    return tf.where(t >= s.warmup, len(s.warmup_densities), stage)


def _after_check(grad):
    """``grad`` through an identity, so it depends on the control context it is made in."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(tf.identity(grad.values), grad.indices, grad.dense_shape)
    return tf.identity(grad)


def _check_traced_once(r, compression):
    """What a tape's step traced once for every world size (elastic Horovod) cannot
    hold under the resolved options ``r``, refused with the fix: its structure or its
    bounds would be the world's at the first trace."""
    problem = None
    if r.config.lagging:
        problem = (f"{r.config.lagging} keeps collectives in flight across steps",
                   r.config.undo_lagging)
    elif r.kind == "exchange":
        problem = (f"compression {type(compression).__name__} decodes a payload "
                   f"per rank", "leave compression at Compression.dgc (the default)")
    elif r.dense_fp16:
        problem = ("fp16 values bound what each rank sends by the number of ranks",
                   "pass compression=hvd.Compression.none (fp32 values)")
    elif PathKind.REGION in r.aggregations and PathKind.ALLGATHER not in r.aggregations:
        problem = ("region reduce splits indices into one region per rank",
                   "pass aggregation='allgather' or 'auto'")
    if problem:
        raise ValueError(
            f"hvd_dgc: DistributedGradientTape under elastic Horovod: {problem[0]}, and "
            f"the tape's step (your tf.function) is traced once for every world size. "
            f"Either {problem[1]}, or train with hvd_dgc.tensorflow.keras's "
            f"DistributedOptimizer and its hvd.elastic.KerasState (model.fit traces "
            f"its step again after a reset).")


def _every_step(r, name):
    """0/1 Adam's period is Adam's default, not the script's: where a variable has
    IndexedSlices gradients (an Embedding), which no rank's own step can be taken
    back from, the sign goes every step instead (1-bit Adam), said once, on rank 0:
    the resolved options ``r`` so changed."""
    rank0_once(f"hvd_dgc: variable '{name}' has a sparse (IndexedSlices) gradient (an "
               f"embedding lookup?), so Adam's default local steps between exchanges "
               f"(0/1 Adam, period={r.config.period}) cannot run: the sign is sent at "
               f"every step (1-bit Adam). Pass sparse_as_dense=True for them.",
               UserWarning)
    return r.every_step()


def _check_slices_allowed(config, name):
    """A variable with IndexedSlices gradients cannot lag (``config.lagging``)."""
    if config.lagging:
        raise ValueError(
            f"hvd_dgc: variable '{name}' has a sparse (IndexedSlices) gradient (an "
            f"embedding lookup?) and {config.lagging}: a rank's own steps replaced by "
            f"the average later need dense gradients. Pass sparse_as_dense=True to "
            f"hvd_dgc's DistributedGradientTape / DistributedOptimizer, or "
            f"{config.undo_lagging}.")


def _probe(process_set, peers, compression, resolved):
    """``(LinkMeasurement, LocalCost or PayloadCost)`` of this world, agreed by every
    rank of the process set (each calls it at the same point): the link, and the
    compressor's own work on this device, DGC's selection where it is sparse, the
    encoding and decoding where it allgathers payloads (linkprobe.py, localcost.py)."""
    collectives = HorovodCollectives(process_set)
    link = probe_link(collectives, peers)
    local = None
    if link is not None and resolved.sparse:
        local = measure_local(compression, collectives, resolved.final_density() or 0.001)
    elif link is not None and hasattr(compression, "payload_bytes"):
        local = measure_payload(compression, collectives)
    return link, local
