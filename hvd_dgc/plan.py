"""The planner: which way each tensor travels at each step, decided once for both
frameworks.

Every rank must join the same collectives in the same order, or Horovod waits forever.
So every decision here depends only on what every rank knows alike: the options
(``DGCConfig.resolve``), the tensors' names and sizes, the world size and the step's
density. The PyTorch optimizer asks per step (its density may be any callable); the
TensorFlow exchange asks per density stage when it builds its graph.

    planner = Planner(resolved, tensors, world_size)
    planner.path(tensor, density, step)     PathKind: cost model, hierarchical, exchange
    planner.stage_paths(tensor)             TensorFlow: a PathKind per density stage
    planner.buckets(density, order)         PyTorch: which tensors leave together
    planner.adam_freeze(lagging)            where Adam's take-over starts (adam.py)

What each path costs is ``planner.prices``' (hvd_dgc/prices.py), made afresh when the
world or the link moves; the step's timeline is overlap.py's ``Timeline``; what rank 0
says of the plan is hvd_dgc/plan_words.py's (``PlanWords(planner)``); what every rank
compares at wrap time is hvd_dgc/consistency.py's (``optimizer_consistency(planner)``).
"""

import dataclasses
from typing import NamedTuple

from hvd_dgc.adam import AdamPlan, plan_take_over, settle
from hvd_dgc.costmodel import CostModel
from hvd_dgc.fusion import fusion_threshold
from hvd_dgc.overlap import Timeline
from hvd_dgc.paths import PathKind
from hvd_dgc.prices import Prices
from hvd_dgc.schedule import num_selected
from hvd_dgc.seam import host_peers

__all__ = ["Planner", "TensorInfo", "hierarchical_hosts", "stage_densities"]


def stage_densities(schedule):
    """The densities a TensorFlow step can have: the warm-up stages', then the final one
    (a graph looks k and the path up by the stage's index). A function, as a step's
    density is asked for before the tensors are known."""
    warm = tuple(schedule.warmup_densities) if getattr(schedule, "warmup", 0) > 0 else ()
    return warm + (schedule.density,)


def hierarchical_hosts(resolved, local_size, cross_size, global_set, elastic, unsupported=None):
    """Whether hierarchical DGC may run here with the ``resolved`` options (then every
    rank looks up who shares its host): several hosts of several ranks, the global
    process set, not elastic, not with ``period``, and not where the framework says it
    cannot yet (``unsupported``: why, in words). Forced (``aggregation="hierarchical"``)
    where it cannot: refused, saying why."""
    aggregations = resolved.aggregations
    if PathKind.HIERARCHICAL not in aggregations or not resolved.sparse:
        return False
    problem = None
    if not (local_size > 1 and cross_size > 1):
        problem = (f"it needs several hosts of several ranks each, and this job has "
                   f"{cross_size} host(s) with local_size={local_size} (horovodrun -H "
                   f"host1:4,host2:4)")
    elif not global_set:
        problem = "it runs on the global process set only"
    elif elastic:  # a collective at wrap time would hang
        problem = "it does not run under elastic Horovod yet"
    elif resolved.config.period > 1:  # its memory holds the host's sum: no own step back
        problem = f"it does not run with period={resolved.config.period} (use period=1)"
    elif unsupported:
        problem = unsupported
    if problem and aggregations == (PathKind.HIERARCHICAL,):
        raise ValueError(f"aggregation='hierarchical': {problem}. Use aggregation='auto' "
                         f"(hierarchical where it applies) or 'flat'.")
    return problem is None


def hierarchical_peers(resolved, collectives, horovod, elastic, unsupported=None):
    """The global ranks sharing this rank's host, sorted, where hierarchical DGC may run
    (``hierarchical_hosts``; ``horovod``: the framework's Horovod module, for its host
    counts); else (). One allgather at wrap time, after the config check (every rank
    of the process set gets here alike)."""
    global_set = collectives.process_set.process_set_id == \
        horovod.global_process_set.process_set_id
    if not hierarchical_hosts(resolved, horovod.local_size(), horovod.cross_size(),
                              global_set, elastic, unsupported):
        return ()
    return host_peers(collectives, horovod.cross_rank())


class TensorInfo(NamedTuple):
    """What the planner knows of one tensor (the same on every rank)."""

    key: object      # the framework's key for it (parameter or variable index)
    name: str
    numel: int
    shape: tuple
    sliced: bool = False  # its gradient is sparse and travels as Horovod sends it


class ExchangeGroup:
    """EXCHANGE or DENSE for each large tensor a compressor of its own collectives takes:
    a payload allgathered from every rank (sign, QSGD, bf16) grows with the world and is
    priced against the dense allreduce (costmodel.choose_exchange), the sign's compressed
    allreduce as the group a step sends together (prices.py ``sign_group``); PowerSGD's
    and TernGrad's allreduces are not. A tensor that turns dense loses nothing: the dense
    path sends the memory whole, what the compressor had left in it too. Made afresh
    with the prices (``Planner.replan``)."""

    def __init__(self, kind, large, prices):
        self.kind, self.large, self.prices = kind, large, prices
        self._keys = None  # (one price for every tensor the compressor takes, when asked)

    def path(self, tensor):
        if self._keys is None:
            self._keys = frozenset(self.large[i].key for i in self.prices.sign_group(
                [t.numel for t in self.large]))
        return PathKind.EXCHANGE if tensor.key in self._keys else PathKind.DENSE

    def dense(self):
        """The large tensors the compressor leaves dense because its collectives would
        cost more (none where the compressor is not one of its own collectives)."""
        if self.kind != "exchange":
            return []
        return [t for t in self.large if self.path(t) == PathKind.DENSE]

    def idle(self):
        """Does the compressor leave every large tensor dense?"""
        dense = self.dense()
        return bool(dense) and len(dense) == len(self.large)


class Planner:
    """Paths, buckets and the wrap-time words for one optimizer's tensors.

    ``resolved``: ``hvd_dgc.resolve.Resolved``; ``tensors``: ``TensorInfo``s;
    ``world_size`` and ``local_size`` (ranks sharing this rank's host, where
    hierarchical DGC may run; 0 where it may not) change with an elastic reset
    (``replan``)."""

    def __init__(self, resolved, tensors, world_size, local_size=0):
        self.resolved = resolved
        self.config = resolved.config
        self.compressor = resolved.compressor
        # "measure" (the default): CostModel()'s numbers until the wrapper's probe
        # (linkprobe.py) gives the link
        self.measure = resolved.cost_model == "measure"
        self.cost_model = resolved.cost_model if isinstance(resolved.cost_model, CostModel) \
            else CostModel()
        self.link = self.local = None  # LinkMeasurement and LocalCost, once measured
        self.unmeasured = ""  # why the link was not measured where it was to be, in words
        self.adam = AdamPlan()  # where Adam's take-over starts (adam_freeze)
        self.generation = 0  # how many times the paths' basis moved while training (a
        #                      probe's new model, the timeline's plan on or off)
        self.timeline = None  # overlap.py's Timeline, once the backward pass is measured
        self.on_timeline = False  # paths from the step's timeline rather than the sums
        self.forced_dense = frozenset()  # densities at which a trial of the step's own
        #                                  time sends every flat tensor dense (Keras:
        #                                  hvd_dgc/tensorflow/plan_trial.py)
        self.tensors = list(tensors)
        self.min_compress_size = self.config.min_compress_size
        self.flat = tuple(a for a in resolved.aggregations if a != PathKind.HIERARCHICAL) \
            or (PathKind.DENSE,)
        self.replan(world_size, local_size)

    def exclude(self, kind):
        """Plan without the aggregation ``kind`` (a step traced once for every world
        size cannot take region reduce, whose regions are the world's ranks)."""
        self.flat = tuple(a for a in self.flat if a != kind) or (PathKind.DENSE,)
        self.replan(self.world_size)

    def measured(self, link, local=None):
        """The probe's ``LinkMeasurement`` and DGC's ``LocalCost`` on this device (both
        the same on every rank; either may be None) become the cost model; every choice
        is made afresh."""
        if link is not None:
            self.link = link
        if local is not None:
            self.local = local
        self.cost_model = self.priced(link)
        self.replan(self.world_size)

    def priced(self, link):
        """The cost model ``measured(link)`` would make (this device's ``local`` kept);
        ``link`` None: the one in use."""
        model = self.cost_model if link is None else link.cost_model(self.cost_model)
        if self.local is not None:
            model = dataclasses.replace(model, **self.local._asdict())
        return model

    def relink(self, link):
        """A probe during training (linkwatch.py) measured ``link``: the cost model moves to
        it and every flat tensor's path is chosen afresh; a hierarchical tensor stays
        (its residual lives in slices across its host's ranks)."""
        kept = self._hierarchical
        self.measured(link)
        self._hierarchical = kept
        self.forced_dense = frozenset()  # a trial's verdict held on the old link's numbers
        self.generation += 1

    def force_dense(self, density, on):
        """Every flat tensor dense at ``density`` (a trial's dense plan, or its verdict),
        or (``on`` False) the sums' plan there again. The buckets follow; the plan's
        generation moves (the link watch's baseline starts afresh)."""
        now = self.forced_dense | {density} if on else self.forced_dense - {density}
        if now != self.forced_dense:
            self.forced_dense = frozenset(now)
            self._buckets = {}
            self.generation += 1

    def overlapped(self, profile, at_end=()):
        """The agreed ``BackwardProfile`` (overlap.py) and the paths the framework launches
        at synchronize (``at_end``): ``timeline`` can place each step from now on;
        ``use_timeline`` says whether the paths follow it."""
        self.timeline = Timeline(profile, at_end)

    def use_timeline(self, on):
        """Each flat tensor's path from the step's timeline (``timeline.plan``: a transfer
        the backward pass hides costs nothing), or from the cost model's sums weighed by
        its ``dense_preference`` (the default). The buckets follow; the plan's generation
        moves (the link watch's baseline starts afresh)."""
        on = bool(on) and self.timeline is not None
        if on != self.on_timeline:
            self.on_timeline = on
            self._buckets = {}
            self.generation += 1

    def allowed(self, tensor, density):
        """The paths ``tensor`` may take at ``density``: dense alone where it is small, the
        compressor is dense or it would send everything; hierarchical alone where it
        runs hierarchical; else the step's flat paths (``flat_at``)."""
        if not self.large(tensor) or not self.resolved.sparse or \
                self.k(tensor, density) >= tensor.numel and PathKind.DENSE in self.flat:
            return (PathKind.DENSE,)
        if self.hierarchical(tensor):
            return (PathKind.HIERARCHICAL,)
        return self.flat_at(density)

    def exchange_seconds(self, density, launches, model=None, step=None):
        """The step's exchange on the paths it takes now at ``density``, priced by
        ``model`` (the one in use by default): each tensor's transfer, and the latency
        of ``launches`` Horovod operations. Hierarchical tensors count their records'
        transfer between hosts only."""
        prices = self.prices if model is None else self._prices(model)
        seconds = launches * prices.cost_model.launch_seconds(PathKind.DENSE, self.world_size)
        for t in self.tensors:
            seconds += prices.wire_seconds(t.numel, self.k(t, density), self.path(t, density, step))
        return seconds

    def replan(self, world_size, local_size=None):
        """Plan for another world (an elastic reset): every choice is made afresh."""
        self.world_size = int(world_size)
        if local_size is not None:
            self.local_size = int(local_size)
        self.prices = self._prices(self.cost_model)
        self._paths = {}         # (numel, k, allowed) -> PathKind, the cost model's choice
        self._flat = {}          # density -> the flat paths the step allows (flat_at)
        self._hierarchical = {}  # numel -> bool, decided once per tensor
        # what a compressor of its own collectives takes, priced by these prices
        self.exchanged = ExchangeGroup(self.resolved.kind,
                                       [t for t in self.tensors if self.large(t)], self.prices)
        self._buckets = {}       # the latest (density, world) -> {key: bucket}
        if self.timeline is not None:
            self.timeline = self.timeline.afresh()

    def _prices(self, model):
        """``Prices`` by ``model`` on this world, dense values in fp16 or fp32."""
        return Prices(model, self.compressor, self.world_size, self.local_size,
                      2 if self.resolved.dense_fp16 else 4)

    # -- per tensor ----------------------------------------------------------------
    def k(self, tensor, density):
        """Records a sparse path sends of ``tensor`` at ``density``."""
        return num_selected(tensor.numel, density)

    def large(self, tensor):
        """Large enough for the compressor (smaller tensors always go dense)."""
        return tensor.numel >= self.min_compress_size and not tensor.sliced

    def path(self, tensor, density, step=None):
        """The way ``tensor`` travels at ``density`` (and ``step``: a compressor may start
        late, as PowerSGD's ``start_iter``)."""
        if tensor.sliced:
            return PathKind.SPARSE_GRAD
        r = self.resolved
        if not self.large(tensor) or r.kind == "dense":
            return PathKind.DENSE
        if r.kind == "exchange":
            if self.exact_adam(step) or not self.compressor.compressible(tensor.shape, step):
                return PathKind.DENSE
            return self.exchanged.path(tensor)
        if self.adam.declined or density in self.adam.dense:  # exact Adam: adam_freeze
            return PathKind.DENSE
        if self.hierarchical(tensor):
            return PathKind.HIERARCHICAL
        if density in self.forced_dense and PathKind.DENSE in self.flat:
            return PathKind.DENSE
        if self.on_timeline:
            return self.timeline.plan(self, density).paths[tensor.key]
        return self.summed_path(tensor, density)

    def summed_path(self, tensor, density):
        """A flat tensor's path by the cost model's sums (``choose_aggregation``, with its
        ``dense_preference``)."""
        k = num_selected(tensor.numel, density)
        allowed = self.flat_at(density)
        key = (tensor.numel, k, allowed)  # (the same k at another density: maybe another
        chosen = self._paths.get(key)     # step's choice, whatever was asked first)
        if chosen is None:
            chosen = self._paths[key] = self.prices.choose(tensor.numel, k, allowed)
        return chosen

    def flat_at(self, density):
        """The flat paths a tensor may take at ``density``: ``flat``, less the one of
        ALLGATHER and REGION under which the whole step costs more (``step_seconds``)
        where both are allowed. Chosen for the step, not tensor by tensor: a launch's
        latency is paid once for all it carries, and PyTorch's region reduce carries a
        step's tensors in one launch (``Framework.batched``), so at a thousand ranks it
        costs a step two rounds of latency where the allgather's buckets cost one each,
        and moves 3k records where the allgather moves k(N-1)."""
        both = (PathKind.ALLGATHER, PathKind.REGION)
        if not all(kind in self.flat for kind in both):
            return self.flat
        flat = self._flat.get(density)
        if flat is None:
            costs = [self.step_seconds(density, kind) for kind in both]
            dropped = both[1] if costs[0] <= costs[1] else both[0]  # equal: allgather
            if len(self._flat) >= 64:  # a callable schedule's densities: the latest only
                self._flat.clear()
            flat = self._flat[density] = tuple(a for a in self.flat if a != dropped)
        return flat

    def step_seconds(self, density, kind):
        """The step's flat exchange at ``density`` were its sparse path ``kind``: each
        large flat tensor dense or ``kind``, as the cost model chooses for it alone,
        ``kind``'s latency once per launch, and the small tensors (dense; in the
        allgather's buckets where they fold) (prices.py ``step_seconds``)."""
        tensors = [(t.key, t.numel, self.k(t, density)) for t in self.tensors]
        flat = {t.key for t in self.tensors if self.large(t) and not self.hierarchical(t)}
        small = sum(t.numel for t in self.tensors if not self.large(t))
        allowed = tuple(a for a in self.flat if a in (PathKind.DENSE, kind))
        return self.prices.step_seconds(tensors, flat, kind, allowed,
                                        kind in self.resolved.batched,
                                        fusion_threshold(self.config.fusion_threshold), small)

    def hierarchical(self, tensor):
        """Hierarchical DGC keeps a host's residual in slices across its ranks, flat DGC
        each rank's whole residual: a tensor cannot move between them, so the choice is
        made once per tensor, by the cost model at the final density."""
        aggregations = self.resolved.aggregations
        if not self.local_size or PathKind.HIERARCHICAL not in aggregations:
            return False
        if aggregations == (PathKind.HIERARCHICAL,):
            return True
        final = self.resolved.final_density()
        if final is None:  # a callable schedule: stay flat
            return False
        decided = self._hierarchical.get(tensor.numel)
        if decided is None:
            decided = self._hierarchical[tensor.numel] = self.prices.choose(
                tensor.numel, num_selected(tensor.numel, final), aggregations) == \
                PathKind.HIERARCHICAL
        return decided

    def densities(self):
        """The densities a TensorFlow step can have (``stage_densities``)."""
        return stage_densities(self.resolved.schedule)

    def stage_paths(self, tensor):
        """``tensor``'s path at each of ``densities()``."""
        paths = tuple(self.path(tensor, d) for d in self.densities())
        if self.exact_adam(0):  # stage 0: exact Adam, before the freeze
            paths = (PathKind.DENSE,) + paths[1:]
        return paths

    def exact_adam(self, step):
        """Is ``step`` (None: unknown) before the freeze of an Adam taken over with a
        compressor of its own collectives? Exact Adam needs dense averages there; a
        sparse compressor's schedule says density 1 instead."""
        r = self.resolved
        return r.kind == "exchange" and r.freeze is not None and step is not None and \
            step < r.freeze

    # -- launches (PyTorch) ----------------------------------------------------------
    def buckets(self, density, order, threshold):
        """``{key: bucket}``: which tensors leave together, as tuples of keys.

        Horovod's tensor fusion at hvd_dgc's level: consecutive tensors of ``order``
        (backward order, roughly), cut where their bytes on the wire would pass
        ``threshold``, and closed by the member whose transfer brings the bucket's past
        BUCKET_LATENCIES latencies. Only tensors going dense or by allgather join:
        region reduce and hierarchical DGC have rounds of their own. Fixed from what
        every rank knows, so the buckets are the same on every rank."""
        if threshold <= 0 or not self.resolved.sparse:
            return {}
        key = (density, self.world_size, id(order), threshold)  # order: the caller's, kept
        plan = self._buckets.get(key)
        if plan is not None:
            return plan
        buckets = self.prices.launches(
            [(t.key, t.numel, self.k(t, density), self.path(t, density)) for t in order],
            threshold)
        plan = {k: bucket for bucket in buckets if len(bucket) > 1 for k in bucket}
        self._buckets = {key: plan}  # the latest only: a callable schedule may change often
        return plan

    def adam_freeze(self, lagging):
        """The step at which Adam/AdamW's take-over freezes its variance on this link
        (adam.py ``plan_take_over``; None: declined), kept in ``adam``."""
        self.adam = plan_take_over(self, lagging)
        return self.adam.freeze

    def settled(self):
        """The resolved options to build the step from, once ``adam_freeze`` has decided
        (adam.py ``settle``)."""
        self.resolved = settle(self.resolved, self.adam)
        self.config = self.resolved.config
        return self.resolved
