"""One step of PyTorch's exchange, between the backward pass and the base step, and the
fields a step lives by (torch/optimizer.py keeps Horovod's API; TensorFlow's step is
tensorflow/exchange.py ``ExchangeStep``):

    hook(p) -> ready(p)             what the scheduler says leaves now, launched at this
                                    step's place (made once, at its first launch)
    synchronize(flush, views)       what has not left, launched; second rounds; then
      delay 0, period 1             each launch's average -> p.grad, the guard's verdict
                                    (one read-back), the link watch and the profiler fed
      otherwise                     this rank's own now, avg - own D steps later
                                    (torch/delayed.py)
    taken()                         what the base step needs of it: the sparse gradients
                                    and the averages that are views of the buffers
"""

import time
import warnings

import torch
import horovod.torch as _hvd

from hvd_dgc.fp16wire import clip_warning
from hvd_dgc.linkwatch import relinked_words
from hvd_dgc.torch.exchange import StepPlace
from hvd_dgc.torch.update import ViewUpdate, write_sparse

__all__ = ["ExchangeStep"]


class ExchangeStep:
    """A step's launches and averages with the optimizer's ``Parts`` (torch/parts.py)."""

    def __init__(self, parts, process_set, grad_scaler, param_index):
        self.parts = parts
        self.process_set = process_set
        self.grad_scaler = grad_scaler
        self.param_index = param_index
        self.average_after = False  # a flush's step: the weights averaged after it
        self.fresh()

    def fresh(self):
        """Nothing of a step yet: synchronized, skipped, its sparse gradients, its
        ViewUpdates (update.py, for the take-over's step), its StepPlace (made at its
        first launch) and its launches, in launch order."""
        self.synchronized = self.skip = False
        self.sparse_grads, self.views = set(), []
        self.step_place, self.launches = None, []

    def taken(self):
        """``(sparse gradients, views)`` for the base step, handed over once."""
        sparse, views = self.sparse_grads, self.views
        self.sparse_grads, self.views = set(), []
        return sparse, views

    def ready(self, p):
        """``p``'s hook, timed while the backward pass is profiled."""
        if self.parts.profiler is None:
            self._leave_now(p)
        else:
            self.parts.profiler.hook(self.param_index[p], self._leave_now, p)

    def _leave_now(self, p):
        """What the scheduler says leaves now that ``p`` is ready, launched."""
        place = self.place()
        for members in self.parts.scheduler.ready(p, place):
            self.launches += self._launch(members, place)

    def place(self):
        """This step's place (exchange.py ``StepPlace``: its step, density, loss scale,
        whether it exchanges), made once, at its first launch: what the scheduler and
        the exchange decide by. An elastic reset's new world is planned for first."""
        if self.step_place is None:
            parts = self.parts
            step, delayed = parts.progress.step, parts.delayed
            world = self.process_set.size()
            if world != parts.planner.world_size:
                parts.planner.replan(world)
            parts.guard.begin(delayed.keeps_own)
            scale = _loss_scale(self.grad_scaler) if parts.guard.scaling() else None
            self.step_place = StepPlace(step, parts.progress.density(), _hvd.rank(),
                                        delayed.exchanges_now(step), delayed.keeps_own,
                                        scale, delayed.name_suffix(step))
        return self.step_place

    def _launch(self, params, place):
        """The exchange's launch of ``params`` at ``place``: its ``Launch``es."""
        self.parts.takeover.observe(params, place.scale, self.process_set.size())
        name = "hvd_dgc." + self.parts.exchange.members[params[0]].name
        return self.parts.exchange.launch(params, place, name)

    def synchronize(self, flush=False, views=False):
        """Launch what has not been launched, wait for what is due, fill ``p.grad``.
        ``views``: the step itself synchronizes, so nothing touches ``p.grad`` before
        the step: the averages may become views of the exchange's buffers (update.py)."""
        self.skip = False
        self.views, self.sparse_grads = [], set()
        if not self.process_set.included():
            self.synchronized = True
            return
        parts = self.parts
        parts.guard.begin(parts.delayed.keeps_own)
        place = self.place()
        for members in parts.scheduler.finish(place):
            self.launches += self._launch(members, place)
        launches, self.launches, self.step_place = self.launches, [], None
        parts.exchange.advance(launches)
        if not parts.delayed.keeps_own:
            self._synchronous(launches, views, flush)
        else:
            self._lagging(launches, flush)
        self._report_fp16()
        parts.scheduler.restart()
        parts.progress.stats.end_step()
        self.synchronized = True

    def _synchronous(self, launches, views, flush):
        """Delay 0, period 1: the averages now; the link watch and the backward pass's
        profile fed with this step's wait (not a flush's)."""
        parts, step = self.parts, self.parts.progress.step
        began = time.perf_counter()
        self._collect(launches, views)
        watcher = parts.watcher  # the link, from this step's wait
        if watcher is not None and not flush and \
                watcher.observe(time.perf_counter() - began):
            self._follow_link(watcher.end_window(parts.planner, parts.progress.density(),
                                                 len(launches), step), step)
        if parts.profiler is not None and not flush:  # the backward pass's overlap
            parts.profiler.end_step(step, parts.progress.density())

    def _lagging(self, launches, flush):
        """Delay or period: this rank's own gradient now, each average D steps later in
        place of its own (torch/delayed.py); a flush takes everything due."""
        parts, step = self.parts, self.parts.progress.step
        delayed, exchange = parts.delayed, parts.exchange
        started = time.perf_counter()
        sizes = parts.takeover.step_sizes()  # (what this step applies its own at)
        delayed.push(step, launches, sizes)
        grads = delayed.gradients(exchange, launches, delayed.due(step, flush), sizes)
        if not flush:
            delayed.tune(step, started, time.perf_counter() - started)
        params = list(grads)
        torch._foreach_copy_([p.grad for p in params],
                             [exchange.members[p].shaped(g)
                              for p, g in zip(params, grads.values())])
        self.average_after = flush
        parts.guard.report_dropped(step, delayed.delay, delayed.period)

    def _collect(self, launches, views):
        """Each launch's average becomes ``p.grad``; a guarded step looks at every average
        once (one read-back) and is undone where any is not finite."""
        exchange, guard = self.parts.exchange, self.parts.guard
        guarded, sums = guard.mode == "skip", []
        for launch in launches:
            out, sparse = exchange.collect(launch, into_grads=True, views=views)
            if isinstance(out, ViewUpdate):
                self.views.append(out)
            layout = launch.layout
            if guarded:
                named = [(m.name, avg._values()) for m, avg in sparse]
                total = out.check()
                for _, values in named:
                    total = total + values.sum()
                sums.append((total, lambda layout=layout, named=named: [
                    (layout.members[i].name, layout.members[i].param.grad)
                    for i in layout.dense_grads] + named))
            exchange.write(launch, out, launch.scale)
            self.sparse_grads |= write_sparse(sparse, launch.scale)
        if guarded:
            self.skip = guard.settle(exchange.memory, guard.nonfinite(sums),
                                     self.parts.progress.step)

    def _report_fp16(self):
        """Dense fp16 values this step sent clipped (hvd_dgc/fp16wire.py): counted in the
        statistics, and a warning the first time (a skipped step's are dropped)."""
        counters, stats = self.parts.exchange.counters, self.parts.progress.stats
        counts, counters.fp16_clipped = counters.fp16_clipped, []
        if not counts or self.skip:
            return
        count = int(torch.stack([c.to(counts[0].device) for c in counts]).sum())  # one read
        if not count:
            return
        if not stats.fp16_clipped:
            bound = self.parts.wire.fp16_bound()
            warnings.warn(clip_warning("torch", self.parts.progress.step, count, bound)
                          + " Later ones are counted in compression_stats()['fp16_clipped'].",
                          RuntimeWarning)
        stats.add_fp16_clipped(count)

    def _follow_link(self, relink, step):
        """Where the link watch found a new link (linkwatch.py ``Relink``): every
        tensor's path chosen afresh for it, and rank 0 says so (short unless verbose)."""
        if relink is None:
            return
        planner = self.parts.planner
        was = planner.link
        planner.relink(relink.link)
        if _hvd.rank() == 0:
            print(relinked_words(step, relink.link, was, relink.before, relink.after,
                                 planner, self.parts.progress.density()), flush=True)


def _loss_scale(grad_scaler):
    """The GradScaler's scale as a tensor: ``get_scale()`` reads it back from the device,
    which would wait for the device. A copy, as ``update()`` changes it in place."""
    read = getattr(grad_scaler, "_get_scale_async", None)
    scale = read() if read is not None else None
    return grad_scaler.get_scale() if scale is None else scale.detach().clone()
