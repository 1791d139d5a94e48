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
    planner.consistency(**extra)            what every rank compares at wrap time

What rank 0 says of the plan is hvd_dgc/plan_words.py's (``PlanWords(planner)``).
"""

import dataclasses
import math
import os
from typing import NamedTuple

from hvd_dgc.aggregation import allgather_bytes, dense_bytes, hierarchical_bytes, region_bytes
from hvd_dgc.costmodel import CostModel
from hvd_dgc.overlap import Candidate, choose_paths
from hvd_dgc.paths import PathKind
from hvd_dgc.packing import exchange_bytes, fold_index_bytes, gather_record_bytes, \
    gather_value_bytes, reduces_signs, sign_chunk_bytes
from hvd_dgc.schedule import DensitySchedule, num_selected

__all__ = ["Planner", "TensorInfo", "stage_densities", "fusion_threshold", "BUCKET_LATENCIES",
           "HOROVOD_FUSION_DEFAULT"]

#: A bucket closes with the member that brings its transfer past this many message
#: latencies (the cost model's alpha). A bucket saves the Horovod operations of its
#: members but one, about two round trips each (bench/results/round_trips.md: 5 for two
#: operations, 3 for one), and holds its early members back until its last is ready: so
#: what it holds back is short, and a long transfer (a large layer's weight, after its
#: bias) ends its bucket and leaves as soon as it is ready, overlapping the backward pass
#: as Horovod's do. Measured (bench/never_slower.py's wide_mlp, 2 ranks, 1 Gbit/s
#: emulated, density 0.25 with every large tensor dense): in buckets cut at 64 MiB only,
#: 39.0 and 40.8 img/s; without buckets 44.8 and 45.0; stock 44.8 and 45.8.
BUCKET_LATENCIES = 4
#: Horovod's HOROVOD_FUSION_THRESHOLD default
HOROVOD_FUSION_DEFAULT = 64 * 1024 * 1024
#: Adam is taken over (its variance frozen: plan.py ``adam_freeze``) only from a density
#: stage in which the tensors that leave sparse hold at least this share of the
#: gradient's elements. The frozen variance costs accuracy and buys only bytes: on
#: Horovod's digits example over loopback only the 1,280-weight classifier (0.8% of the
#: model) went sparse, and the take-over lost 0.5 points for no byte saved
#: (bench/results/one_line_accuracy.md). Below it every tensor goes dense, Adam exact.
ADAM_SPARSE_SHARE = 0.1


def fusion_threshold(value):
    """``fusion_threshold`` in bytes: the option (checked by DGCConfig), else Horovod's
    environment variable (``horovodrun --fusion-threshold-mb``), else Horovod's
    default."""
    if value is not None:
        return value
    raw = os.environ.get("HOROVOD_FUSION_THRESHOLD")
    if raw is None:
        return HOROVOD_FUSION_DEFAULT
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"HOROVOD_FUSION_THRESHOLD must be a number of bytes >= 0, got "
                         f"{raw!r}")
    return value


def stage_densities(schedule):
    """The densities a TensorFlow step can have: the warm-up stages', then the final one
    (a graph looks k and the path up by the stage's index). A function, as a step's
    density is asked for before the tensors are known."""
    warm = tuple(schedule.warmup_densities) if getattr(schedule, "warmup", 0) > 0 else ()
    return warm + (schedule.density,)


class TensorInfo(NamedTuple):
    """What the planner knows of one tensor (the same on every rank)."""

    key: object      # the framework's key for it (parameter or variable index)
    name: str
    numel: int
    shape: tuple
    sliced: bool = False  # its gradient is sparse and travels as Horovod sends it


class Planner:
    """Paths, buckets and the wrap-time words for one optimizer's tensors.

    ``resolved``: ``hvd_dgc.config.Resolved``; ``tensors``: ``TensorInfo``s;
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
        self.adam_frozen_at = None  # Adam's take-over: the step it freezes (adam_freeze)
        self.adam_declined = False  # Adam left exact: every tensor dense throughout
        self.adam_share = 0.0  # the largest share of the gradient a stage sends sparse
        self.adam_dense = frozenset()  # densities before the take-over's stage: there
        #                                every tensor goes dense (Adam still exact)
        self.generation = 0  # how many times the paths' basis moved while training (a
        #                      probe's new model, the timeline's plan on or off)
        self.profile = None  # the agreed BackwardProfile (overlap.py), once measured
        self.at_end = frozenset()  # paths this framework launches at synchronize
        self.timeline = False  # paths from the step's timeline rather than the sums
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

    def sums_send_sparse(self, density):
        """Does the cost model's sums' plan send some flat tensor sparse at ``density``?
        (Only then is there a dense plan to try against it; a sparse ``aggregation`` the
        script forced has none.)"""
        return self.resolved.sparse and PathKind.DENSE in self.flat and any(
            self.summed_path(t, density) != PathKind.DENSE for t in self.tensors
            if self.large(t) and not self.hierarchical(t))

    def overlapped(self, profile, at_end=()):
        """The agreed ``BackwardProfile`` (overlap.py) and the paths the framework launches
        at synchronize (``at_end``): ``overlap_plan`` can place each step on its timeline
        from now on; ``use_timeline`` says whether the paths follow it."""
        self.profile, self.at_end = profile, frozenset(at_end)
        self._overlap = {}

    def use_timeline(self, on):
        """Each flat tensor's path from the step's timeline (``overlap_plan``: a transfer
        the backward pass hides costs nothing), or from the cost model's sums weighed by
        its ``dense_preference`` (the default). The buckets follow; the plan's generation
        moves (the link watch's baseline starts afresh)."""
        on = bool(on) and self.profile is not None
        if on != self.timeline:
            self.timeline = on
            self._buckets = {}
            self.generation += 1

    def overlap_plan(self, density):
        """``overlap.OverlapPlan`` of the step at ``density``: every tensor in the order
        its gradient was ready (the profile's ``h``, largest first), small, sparse-gradient
        and hierarchical ones on their fixed path, the others choosing among the flat
        paths, priced by the cost model in use (its transfers and DGC's work, without
        ``dense_preference``)."""
        plan = self._overlap.get(density)
        if plan is not None:
            return plan
        model, world, hide = self.cost_model, self.world_size, self.profile.hide
        order, candidates = [], {}
        for tensor in sorted(self.tensors, key=lambda t: -hide.get(t.key, 0.0)):
            if tensor.sliced:
                continue
            k = self.k(tensor, density)
            if not self.large(tensor) or not self.resolved.sparse or \
                    k >= tensor.numel and PathKind.DENSE in self.flat:
                allowed = (PathKind.DENSE,)
            elif self.hierarchical(tensor):
                allowed = (PathKind.HIERARCHICAL,)
            else:
                allowed = self.flat_at(density)
            seconds = model.path_seconds(tensor.numel, k, world, self.dense_value_bytes,
                                         self.compressor.value_bytes, allowed=allowed,
                                         local_size=self.local_size,
                                         gather_record_bytes=gather_record_bytes(
                                             self.compressor, tensor.numel, k))
            order.append((tensor.key, hide.get(tensor.key, 0.0)))
            candidates[tensor.key] = [Candidate(path, comm, local, path in self.at_end)
                                      for path, (comm, local) in seconds.items()]
        plan = self._overlap[density] = choose_paths(order, candidates)
        return plan

    def exchange_seconds(self, density, launches, model=None, step=None):
        """The step's exchange on the paths it takes now at ``density``, priced by
        ``model`` (the one in use by default): each tensor's transfer, and the latency
        of ``launches`` Horovod operations. Hierarchical tensors count their records'
        transfer between hosts only."""
        model = model or self.cost_model
        seconds = launches * model.launch_seconds(PathKind.DENSE, self.world_size)
        for tensor in self.tensors:
            path = self.path(tensor, density, step)
            wire = self.wire_bytes(tensor, path, density)
            seconds += wire / (model.bandwidth if self._dense_wire(path) else
                               model.records_bandwidth)
        return seconds

    def _dense_wire(self, path):
        return path not in (PathKind.ALLGATHER, PathKind.REGION, PathKind.HIERARCHICAL) and \
            not (path == PathKind.EXCHANGE and hasattr(self.compressor, "payload_bytes"))

    def wire_bytes(self, tensor, path, density):
        """Bytes one rank receives for ``tensor`` on ``path`` at ``density`` in one
        exchange (the volumes ``exchange_seconds`` prices). Hierarchical: its records
        between hosts only; a compressor of its own collectives without a payload
        (PowerSGD, TernGrad): the dense ring's."""
        world, k = self.world_size, self.k(tensor, density)
        if path == PathKind.ALLGATHER:
            return allgather_bytes(k, world,
                                   gather_record_bytes(self.compressor, tensor.numel, k))
        if path == PathKind.REGION:
            return region_bytes(k, world, self.record_bytes)
        if path == PathKind.HIERARCHICAL:
            return hierarchical_bytes(k, world, self.local_size, self.record_bytes)
        if not self._dense_wire(path):  # a payload compressor's allgather, or the sign's
            #                              compressed allreduce
            return exchange_bytes(self.compressor, tensor.numel, world)[1]
        return dense_bytes(tensor.numel, world, self.dense_value_bytes)

    def exchange_collective(self):
        """How a payload compressor's tensors travel on this world, in words."""
        return "compressed allreduce" if reduces_signs(self.compressor, self.world_size) \
            else "allgather"

    def exchange_dense(self):
        """The large tensors a compressor of its own collectives leaves dense because its
        allgather would cost more (``exchange_path``)."""
        if self.resolved.kind != "exchange":
            return []
        return [t for t in self.tensors if self.large(t)
                and self.exchange_path(t) == PathKind.DENSE]

    def exchange_idle(self):
        """Does the compressor of its own collectives leave every large tensor dense?"""
        priced = self.exchange_dense()
        return bool(priced) and len(priced) == sum(self.large(t) for t in self.tensors)

    def replan(self, world_size, local_size=None):
        """Plan for another world (an elastic reset): every choice is made afresh."""
        self.world_size = int(world_size)
        if local_size is not None:
            self.local_size = int(local_size)
        self._paths = {}         # (numel, k, allowed) -> PathKind, the cost model's choice
        self._flat = {}          # density -> the flat paths the step allows (flat_at)
        self._hierarchical = {}  # numel -> bool, decided once per tensor
        self._buckets = {}       # the latest (density, world) -> {key: bucket}
        self._overlap = {}       # density -> OverlapPlan, once the profile is agreed

    # -- per tensor ----------------------------------------------------------------
    @property
    def dense_value_bytes(self):
        return 2 if self.resolved.dense_fp16 else 4

    @property
    def record_bytes(self):
        """A record of the region and hierarchical paths: an int32 index and a value."""
        return getattr(self.compressor, "record_bytes", 8)

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
            return self.exchange_path(tensor)
        if self.adam_declined or density in self.adam_dense:  # exact Adam: adam_freeze
            return PathKind.DENSE
        if self.hierarchical(tensor):
            return PathKind.HIERARCHICAL
        if density in self.forced_dense and PathKind.DENSE in self.flat:
            return PathKind.DENSE
        if self.timeline:
            return self.overlap_plan(density).paths[tensor.key]
        return self.summed_path(tensor, density)

    def summed_path(self, tensor, density):
        """A flat tensor's path by the cost model's sums (``choose_aggregation``, with its
        ``dense_preference``)."""
        k = num_selected(tensor.numel, density)
        allowed = self.flat_at(density)
        key = (tensor.numel, k, allowed)  # (the same k at another density: maybe another
        chosen = self._paths.get(key)     # step's choice, whatever was asked first)
        if chosen is None:
            chosen = self.cost_model.choose_aggregation(
                tensor.numel, k, self.world_size, self.dense_value_bytes,
                self.compressor.value_bytes, allowed=allowed,
                gather_record_bytes=gather_record_bytes(self.compressor, tensor.numel, k))
            self._paths[key] = chosen
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
        large flat tensor dense or ``kind``, as the cost model chooses for it alone
        (weighing DGC's side by ``dense_preference``), and ``kind``'s latency once per
        launch: once a step where the framework batches ``kind``, else once per bucket
        (``buckets``' cut, backward order) or per tensor outside them."""
        model, world = self.cost_model, self.world_size
        allowed = tuple(a for a in self.flat if a in (PathKind.DENSE, kind))
        weight = model.dense_preference
        seconds, paths, sparse = 0.0, {}, 0
        for tensor in self.tensors:
            if not self.large(tensor) or self.hierarchical(tensor):
                continue
            k = self.k(tensor, density)
            record = gather_record_bytes(self.compressor, tensor.numel, k)
            path = model.choose_aggregation(
                tensor.numel, k, world, self.dense_value_bytes, self.compressor.value_bytes,
                allowed=allowed, gather_record_bytes=record)
            comm, local = model.path_seconds(
                tensor.numel, k, world, self.dense_value_bytes, self.compressor.value_bytes,
                allowed=(path,), gather_record_bytes=record)[path]
            paths[tensor.key] = path
            if path == PathKind.DENSE:
                seconds += comm
            else:
                sparse += 1
                seconds += weight * (comm + local - model.launch_seconds(path, world))
        if not sparse:
            return seconds
        if kind in self.resolved.batched:
            launches = 1
        elif kind == PathKind.ALLGATHER:
            order = list(reversed(self.tensors))
            cut = self._cut(order, lambda t: paths.get(t.key, PathKind.DENSE), density,
                            fusion_threshold(self.config.fusion_threshold))
            launches = sum(any(paths.get(key) == kind for key in bucket) for bucket in cut)
        else:
            launches = sparse
        return seconds + weight * launches * model.launch_seconds(kind, world)

    def timeline_differs(self, density):
        """Would the step's timeline (``overlap_plan``) send some flat tensor another way
        than the sums do, at ``density``? (Only then is there anything to try.)"""
        if self.profile is None or not self.resolved.sparse:
            return False
        plan = self.overlap_plan(density).paths
        return any(plan[t.key] != self.summed_path(t, density) for t in self.tensors
                   if self.large(t) and not t.sliced and not self.hierarchical(t))

    def exchange_path(self, tensor):
        """EXCHANGE or DENSE for a tensor the compressor of its own collectives takes:
        a payload allgathered from every rank (sign, QSGD, bf16) grows with the world and
        is priced against the dense allreduce (costmodel.choose_exchange); PowerSGD's and
        TernGrad's allreduces are not. A tensor that turns dense loses nothing: the dense
        path sends the memory whole, what the compressor had left in it too."""
        payload_bytes = getattr(self.compressor, "payload_bytes", None)
        if payload_bytes is None:
            return PathKind.EXCHANGE
        key = ("exchange", tensor.numel)
        chosen = self._paths.get(key)
        if chosen is None:
            world = self.world_size
            chunk = sign_chunk_bytes(tensor.numel, world) \
                if reduces_signs(self.compressor, world) else None
            chosen = self.cost_model.choose_exchange(
                tensor.numel, payload_bytes(tensor.numel), world, self.dense_value_bytes,
                chunk_bytes=chunk)
            self._paths[key] = chosen
        return chosen

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
            k = num_selected(tensor.numel, final)
            decided = self.cost_model.choose_aggregation(
                tensor.numel, k, self.world_size, self.dense_value_bytes,
                self.compressor.value_bytes, allowed=aggregations, local_size=self.local_size,
                gather_record_bytes=gather_record_bytes(self.compressor, tensor.numel, k)
            ) == PathKind.HIERARCHICAL
            self._hierarchical[tensor.numel] = decided
        return decided

    def hierarchical_hosts(self, local_size, cross_size, global_set, elastic, unsupported=None):
        """Whether hierarchical DGC may run here (then every rank looks up who shares its
        host): several hosts of several ranks, the global process set, not elastic, not
        with ``period``, and not where the framework says it cannot yet (``unsupported``:
        why, in words). Forced (``aggregation="hierarchical"``) where it cannot: refused,
        saying why."""
        aggregations = self.resolved.aggregations
        if PathKind.HIERARCHICAL not in aggregations or not self.resolved.sparse:
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
        elif self.config.period > 1:  # its memory holds the host's sum: no own step back
            problem = f"it does not run with period={self.config.period} (use period=1)"
        elif unsupported:
            problem = unsupported
        if problem and aggregations == (PathKind.HIERARCHICAL,):
            raise ValueError(f"aggregation='hierarchical': {problem}. Use aggregation='auto' "
                             f"(hierarchical where it applies) or 'flat'.")
        return problem is None

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
        buckets = self._cut(order, lambda t: self.path(t, density), density, threshold)
        plan = {k: bucket for bucket in buckets if len(bucket) > 1 for k in bucket}
        self._buckets = {key: plan}  # the latest only: a callable schedule may change often
        return plan

    def _cut(self, order, path_of, density, threshold):
        """``buckets``' launches, every one (single tensors too), as tuples of keys: the
        tensors of ``order`` whose ``path_of`` is DENSE or ALLGATHER, cut by bytes and
        latency."""
        model = self.cost_model
        budget = BUCKET_LATENCIES * model.alpha
        buckets, members, size, seconds_in = [], [], 0, 0.0
        for tensor in order:
            path = path_of(tensor)
            # seconds: its transfer as the cost model prices it (none in a world of one)
            if path == PathKind.DENSE:
                wire = tensor.numel * self.dense_value_bytes
                seconds = dense_bytes(tensor.numel, self.world_size,
                                      self.dense_value_bytes) / model.bandwidth
            elif path == PathKind.ALLGATHER:
                k = self.k(tensor, density)
                record = gather_record_bytes(self.compressor, tensor.numel, k)
                wire = k * record
                seconds = allgather_bytes(k, self.world_size, record) / \
                    model.records_bandwidth
            else:
                continue
            if members and size + wire > threshold:
                buckets.append(tuple(members))
                members, size, seconds_in = [], 0, 0.0
            members.append(tensor.key)
            size += wire
            seconds_in += seconds
            if seconds_in > budget:  # a long transfer: nothing after it holds it back
                buckets.append(tuple(members))
                members, size, seconds_in = [], 0, 0.0
        if members:
            buckets.append(tuple(members))
        return buckets

    def folds(self, numel):
        """Carry ``numel`` dense elements inside a launch's allgather (costmodel.folds)."""
        return self.cost_model.folds(numel, self.world_size,
                                     gather_value_bytes(self.compressor, numel),
                                     fold_index_bytes(self.compressor), self.dense_value_bytes)

    def adam_freeze(self, lagging):
        """The step at which Adam/AdamW's take-over freezes its variance: the schedule's
        freeze, or later, at the start of the first density stage in which the large
        tensors that leave other than dense on this link hold ``ADAM_SPARSE_SHARE`` of
        the gradient's elements (before it every tensor goes dense, ``adam_dense``, so
        Adam is exact and the few bytes a small tensor would have saved are spent);
        None where no stage does (exact Adam throughout, every tensor dense:
        ``adam_declined``), also where a compressor of its own collectives would send
        every large tensor dense (``exchange_dense``). The schedule's freeze as it is
        with ``delay`` or ``period`` (they need the linear update from it), a
        compressor of its own collectives otherwise (no density stages), a callable
        schedule, or no tensor large enough to compress (``min_compress_size``: the
        script's choice). Decided once, at wrap time: a relink (linkwatch.py) keeps
        it."""
        r = self.resolved
        self.adam_declined, self.adam_dense, self.adam_share = False, frozenset(), 0.0
        inner = getattr(r.schedule, "inner", None)
        large = [t for t in self.tensors if self.large(t)]
        if r.freeze is not None and not lagging and self.exchange_idle():
            self.adam_declined = True
            return None
        if r.freeze is None or lagging or r.kind == "exchange" or \
                not isinstance(inner, DensitySchedule) or not large:
            return r.freeze
        warm = inner.warmup > 0
        stages = list(zip((0.0,) + inner.boundaries if warm else (0.0,),
                          tuple(inner.warmup_densities if warm else ()) + (inner.density,)))
        if warm and inner.unit != "step":  # stages in epochs: only the final one judged,
            stages = [(0.0, inner.density)]   # and the freeze stays where it was planned
        for start, density in stages:
            share = self.sparse_share(density)
            self.adam_share = max(self.adam_share, share)
            if share >= ADAM_SPARSE_SHARE:
                self.adam_frozen_at = r.freeze + int(math.ceil(start))
                self.adam_dense = frozenset(d for s, d in stages if s < start) - \
                    {d for s, d in stages if s >= start}
                return self.adam_frozen_at
        self.adam_declined = True
        return None

    def settled(self):
        """The resolved options to build the step from, once ``adam_freeze`` has decided:
        0/1 Adam's default period (config.py ``Resolved.zero_one``) runs only where Adam is
        taken over; where it is declined (the compressor saves nothing on this link) the
        step is Horovod's, every step."""
        r = self.resolved
        if r.zero_one and self.adam_declined and r.config.period > 1:
            r = r.every_step()
            self.resolved, self.config = r, r.config
        return r

    def sparse_share(self, density):
        """The share of the gradient's elements in large tensors that leave other than
        dense at ``density`` (0 where there are none)."""
        total = sum(t.numel for t in self.tensors)
        sparse = sum(t.numel for t in self.tensors
                     if self.large(t) and self.path(t, density) != PathKind.DENSE)
        return sparse / total if total else 0.0

    def consistency(self, **extra):
        """What must agree on every rank (hvd_dgc/consistency.py compares it): the
        options, what they resolved to, and the tensors."""
        r = self.resolved
        config = r.config.to_dict(shared=True)
        config.update({
            "compression": repr(getattr(r.compressor, "config", lambda: r.compressor)()),
            "dense_fp16": r.dense_fp16,
            "density": repr(r.schedule.config()) if hasattr(r.schedule, "config")
            else getattr(r.schedule, "__qualname__", repr(r.schedule)),
            "cost_model": "measure" if self.measure else repr(self.cost_model.config()),
            "tensors": [[t.name, list(t.shape)] for t in self.tensors],
            "sparse_gradients": [t.name for t in self.tensors if t.sliced],
        })
        config.update(extra)
        return config
