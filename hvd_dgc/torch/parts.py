"""The parts of PyTorch's DistributedOptimizer, assembled at wrap time.

torch/optimizer.py keeps Horovod's API; what does the work is built here, once, in
this order (TensorFlow's set-up, which waits for the first step, is
tensorflow/exchange.py ``ExchangeSetUp``):

    Progress, ScriptCalls          the step and epoch, the statistics, the calls the
                                   script owes (set_epoch)
    take-over                      what of the wrapped optimizer's update the memory
                                   applies (sgd.py, adam.py)
    Planner, agreed                every rank's configuration compared, the hosts'
                                   ranks, the link and DGC's own work measured, Adam's
                                   freeze (hvd_dgc/plan.py, linkprobe.py)
    DelayedAveraging, LinkWatcher  delay and period; the link watched while training
    GradientExchange, LaunchScheduler, BackwardProfiler
                                   the launches' work, which tensors leave together,
                                   the backward pass's overlap

``Parts`` holds them, grouped as powerSGD's state is; torch/step.py runs a step with
them.
"""

import os
from typing import Any, NamedTuple

import torch
import horovod.torch as _hvd
from horovod.torch.mpi_ops import Average

from hvd_dgc.consistency import check_consistent, optimizer_consistency
from hvd_dgc.fusion import fusion_threshold
from hvd_dgc.linkprobe import probe_world
from hvd_dgc.linkwatch import LinkWatcher, as_link_watch, link_watch_idle
from hvd_dgc.plan import Planner, hierarchical_peers
from hvd_dgc.plan_words import PlanWords
from hvd_dgc.say import rank0_once
from hvd_dgc.script_calls import ScriptCalls
from hvd_dgc.stats import REFRESH
from hvd_dgc.torch.adam import AdamTakeOver
from hvd_dgc.torch.at_exit import settle_at_exit
from hvd_dgc.torch.compression import on_accelerator
from hvd_dgc.torch.delayed import DelayedAveraging
from hvd_dgc.torch.exchange import GradientExchange, Member, memory_order
from hvd_dgc.torch.guard import NonFiniteGuard
from hvd_dgc.torch import link as timing
from hvd_dgc.torch.paths import CLASSES, Wire
from hvd_dgc.torch.plan_trial import BackwardProfiler
from hvd_dgc.torch.scheduler import LaunchScheduler
from hvd_dgc.torch.seam import HorovodCollectives
from hvd_dgc.torch.sgd import SGDTakeOver
from hvd_dgc.torch.statistics import Progress

__all__ = ["Parts", "Wrapped", "assemble", "measure", "average_in_place"]

_EPOCH_FIX = ("Call optimizer.set_epoch(epoch) at the start of each epoch (as "
              "DistributedSampler.set_epoch)")


class Wrapped(NamedTuple):
    """What the wrapper was given: Horovod's arguments, the options resolved, and the
    parameters as the optimizer numbers and names them."""

    optimizer: Any           # the DistributedOptimizer being built (its take-over's owner)
    op: Any
    gradient_predivide_factor: float
    backward_passes_per_step: int
    groups: Any
    sparse_as_dense: bool
    process_set: Any
    resolved: Any            # hvd_dgc.resolve.Resolved
    grad_scaler: Any
    param_index: dict        # parameter -> its index among the param groups'
    infos: dict              # parameter -> TensorInfo


class Parts(NamedTuple):
    """The optimizer's parts, each owning its state."""

    resolved: Any            # settled: 0/1 Adam's default period dropped where declined
    progress: Progress
    calls: ScriptCalls
    takeover: Any            # SGDTakeOver or AdamTakeOver
    guard: NonFiniteGuard
    planner: Planner
    delayed: DelayedAveraging
    watcher: Any             # LinkWatcher or None
    wire: Wire
    exchange: GradientExchange
    scheduler: LaunchScheduler
    profiler: Any            # BackwardProfiler or None


def assemble(w):
    """The ``Parts`` for ``w`` (a ``Wrapped``); the collectives of the agreement run here,
    on every rank of the process set alike."""
    resolved, process_set, config = w.resolved, w.process_set, w.resolved.config
    every = list(w.param_index)
    trainable = [p for p in every if p.requires_grad]
    progress = Progress(resolved.schedule, resolved.sparse, config.log_every,
                        config.min_compress_size)
    calls = ScriptCalls(resolved.schedule, _EPOCH_FIX)
    exchange = None  # (made below; the take-over's callbacks reach it once it is)

    def average_variance(tensors):
        """Adam's refresh (adam.py): the ranks' second moments averaged in place, one
        dense exchange, counted in the bytes sent."""
        if tensors and process_set.size() > 1:
            average_in_place(tensors, "hvd_dgc.adam_refresh", process_set)
        progress.stats.add_bytes(REFRESH, sum(t.numel() * t.element_size() for t in tensors))

    if process_set.included() and resolved.freeze is not None:
        takeover = AdamTakeOver(w.optimizer, resolved.freeze, lambda: progress.step,
                                lambda p, u: exchange.seed_velocity(p, u), resolved.refresh,
                                lambda p, ratio: exchange.rescale(p, ratio),
                                average_variance)
    else:
        takeover = SGDTakeOver(w.optimizer, isinstance(w.optimizer, torch.optim.SGD)
                               and process_set.included(),
                               plain=type(w.optimizer).__bases__[0].step is torch.optim.SGD.step)
    guard = NonFiniteGuard(config.skip_nonfinite, w.grad_scaler, resolved.compressor,
                           _hvd.rank())
    planner = Planner(resolved, [w.infos[p] for p in trainable], process_set.size())
    progress.stage_line = PlanWords(planner).stage_line  # a new stage's paths, said
    peers = _agree(w, planner, takeover, trainable) if process_set.included() else ()
    resolved = planner.settled()  # 0/1 Adam's default period dropped where declined
    config = resolved.config
    delayed = DelayedAveraging(config, process_set, resolved.freeze or 0,
                               lambda: progress.step)
    wire = Wire(process_set, w.op, w.gradient_predivide_factor, peers)
    members = {p: Member(p, w.infos[p].key, w.infos[p].name, w.infos[p], order=memory_order(p))
               for p in every}
    exchange = GradientExchange(resolved, planner, wire, progress.stats, guard, members,
                                takeover.hyper, takeover.scale, w.sparse_as_dense,
                                process_set.size)
    scheduler = LaunchScheduler(trainable, w.param_index, w.infos, w.groups,
                                w.backward_passes_per_step, planner,
                                fusion_threshold(config.fusion_threshold), on_accelerator,
                                w.sparse_as_dense)
    return Parts(resolved, progress, calls, takeover, guard, planner, delayed,
                 _link_watcher(resolved, planner, process_set), wire, exchange, scheduler,
                 _backward_profiler(resolved, planner, process_set, scheduler, takeover))


def _agree(w, planner, takeover, trainable):
    """With the other ranks: the same configuration, the hosts' ranks (hierarchical
    DGC), the link and DGC's own work measured, Adam's freeze. Returns this host's
    ranks. Elastic: a worker added later wraps its optimizer alone while the others
    wait in a reset, so the collectives that would hang it run at each sync instead.
    All run the same script."""
    collectives = HorovodCollectives(w.process_set)
    elastic = os.environ.get("HOROVOD_ELASTIC") == "1"
    if not elastic:
        check_consistent(collectives, optimizer_consistency(
            planner, op=repr(w.op), backward_passes_per_step=w.backward_passes_per_step,
            gradient_predivide_factor=w.gradient_predivide_factor,
            fusion_threshold=fusion_threshold(w.resolved.config.fusion_threshold)),
            "DistributedOptimizer")
    peers = hierarchical_peers(planner.resolved, collectives, _hvd,
                               os.environ.get("HOROVOD_ELASTIC") == "1")
    planner.replan(w.process_set.size(), local_size=len(peers))
    if not elastic:
        measure(planner, collectives, trainable, peers)
    takeover.freeze_at(planner.adam_freeze(w.resolved.chosen_lagging))
    return peers


def measure(planner, collectives, trainable, peers=()):
    """The link (inside the host too, where ``peers`` are several) and the compressor's
    own work on this device (DGC's selection, or a payload compressor's encoding and
    decoding), measured (the default cost model: hvd_dgc/linkprobe.py,
    hvd_dgc/localcost.py): every rank of the process set calls this at the same point
    (the wrapper; elastic: each sync)."""
    if not planner.measure:
        return
    device = trainable[0].device if trainable else "cpu"
    link, local = probe_world(collectives, peers, planner.resolved.compressor,
                              planner.resolved, timing, device)
    planner.measured(link, local)


def _link_watcher(resolved, planner, process_set):
    """The link watch (hvd_dgc/linkwatch.py) where it can act: the link was measured (a
    multi-rank set, not elastic, where each sync measures it), DGC may choose its paths,
    and each step waits for its own averages (delay and period change what a wait means;
    ``delay="auto"`` answers a slower link with a longer delay instead)."""
    config = resolved.config
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


def _backward_profiler(resolved, planner, process_set, scheduler, takeover):
    """The backward pass profiled and the plans tried (hvd_dgc/overlap.py; ``timeline``)
    where the paths may follow it: the measured cost model (a ``cost_model`` the script
    passes keeps its own weighing), the link measured (several ranks, not elastic), DGC
    choosing among several flat paths, and each step waiting for its own averages (with
    ``delay`` and ``period`` a transfer hides behind whole steps). An Adam take-over's
    trial waits for its freeze, and one that is declined (exact Adam: every tensor dense)
    is not profiled."""
    config = resolved.config
    if config.timeline is False or not planner.measure or planner.link is None or \
            not resolved.sparse or config.lagging or len(planner.flat) < 2 or \
            not process_set.included() or os.environ.get("HOROVOD_ELASTIC") == "1" or \
            getattr(takeover, "declined", False):
        return None
    at_end = set(planner.flat) if scheduler.batch_all else \
        {kind for kind in planner.flat if CLASSES[kind].batched}
    return BackwardProfiler(planner, process_set, [t.key for t in planner.tensors], at_end,
                            not_before=getattr(takeover, "freeze", 0))


def average_in_place(tensors, name, process_set):
    """Horovod's grouped allreduce (Average), in place. Horovod 0.28.1 takes row-major
    tensors only: one that is not (a channels_last weight, or its Adam moment) goes as a
    row-major copy, then back."""
    sent = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    _hvd.grouped_allreduce_(sent, name=name, op=Average, process_set=process_set)
    for t, s in zip(tensors, sent):
        if s is not t:
            t.copy_(s)
