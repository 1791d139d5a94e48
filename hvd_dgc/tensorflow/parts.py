"""The parts of TensorFlow's exchange, made at its first step (eager, once), when the
variables and their gradients are known (tensorflow/exchange.py ``GradientExchange``
joins ``ExchangeSetUp``; PyTorch assembles its parts at wrap time: torch/parts.py):

    _sliced        which variables have IndexedSlices gradients (no residual slot)
    _plan          the Planner: every rank's configuration compared, the hosts' ranks,
                   the link and DGC's own work measured (``probe``), Adam's freeze, the
                   link watch and the plan trial
    _create_state  the step and epoch variables, the statistics, the memory, the
                   compressor's slots, the guard, the paths
    _create_delayed  delayed averaging's queue, and what a checkpoint keeps of it
    _planned       the words at wrap time
"""

import os

import numpy as np
import tensorflow as tf
import horovod.tensorflow as _hvd

from hvd_dgc.consistency import check_consistent, optimizer_consistency
from hvd_dgc.linkwatch import link_watch_idle
from hvd_dgc.masking import masking_density_limit
from hvd_dgc.paths import PathKind
from hvd_dgc.fusion import fusion_threshold
from hvd_dgc.plan import Planner, TensorInfo, hierarchical_peers
from hvd_dgc.plan_words import PlanWords
from hvd_dgc.say import rank0_once
from hvd_dgc.tensorflow.delayed import DelayedAveraging, OwnStepsInCheckpoint
from hvd_dgc.tensorflow.guard import NonFiniteGuard
from hvd_dgc.tensorflow.memory import DGCMemory
from hvd_dgc.tensorflow.names import tensor_names
from hvd_dgc.tensorflow.paths import ExchangePath, ExchangePaths, PathContext, host_slice
from hvd_dgc.tensorflow.seam import HorovodCollectives
from hvd_dgc.tensorflow.statistics import Statistics
from hvd_dgc.tensorflow.step import check_slices_allowed

__all__ = ["ExchangeSetUp"]


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
                check_slices_allowed(self.resolved.config, name)
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
                             optimizer_consistency(self.planner, momentum=self.momentum,
                                                   nesterov=self.nesterov, op=repr(self.op)),
                             "hvd_dgc.tensorflow")
        # not with Adam taken over in TensorFlow yet: its memory would hold the host's
        # sum of a slice, which no rank's preconditioner scales
        unsupported = None if self.adam is None else \
            "in TensorFlow it does not run with Adam's variance taken over yet"
        peers = hierarchical_peers(self.resolved, HorovodCollectives(self.process_set), _hvd,
                                   self.elastic, unsupported)
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
