"""hvd_dgc's DistributedOptimizer for PyTorch: Horovod's, with Deep Gradient Compression.

Same signature and behaviour as ``horovod.torch.DistributedOptimizer``
(synchronize, skip_synchronize, backward_passes_per_step, groups, process
sets, broadcast_optimizer_state), plus DGC (Lin et al., ICLR 2018): momentum
correction, momentum factor masking, local gradient clipping, warm-up, and a
per-tensor choice among dense allreduce, sparse allgather and region reduce;
delayed averaging (Zhu et al., NeurIPS 2021) and temporally sparse updates.

This class is Horovod's API only. The work is done by parts that each own their
state, assembled at wrap time (torch/parts.py), and a step runs them (torch/step.py
``ExchangeStep``, with the step's own fields); the gradient travels between them as an
argument:

    backward hook -> scheduler.ready(p, place)     which tensors leave now (scheduler.py)
      -> exchange.launch(params, place)            clip, accumulate, select, pack,
                                                   communicate (exchange.py, paths.py)
    step() -> synchronize():
      scheduler.finish(place)                      what has not left yet, launched
      exchange.advance(launches)                   second rounds
      delay 0, period 1: exchange.collect(launch)  the average -> p.grad
                         guard.settle(...)         a non-finite step undone (guard.py)
      otherwise: lagging.gradients(...)            own now, avg - own D steps later
                                                   (lagging.py)
      base optimizer step                          SGD's momentum and weight decay off:
                                                   the memory applied them (sgd.py); Adam
                                                   once its variance is frozen (adam.py)

The planner (hvd_dgc/plan.py, shared with TensorFlow) decides each tensor's path; the
options were resolved and checked once (hvd_dgc/resolve.py, ``DGCConfig.resolve``).
"""

import warnings
from contextlib import contextmanager

import torch
import horovod.torch as _hvd
from horovod.torch.mpi_ops import Adasum, Average, Sum, global_process_set

from hvd_dgc.config import DGCConfig
from hvd_dgc.resolve import Framework, HorovodArguments
from hvd_dgc.outer import check_outer
from hvd_dgc.plan import TensorInfo
from hvd_dgc.plan_words import PlanWords
from hvd_dgc.say import rank0_once, rank0_warn
from hvd_dgc.torch.adam import check_adam
from hvd_dgc.torch.at_exit import settle_at_exit
from hvd_dgc.torch.collective import ExchangeCompressor
from hvd_dgc.torch.compression import Compression, SparseCompressor
from hvd_dgc.torch.names import check_dtypes, tensor_names
from hvd_dgc.torch.outer import outer_optimizer
from hvd_dgc.torch.parts import Wrapped, assemble, average_in_place, measure
from hvd_dgc.torch.paths import CLASSES
from hvd_dgc.torch.seam import HorovodCollectives
from hvd_dgc.torch.statistics import STATE_KEY, checkpoint, restore
from hvd_dgc.torch.step import ExchangeStep

__all__ = ["DistributedOptimizer"]

TORCH = Framework("torch", Compression, (SparseCompressor, ExchangeCompressor), torch.Tensor,
                  "torch.Tensor", frozenset(k for k, path in CLASSES.items() if path.batched))


class _DistributedOptimizer(torch.optim.Optimizer):
    # Horovod's broadcast_optimizer_state calls the *base* step (no collectives)
    # to initialise state only for classes from horovod.torch.optimizer's module.
    __module__ = "horovod.torch.optimizer"
    _hvd_dgc_optimizer = True  # hvd_dgc/torch/elastic.py recognises it by this

    def __init__(self, params, named_parameters, backward_passes_per_step, op,
                 gradient_predivide_factor, groups, sparse_as_dense, process_set, resolved,
                 grad_scaler):
        super(self.__class__, self).__init__(params)
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self._should_synchronize = True

        every = [p for g in self.param_groups for p in g["params"]]
        self._param_index = {p: i for i, p in enumerate(every)}
        # parameter -> name, Horovod's own attribute (its tests read it)
        self._parameter_names = names = tensor_names(named_parameters, self.param_groups)
        check_dtypes(every, names)
        infos = {p: TensorInfo(self._param_index[p], names[p], p.numel(), tuple(p.shape))
                 for p in every}
        parts = assemble(Wrapped(self, op, gradient_predivide_factor, backward_passes_per_step,
                                 groups, sparse_as_dense, process_set, resolved, grad_scaler,
                                 self._param_index, infos))
        (self._resolved, self._progress, self._calls, self._takeover, self._guard,
         self._planner, self._delayed, self._watcher, self._wire, self._exchange,
         self._scheduler, self._profiler) = parts
        self._config = self._resolved.config
        self._exchange_step = ExchangeStep(parts, process_set, grad_scaler, self._param_index)
        if self._config.lagging:  # a script that ends without flush() leaves its last
            #                         steps in flight (at_exit.py)
            settle_at_exit(self, lambda opt: opt._delayed.abandon(opt._exchange))
        # Unlike Horovod, hooks are registered at np=1 too: the same maths at any size.
        trainable = [p for p in every if p.requires_grad] if process_set.included() else []
        self._hooks = [p.register_post_accumulate_grad_hook(
            lambda *_, p=p: self._exchange_step.ready(p)) for p in trainable]

    def _announce(self):
        """Rank 0 only: what hvd_dgc does here in one line (the full plan with
        ``verbose``), and each warning once (hvd_dgc/plan_words.py ``PlanWords.announce``)."""
        PlanWords(self._planner).announce("torch", self._delayed.describe_delay(),
                               self._delayed.period, self._progress.density())

    # -- Horovod's optimizer API ---------------------------------------------------------
    def synchronize(self, flush=False):
        """Launch what has not been launched, wait for what is due, fill ``p.grad``.

        With ``delay=D`` only the launches of D steps ago are due (``period=p``: those of
        the exchange D steps ago, and the p steps it covers); ``flush=True`` waits for
        all of them, so the step that follows leaves every rank with the same weights
        (end of training, before evaluation or a checkpoint). A flush between exchanges
        takes back this rank's own steps since the last one: its memory still holds
        them, and the next exchange sends them."""
        self._exchange_step.synchronize(flush)

    @contextmanager
    def skip_synchronize(self):
        """For ``synchronize(); unscale/clip; with skip_synchronize(): step()``."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if not self._should_synchronize and self._delayed.keeps_own:
            self._warn_changed_gradients()
        if self._should_synchronize:
            if self._exchange_step.synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(). This can cause training "
                              "slowdown. You may want to consider using "
                              "optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.")
            self._exchange_step.synchronize(views=True)
        self._exchange_step.synchronized = False
        if self._exchange_step.skip:  # a non-finite average: every rank skips (guard.py)
            self._exchange_step.skip = False
            return None
        sparse, views = self._exchange_step.taken()
        loss = self._takeover.step(super(self.__class__, self).step, closure, sparse, views)
        if self._exchange_step.average_after:
            self._average_parameters()
        self._progress.step += 1
        if self._calls.due(self._progress.step):
            self._calls.judge(self._progress.step, self._progress.epoch)
        self._progress.maybe_log(_hvd.rank())
        return loss

    def _warn_changed_gradients(self):
        """Once: ``synchronize(); clip; skip_synchronize(): step()`` under delay or period.
        The step applies ``own_i - own_(i-D) + avg_(i-D)`` on the promise that the own
        steps taken back later are the ones applied; a gradient scaled in between (a
        clip) breaks it and each rank drifts from the others by what the scaling kept."""
        rank0_once(
            f"hvd_dgc: {self._config.lagging} with synchronize()/skip_synchronize(): "
            f"gradients changed in between (e.g. clip_grad_norm_) break the delayed "
            f"correction and the ranks drift apart. Clip with clip_norm= instead, or use "
            f"{self._config.undo_lagging}.",
            UserWarning, key="hvd_dgc.lagging_changed_gradients")

    def zero_grad(self, set_to_none=True):
        if self._scheduler.pending:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() "
                                 "but before optimizer.step() or optimizer.synchronize(). "
                                 "This is prohibited as it can cause a race condition.")
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)

    def set_backward_passes_per_step(self, passes):
        self.backward_passes_per_step = passes
        self._scheduler.restart(passes)

    # -- hvd_dgc's additions ---------------------------------------------------------------
    def set_epoch(self, epoch):
        """Drive an epoch-based warm-up (call at the start of each epoch, on every rank,
        as ``DistributedSampler.set_epoch``: 0 first)."""
        self._progress.epoch = float(epoch)
        self._calls.epoch_set = True

    def flush(self):
        """Drain delayed averaging: wait for every step still in flight, apply its
        average in place of this rank's own contribution, and leave every rank with
        identical weights. Call after ``step()``. With nothing in flight it only
        averages the weights (``period > 1`` right after an exchange: equal on every
        rank up to float rounding), or does nothing (synchronous steps)."""
        if self._scheduler.pending:
            raise RuntimeError("hvd_dgc: flush() was called between backward() and step(); "
                               "call it after optimizer.step() (or use "
                               "optimizer.synchronize(flush=True) before step()).")
        if not self._delayed.inflight:
            if self._delayed.keeps_own:  # a period's exchange, just applied: each rank
                self._average_parameters()  # replaced its own steps in its own rounding
            return
        self._apply_in_flight()
        self._average_parameters()

    def _apply_in_flight(self):
        """What is in flight applied now, as one step of its corrections: ``avg - own``
        of each exchange (waited for), ``-own`` of each step since the last one."""
        corrections = self._delayed.gradients(self._exchange, [], self._delayed.due(0, True),
                                              self._takeover.step_sizes(ahead=False))
        self._delayed.flushed()
        saved = {p: p.grad for p in corrections}
        try:
            for p, c in corrections.items():
                p.grad = self._exchange.members[p].shaped(c).to(p.dtype)
            self._takeover.correct(super(self.__class__, self).step)  # linear: lagging.py
        finally:
            for p, g in saved.items():
                p.grad = g

    def _average_parameters(self):
        """Mathematically equal after a flush, the ranks' weights still differ in float
        rounding (each summed its corrections in its own order): average them once."""
        self._exchange_step.average_after = False
        params = self._scheduler.params
        if params and self.process_set.size() > 1:
            average_in_place([p.data for p in params], "hvd_dgc.flush", self.process_set)

    @property
    def in_flight(self):
        """Number of steps whose averages have not been applied yet (delay > 0, or
        period > 1 between exchanges)."""
        return len(self._delayed.inflight)

    @property
    def density(self):
        """Density the next step will use."""
        return self._progress.density()

    def residual(self, p):
        """``p``'s DGC residual (the memory's ``v``, a flat view), or None."""
        return self._exchange.residual(p)

    def dgc_memory(self):
        """This rank's DGC memory, ``{parameter name: {"u": velocity or None, "v":
        residual}}`` (copies, flat): what a checkpoint keeps, by name."""
        names = {m.key: m.name for m in self._exchange.members.values()}
        return {names[key]: s for key, s in self._exchange.memory_state().items()}

    @property
    def compressor(self):
        """The compressor this optimizer owns (a copy of the one passed: its random
        state and PowerSGD's Q are this optimizer's)."""
        return self._resolved.compressor

    @property
    def schedule(self):
        """The density schedule in force (``schedule(step, epoch)``)."""
        return self._resolved.schedule

    def compression_stats(self):
        """Bytes sent vs dense fp32, density and path counts (this rank), as a dict."""
        out = self._progress.stats.summary()
        lagging, guard = self._delayed, self._guard
        out.update(step=self._progress.step, epoch=self._progress.epoch,
                   current_density=self.density, world_size=self.process_set.size(),
                   overflow_steps=guard.overflow_steps, nonfinite_steps=guard.nonfinite_steps,
                   delay=lagging.delay, period=lagging.period)
        if lagging.auto is not None:
            out.update(delay_decisions=list(lagging.auto.decisions))
        out.update(self._takeover.stats())
        if self._watcher is not None:
            out.update(self._watcher.state.stats())
        if self._profiler is not None:
            out.update(self._profiler.stats())
        return out

    def state_dict(self):
        """hvd_dgc's state with the base optimizer's. Between a period's exchanges (0/1
        Adam, AdamW's default) this rank's own steps since the last exchange are taken
        back first, in place (``flush()``'s part that needs no other rank: its velocity
        is still in the memory, which the next exchange sends), so the weights a script
        saves beside it are the last exchange's, which every rank agrees on, whether
        every rank saves or rank 0 alone (Horovod's examples); the ranks go on
        consistently, since the next exchange's average replaces whatever own steps each
        still holds. With a collective in flight (``delay``) it refuses: call
        ``flush()`` on every rank first."""
        if self._delayed.inflight:
            if not self._delayed.only_own():
                raise RuntimeError(
                    f"hvd_dgc: {len(self._delayed.inflight)} step(s) await an average (delay="
                    f"{self._delayed.delay}, period={self._delayed.period}); their averages "
                    f"cannot be saved. Call optimizer.flush() after step() before "
                    f"optimizer.state_dict().")
            self._apply_in_flight()
        state = super(self.__class__, self).state_dict()
        state[STATE_KEY] = checkpoint(self._progress, self._exchange.memory_state(),
                                      self._resolved.compressor, self._guard, self._delayed,
                                      _hvd.rank())
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        dgc_state = state_dict.pop(STATE_KEY, None)
        self._delayed.abandon(self._exchange)
        self._scheduler.clear()  # a step cut short (elastic reset) starts counting afresh
        self._exchange_step.fresh()
        self._exchange.memory.undo.commit()  # a step cut short has nothing to undo
        self._guard.reset()
        self._should_synchronize = True
        super(self.__class__, self).load_state_dict(state_dict)
        if dgc_state is None:
            rank0_warn("hvd_dgc: the loaded optimizer state has no hvd_dgc entry (a plain "
                       "Horovod/torch checkpoint?); residuals and velocities start at zero.")
            return
        index_to_param = {i: p for p, i in self._param_index.items()}
        dgc_state = dict(dgc_state, memory=self._exchange.load_memory_state(dgc_state["memory"]))
        restore(dgc_state, self._progress, self._exchange.memory, self._resolved.compressor,
                self._guard, self._delayed, lambda key: index_to_param[key].device,
                _hvd.rank())

    # -- elastic Horovod (elastic.py) ------------------------------------------------
    def shared_state(self):
        """What decides every rank's density and path: (step, epoch, delay)."""
        return self._progress.step, self._progress.epoch, self._delayed.delay

    def load_shared_state(self, state):
        """Rank 0's ``shared_state()`` after an elastic sync; delay="auto" from a fresh
        window of measurements."""
        self._progress.step, self._progress.epoch, delay = state
        self._delayed.resume_delay(delay)
        if self.process_set.included() and self._planner.measure:
            # every rank is in this sync: the link of this world measured afresh
            self._planner.replan(self.process_set.size())
            measure(self._planner, HorovodCollectives(self.process_set),
                    [p for p in self._param_index if p.requires_grad])
            line = PlanWords(self._planner).sync_line(self.process_set.size())
            if _hvd.rank() == 0 and line:  # (short; the full story with verbose)
                print(line, flush=True)


# -- wrap time -----------------------------------------------------------------------------

def DistributedOptimizer(optimizer, named_parameters=None, compression=None,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=global_process_set, *, dense_compression=None,
                         grad_scaler=None, outer=None, **options):
    """Wrap a torch optimizer so it averages gradients with DGC over Horovod.

    Horovod's arguments keep their meaning (see horovod.torch.DistributedOptimizer).
    ``compression`` not given, or Horovod's ``Compression.none`` / ``fp16`` (which its
    example scripts pass), mean DGC with fp32 / fp16 values (hvd_dgc/switch.py). With
    ``torch.optim.Adam`` or ``AdamW`` and no option of DGC's top-k, those three send the
    scaled sign after the freeze, an exchange every 4th step (0/1 Adam, hvd_dgc/adam.py).
    ``density=1.0``: dense averaging, through the memory. ``Compression.powersgd``,
    ``sign``, ``terngrad``, ``qsgd`` and ``bf16`` run their own collectives
    (collective.py), with error feedback through the same memory. Rank 0 prints one
    line at wrap time saying what runs.

    hvd_dgc's options are keyword only, the same for TensorFlow and Keras
    (docs/options.md, made from ``hvd_dgc.config.DGCConfig``); an unknown one is
    refused with the closest name. PyTorch's own: ``dense_compression`` (``none`` or
    ``fp16`` on the dense path, its rounding error kept in the residual) and
    ``grad_scaler`` (the ``torch.amp.GradScaler`` in use: the memory holds unscaled
    gradients). ``outer=hvd_dgc.OuterLoop(steps=H)``: an outer loop instead (DiLoCo;
    hvd_dgc/outer.py): ``optimizer`` steps locally and every H-th step the weights'
    change is averaged and applied by outer Nesterov momentum.

    With ``torch.optim.SGD`` the memory applies SGD's momentum (momentum correction)
    and weight decay, and the base step runs with both switched off. Sparse gradients
    (``nn.Embedding(sparse=True)``) travel as in Horovod: their rows allgathered and
    averaged, no DGC, their momentum applied by the base SGD; ``sparse_as_dense=True``
    densifies them first, and they then go through DGC like any dense gradient.
    """
    config = DGCConfig.from_options(options, "torch", "DistributedOptimizer")
    if outer is not None:
        check_outer(outer, config, compression in (None, Compression.dgc, Compression.none),
                    op == Average)
        return outer_optimizer(optimizer, named_parameters, outer, config, process_set)
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be "
                      "removed in v0.23.0.", DeprecationWarning)
        if groups is None:
            groups = num_groups
    resolved = config.resolve(
        TORCH, compression, HorovodArguments(op, gradient_predivide_factor,
                                             backward_passes_per_step, groups,
                                             (Average, Sum, Adasum)),
        (isinstance(optimizer, torch.optim.SGD), type(optimizer).__name__,
         isinstance(optimizer, torch.optim.Adam)),
        dense_compression=dense_compression, grad_scaler=grad_scaler)
    if resolved.freeze is not None:
        check_adam(optimizer)
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_DistributedOptimizer.__dict__))
    wrapped = cls(optimizer.param_groups, named_parameters, backward_passes_per_step, op,
                  gradient_predivide_factor, groups, sparse_as_dense, process_set, resolved,
                  grad_scaler)
    if process_set.included():
        wrapped._announce()
    return wrapped

