"""hvd_dgc's DistributedOptimizer for PyTorch: Horovod's, with Deep Gradient Compression.

Same signature and behaviour as ``horovod.torch.DistributedOptimizer``
(synchronize, skip_synchronize, backward_passes_per_step, groups, process
sets, broadcast_optimizer_state), plus DGC (Lin et al., ICLR 2018): momentum
correction, momentum factor masking, local gradient clipping, warm-up, and a
per-tensor choice among dense allreduce, sparse allgather and region reduce;
delayed averaging (Zhu et al., NeurIPS 2021) and temporally sparse updates.

This class is Horovod's API only. The work is done by parts that each own their
state, and the gradient travels between them as an argument:

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
options were resolved and checked once (hvd_dgc/config.py ``DGCConfig.resolve``).
"""

import os
import time
import warnings
from contextlib import contextmanager

import torch
import horovod.torch as _hvd
from horovod.torch.mpi_ops import Adasum, Average, Sum, global_process_set

from hvd_dgc.config import DGCConfig
from hvd_dgc.resolve import Framework, HorovodArguments
from hvd_dgc.consistency import check_consistent
from hvd_dgc.fp16wire import clip_warning
from hvd_dgc.linkprobe import probe_link
from hvd_dgc.linkwatch import LinkWatcher, as_link_watch, link_watch_idle, relinked_words
from hvd_dgc.outer import check_outer
from hvd_dgc.fusion import fusion_threshold
from hvd_dgc.plan import Planner, TensorInfo, hierarchical_hosts
from hvd_dgc.plan_words import PlanWords
from hvd_dgc.say import rank0_once, rank0_warn
from hvd_dgc.script_calls import ScriptCalls
from hvd_dgc.seam import host_peers
from hvd_dgc.stats import REFRESH
from hvd_dgc.torch.adam import AdamTakeOver, check_adam
from hvd_dgc.torch.at_exit import settle_at_exit
from hvd_dgc.torch.plan_trial import BackwardProfiler
from hvd_dgc.torch.collective import ExchangeCompressor
from hvd_dgc.torch.compression import Compression, SparseCompressor, on_accelerator
from hvd_dgc.torch.delayed import DelayedAveraging
from hvd_dgc.torch.exchange import GradientExchange, Member, StepPlace, memory_order
from hvd_dgc.torch.guard import NonFiniteGuard
from hvd_dgc.torch.link import measure_local, measure_payload
from hvd_dgc.torch.names import check_dtypes, tensor_names
from hvd_dgc.torch.outer import outer_optimizer
from hvd_dgc.torch.paths import CLASSES, Wire
from hvd_dgc.torch.scheduler import LaunchScheduler
from hvd_dgc.torch.seam import HorovodCollectives
from hvd_dgc.torch.sgd import SGDTakeOver
from hvd_dgc.torch.statistics import STATE_KEY, Progress, checkpoint, restore
from hvd_dgc.torch.update import ViewUpdate

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
        self._resolved, self._config = resolved, resolved.config
        self._should_synchronize = True
        self._average_after_step = False
        self._fresh_step()

        every = [p for g in self.param_groups for p in g["params"]]
        self._param_index = {p: i for i, p in enumerate(every)}
        # parameter -> name, Horovod's own attribute (its tests read it)
        self._parameter_names = names = tensor_names(named_parameters, self.param_groups)
        check_dtypes(every, names)
        trainable = [p for p in every if p.requires_grad]
        infos = {p: TensorInfo(self._param_index[p], names[p], p.numel(), tuple(p.shape))
                 for p in every}
        self._progress = Progress(resolved.schedule, resolved.sparse, self._config.log_every,
                                  self._config.min_compress_size)
        # the calls this set-up needs of the script, judged at a step (script_calls.py)
        self._calls = ScriptCalls(resolved.schedule, "Call optimizer.set_epoch(epoch) at the "
                                  "start of each epoch (as DistributedSampler.set_epoch)")
        self._takeover = self._take_over(process_set.included())
        self._guard = NonFiniteGuard(self._config.skip_nonfinite, grad_scaler,
                                     resolved.compressor, _hvd.rank())
        self._grad_scaler = grad_scaler
        self._planner = Planner(resolved, [infos[p] for p in trainable], process_set.size())
        self._progress.stage_line = PlanWords(self._planner).stage_line  # a new stage's
        #                                                                  paths, said
        peers = self._agree(process_set, trainable, resolved) if process_set.included() \
            else ()
        # 0/1 Adam's default period dropped where Adam is not taken over (plan.py)
        self._resolved = resolved = self._planner.settled()
        self._config = resolved.config
        self._delayed = DelayedAveraging(self._config, process_set, resolved.freeze or 0,
                                         lambda: self._progress.step)
        if self._config.lagging:  # a script that ends without flush() leaves its last
            #                         steps in flight (at_exit.py)
            settle_at_exit(self, lambda opt: opt._delayed.abandon(opt._exchange))
        self._watcher = _link_watcher(self._config, resolved, self._planner, process_set)
        self._wire = Wire(process_set, op, gradient_predivide_factor, peers)
        members = {p: Member(p, infos[p].key, infos[p].name, infos[p], order=memory_order(p))
                   for p in every}
        self._exchange = GradientExchange(
            resolved, self._planner, self._wire, self._progress.stats, self._guard, members,
            self._takeover.hyper, self._takeover.scale, sparse_as_dense, process_set.size)
        self._scheduler = LaunchScheduler(
            trainable, self._param_index, infos, groups, backward_passes_per_step,
            self._planner, fusion_threshold(self._config.fusion_threshold), on_accelerator,
            sparse_as_dense)
        self._profiler = _backward_profiler(self._config, resolved, self._planner,
                                            process_set, self._scheduler, self._takeover)
        # Unlike Horovod, hooks are registered at np=1 too: the same maths at any size.
        self._hooks = [p.register_post_accumulate_grad_hook(lambda *_, p=p: self._ready(p))
                       for p in trainable] if process_set.included() else []

    def _fresh_step(self):
        """Nothing of a step yet: synchronized, skipped, its sparse gradients, its
        ViewUpdates (update.py, for the take-over's step), its StepPlace (made at its
        first launch) and its launches, in launch order."""
        self._synchronized = self._skip_step = False
        self._sparse_grads, self._views = set(), []
        self._place, self._launches = None, []

    def _agree(self, process_set, trainable, resolved):
        """With the other ranks: the same configuration, the hosts' ranks (hierarchical
        DGC), the link and DGC's own work measured, Adam's freeze. Returns this host's
        ranks. Elastic: a worker added later wraps its optimizer alone while the others
        wait in a reset, so the collectives that would hang it run at each sync instead.
        All run the same script."""
        collectives = HorovodCollectives(process_set)
        elastic = os.environ.get("HOROVOD_ELASTIC") == "1"
        if not elastic:
            check_consistent(collectives, self._planner.consistency(
                **self._horovod_config()), "DistributedOptimizer")
        peers = _host_peers(self._planner, collectives)
        self._planner.replan(process_set.size(), local_size=len(peers))
        if not elastic:
            self._measure(collectives, trainable, peers)
        self._takeover.freeze_at(self._planner.adam_freeze(resolved.chosen_lagging))
        return peers

    def _ready(self, p):
        """``p``'s hook, timed while the backward pass is profiled."""
        if self._profiler is None:
            self._leave_now(p)
        else:
            self._profiler.hook(self._param_index[p], self._leave_now, p)

    def _leave_now(self, p):
        """What the scheduler says leaves now that ``p`` is ready, launched."""
        place = self._step_place()
        for members in self._scheduler.ready(p, place):
            self._launches += self._launch(members, place)

    def _measure(self, collectives, trainable, peers=()):
        """The link (inside the host too, where ``peers`` are several) and the
        compressor's own work on this device (DGC's selection, or a payload compressor's
        encoding and decoding), measured (the default cost model: hvd_dgc/linkprobe.py,
        hvd_dgc/localcost.py): every rank of the process set calls this at the same point
        (the wrapper; elastic: each sync)."""
        if not self._planner.measure:
            return
        resolved = self._resolved
        link = probe_link(collectives, peers)
        local = None
        device = trainable[0].device if trainable else "cpu"
        if link is not None and resolved.sparse:  # DGC's own work, this device
            local = measure_local(resolved.compressor, collectives,
                                  resolved.final_density() or 0.001, device)
        elif link is not None and hasattr(resolved.compressor, "payload_bytes"):
            local = measure_payload(resolved.compressor, collectives, device)
        self._planner.measured(link, local)

    def _take_over(self, included):
        """What of the wrapped optimizer's update DGC's memory applies: SGD's momentum
        and weight decay (sgd.py), Adam's first moment once its variance is frozen
        (adam.py), or nothing."""
        if included and self._resolved.freeze is not None:
            return AdamTakeOver(self, self._resolved.freeze, lambda: self._progress.step,
                                lambda p, u: self._exchange.seed_velocity(p, u),
                                self._resolved.refresh,
                                lambda p, ratio: self._exchange.rescale(p, ratio),
                                self._average_variance)
        return SGDTakeOver(self, isinstance(self, torch.optim.SGD) and included,
                           plain=type(self).__bases__[0].step is torch.optim.SGD.step)

    def _follow_link(self, relink, step):
        """Where the link watch found a new link (linkwatch.py ``Relink``): every
        tensor's path chosen afresh for it, and rank 0 says so (short unless verbose)."""
        if relink is None:
            return
        planner = self._planner
        was = planner.link
        planner.relink(relink.link)
        if _hvd.rank() == 0:
            print(relinked_words(step, relink.link, was, relink.before, relink.after,
                                 planner, self._progress.density()), flush=True)

    def _average_variance(self, tensors):
        """Adam's refresh (adam.py): the ranks' second moments averaged in place, one
        dense exchange, counted in the bytes sent."""
        if tensors and self.process_set.size() > 1:
            _average_in_place(tensors, "hvd_dgc.adam_refresh", self.process_set)
        self._progress.stats.add_bytes(REFRESH,
                                       sum(t.numel() * t.element_size() for t in tensors))

    def _horovod_config(self):
        """Horovod's arguments, as every rank must have them alike."""
        return {"op": repr(self.op), "backward_passes_per_step": self.backward_passes_per_step,
                "gradient_predivide_factor": self.gradient_predivide_factor,
                "fusion_threshold": fusion_threshold(self._config.fusion_threshold)}

    def _announce(self):
        """Rank 0 only: what hvd_dgc does here in one line (the full plan with
        ``verbose``), and each warning once (hvd_dgc/plan_words.py ``PlanWords.announce``)."""
        PlanWords(self._planner).announce("torch", self._delayed.describe_delay(),
                               self._delayed.period, self._progress.density())

    # -- launches at this step's place ---------------------------------------------------
    def _step_place(self):
        """This step's place (exchange.py ``StepPlace``: its step, density, loss scale,
        whether it exchanges), made once, at its first launch: what the scheduler and
        the exchange decide by. An elastic reset's new world is planned for first."""
        if self._place is None:
            step = self._progress.step
            world = self.process_set.size()
            if world != self._planner.world_size:
                self._planner.replan(world)
            self._guard.begin(self._delayed.keeps_own)
            scale = _loss_scale(self._grad_scaler) if self._guard.scaling() else None
            self._place = StepPlace(step, self._progress.density(), _hvd.rank(),
                                    self._delayed.exchanges_now(step),
                                    self._delayed.keeps_own, scale,
                                    self._delayed.name_suffix(step))
        return self._place

    def _launch(self, params, place):
        """The exchange's launch of ``params`` at ``place``: its ``Launch``es."""
        self._takeover.observe(params, place.scale, self.process_set.size())
        name = "hvd_dgc." + self._exchange.members[params[0]].name
        return self._exchange.launch(params, place, name)

    # -- Horovod's optimizer API ---------------------------------------------------------
    def synchronize(self, flush=False):
        """Launch what has not been launched, wait for what is due, fill ``p.grad``.

        With ``delay=D`` only the launches of D steps ago are due (``period=p``: those of
        the exchange D steps ago, and the p steps it covers); ``flush=True`` waits for
        all of them, so the step that follows leaves every rank with the same weights
        (end of training, before evaluation or a checkpoint). A flush between exchanges
        takes back this rank's own steps since the last one: its memory still holds
        them, and the next exchange sends them."""
        self._synchronize(flush)

    def _synchronize(self, flush=False, views=False):
        """``views``: the step itself synchronizes, so nothing touches ``p.grad`` before
        the step: the averages may become views of the exchange's buffers (update.py)."""
        self._skip_step = False
        self._views = []
        self._sparse_grads = set()
        if not self.process_set.included():
            self._synchronized = True
            return
        self._guard.begin(self._delayed.keeps_own)
        place = self._step_place()
        for members in self._scheduler.finish(place):
            self._launches += self._launch(members, place)
        launches, self._launches, self._place = self._launches, [], None
        self._exchange.advance(launches)
        step = self._progress.step
        if not self._delayed.keeps_own:
            began = time.perf_counter()
            self._collect(launches, views)
            watcher = self._watcher  # the link, from this step's wait
            if watcher is not None and not flush and \
                    watcher.observe(time.perf_counter() - began):
                self._follow_link(watcher.end_window(self._planner, self._progress.density(),
                                                     len(launches), step), step)
            if self._profiler is not None and not flush:  # the backward pass's overlap
                self._profiler.end_step(step, self._progress.density())
        else:
            started = time.perf_counter()
            sizes = self._takeover.step_sizes()  # (what this step applies its own at)
            self._delayed.push(step, launches, sizes)
            grads = self._delayed.gradients(self._exchange, launches,
                                            self._delayed.due(step, flush), sizes)
            if not flush:
                self._delayed.tune(step, started, time.perf_counter() - started)
            params = list(grads)
            torch._foreach_copy_([p.grad for p in params],
                                 [self._exchange.members[p].shaped(g)
                                  for p, g in zip(params, grads.values())])
            self._average_after_step = flush
            self._guard.report_dropped(step, self._delayed.delay, self._delayed.period)
        self._report_fp16()
        self._scheduler.restart()
        self._progress.stats.end_step()
        self._synchronized = True

    def _collect(self, launches, views):
        """Delay 0, period 1: each launch's average becomes ``p.grad``; a guarded step
        looks at every average once (one read-back) and is undone where any is not
        finite."""
        guarded, sums = self._guard.mode == "skip", []
        for launch in launches:
            out, sparse = self._exchange.collect(launch, into_grads=True, views=views)
            if isinstance(out, ViewUpdate):
                self._views.append(out)
            layout = launch.layout
            if guarded:
                named = [(m.name, avg._values()) for m, avg in sparse]
                total = out.check()
                for _, values in named:
                    total = total + values.sum()
                sums.append((total, lambda layout=layout, named=named: [
                    (layout.members[i].name, layout.members[i].param.grad)
                    for i in layout.dense_grads] + named))
            self._exchange.write(launch, out, launch.scale)
            self._sparse_grads |= self._exchange.write_sparse(sparse, launch.scale)
        if guarded:
            self._skip_step = self._guard.settle(self._exchange.memory,
                                                 self._guard.nonfinite(sums),
                                                 self._progress.step)

    def _report_fp16(self):
        """Dense fp16 values this step sent clipped (hvd_dgc/fp16wire.py): counted in the
        statistics, and a warning the first time (a skipped step's are dropped)."""
        counters, stats = self._exchange.counters, self._progress.stats
        counts, counters.fp16_clipped = counters.fp16_clipped, []
        if not counts or self._skip_step:
            return
        count = int(torch.stack([c.to(counts[0].device) for c in counts]).sum())  # one read
        if not count:
            return
        if not stats.fp16_clipped:
            bound = self._wire.fp16_bound()
            warnings.warn(clip_warning("torch", self._progress.step, count, bound)
                          + " Later ones are counted in compression_stats()['fp16_clipped'].",
                          RuntimeWarning)
        stats.add_fp16_clipped(count)

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
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(). This can cause training "
                              "slowdown. You may want to consider using "
                              "optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.")
            self._synchronize(views=True)
        self._synchronized = False
        if self._skip_step:  # a non-finite average: every rank skips (guard.py)
            self._skip_step = False
            return None
        sparse, self._sparse_grads = self._sparse_grads, set()
        views, self._views = self._views, []
        loss = self._takeover.step(super(self.__class__, self).step, closure, sparse, views)
        if self._average_after_step:
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
        self._average_after_step = False
        params = self._scheduler.params
        if params and self.process_set.size() > 1:
            _average_in_place([p.data for p in params], "hvd_dgc.flush", self.process_set)

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
        self._fresh_step()
        self._exchange.memory.commit()  # a step cut short has nothing to undo
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
            self._measure(HorovodCollectives(self.process_set),
                          [p for p in self._param_index if p.requires_grad])
            line = PlanWords(self._planner).sync_line(self.process_set.size())
            if _hvd.rank() == 0 and line:  # (short; the full story with verbose)
                print(line, flush=True)


# -- wrap time -----------------------------------------------------------------------------
def _loss_scale(grad_scaler):
    """The GradScaler's scale as a tensor: ``get_scale()`` reads it back from the device,
    which would wait for the device. A copy, as ``update()`` changes it in place."""
    read = getattr(grad_scaler, "_get_scale_async", None)
    scale = read() if read is not None else None
    return grad_scaler.get_scale() if scale is None else scale.detach().clone()


def _link_watcher(config, resolved, planner, process_set):
    """The link watch (hvd_dgc/linkwatch.py) where it can act: the link was measured (a
    multi-rank set, not elastic, where each sync measures it), DGC may choose its paths,
    and each step waits for its own averages (delay and period change what a wait means;
    ``delay="auto"`` answers a slower link with a longer delay instead)."""
    watch = as_link_watch(config.link_watch)
    if watch is None or not process_set.included():
        return None
    idle = link_watch_idle(config, planner.link is not None, resolved.sparse,
                           os.environ.get("HOROVOD_ELASTIC") == "1")
    if idle:
        if config.link_watch is not None:  # the script asked for it: say why not (rank 0)
            rank0_once(idle, UserWarning, key="hvd_dgc.link_watch_idle")
        return None
    watcher = LinkWatcher(watch, HorovodCollectives(process_set), in_flight=True)
    # a job that ends at a window's end leaves its agreement in flight (at_exit.py)
    settle_at_exit(watcher, LinkWatcher.settle)
    return watcher


def _backward_profiler(config, resolved, planner, process_set, scheduler, takeover):
    """The backward pass profiled and the plans tried (hvd_dgc/overlap.py; ``timeline``)
    where the paths may follow it: the measured cost model (a ``cost_model`` the script
    passes keeps its own weighing), the link measured (several ranks, not elastic), DGC
    choosing among several flat paths, and each step waiting for its own averages (with
    ``delay`` and ``period`` a transfer hides behind whole steps). An Adam take-over's
    trial waits for its freeze, and one that is declined (exact Adam: every tensor dense)
    is not profiled."""
    if config.timeline is False or not planner.measure or planner.link is None or \
            not resolved.sparse or config.lagging or len(planner.flat) < 2 or \
            not process_set.included() or os.environ.get("HOROVOD_ELASTIC") == "1" or \
            getattr(takeover, "declined", False):
        return None
    at_end = set(planner.flat) if scheduler.batch_all else \
        {kind for kind in planner.flat if CLASSES[kind].batched}
    return BackwardProfiler(planner, process_set, [t.key for t in planner.tensors], at_end,
                            not_before=getattr(takeover, "freeze", 0))


def _host_peers(planner, collectives):
    """The global ranks sharing this rank's host, sorted, where hierarchical DGC may run
    (plan.py hierarchical_hosts says where); else (). One allgather at wrap time, after
    the config check (every rank gets here alike)."""
    if not hierarchical_hosts(
            planner.resolved, _hvd.local_size(), _hvd.cross_size(),
            collectives.process_set.process_set_id == global_process_set.process_set_id,
            os.environ.get("HOROVOD_ELASTIC") == "1"):
        return ()
    return host_peers(collectives, _hvd.cross_rank())


def _average_in_place(tensors, name, process_set):
    """Horovod's grouped allreduce (Average), in place. Horovod 0.28.1 takes row-major
    tensors only: one that is not (a channels_last weight, or its Adam moment) goes as a
    row-major copy, then back."""
    sent = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    _hvd.grouped_allreduce_(sent, name=name, op=Average, process_set=process_set)
    for t, s in zip(tensors, sent):
        if s is not t:
            t.copy_(s)


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

