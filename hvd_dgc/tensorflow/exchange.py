"""The path of one gradient in TensorFlow, shared by DistributedGradientTape and the
Keras DistributedOptimizer. At wrap time the options are resolved and checked
(hvd_dgc/resolve.py, ``DGCConfig.resolve``); at the first step the planner
(hvd_dgc/plan.py, shared with PyTorch) gives each tensor a path per density stage and
the parts are made (tensorflow/parts.py ``ExchangeSetUp``). Then, every step, inside
the user's ``tf.function`` or eagerly (tensorflow/step.py ``ExchangeStep``):

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

import tensorflow as tf
import horovod.tensorflow as _hvd
from horovod.tensorflow.mpi_ops import Adasum, Average, Sum, global_process_set

from hvd_dgc.config import DGCConfig
from hvd_dgc.resolve import Framework, HorovodArguments
from hvd_dgc.linkprobe import probe_world
from hvd_dgc.linkwatch import LinkWatch, as_link_watch, link_watch_idle
from hvd_dgc.plan import stage_densities
from hvd_dgc.plan_words import PlanWords
from hvd_dgc.say import rank0_once
from hvd_dgc.script_calls import ScriptCalls
from hvd_dgc.tensorflow.collective import ExchangeCompressor
from hvd_dgc.tensorflow.compression import Compression, SparseCompressor
from hvd_dgc.tensorflow.link import LinkWatchInFit
from hvd_dgc.tensorflow.paths import Wire
from hvd_dgc.tensorflow.plan_trial import DenseTrial
from hvd_dgc.tensorflow.seam import HorovodCollectives
from hvd_dgc.tensorflow import link as timing
from hvd_dgc.tensorflow.parts import ExchangeSetUp
from hvd_dgc.tensorflow.step import ExchangeStep

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
        return probe_world(HorovodCollectives(self.process_set), self.wire.peers,
                           self.compression, self.resolved, timing)


class GradientExchange(ExchangeSetUp, ExchangePlanChanges, ExchangeStep, tf.Module):
    """DGC state and the per-step exchange for one set of variables: the options and the
    state (checkpoints, elastic Horovod, the flush, the statistics) here; its set-up in
    ``ExchangeSetUp`` (tensorflow/parts.py), the plan's changes in
    ``ExchangePlanChanges`` (above), its step in ``ExchangeStep`` (tensorflow/step.py)."""

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
