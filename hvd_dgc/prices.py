"""What one tensor's exchange costs on this world and link, path by path.

The planner (plan.py) decides which way each tensor travels; ``Prices`` says what each
way costs it, by the cost model in use (costmodel.py) and the compressor's records
(packing.py): the bytes a rank receives and the seconds, for the allgather, region
reduce, hierarchical DGC, the dense allreduce and a payload compressor's exchange. The
planner makes a new one whenever the world or the cost model moves.
"""

from hvd_dgc.aggregation import allgather_bytes, dense_bytes, hierarchical_bytes, region_bytes
from hvd_dgc.fusion import BUCKET_LATENCIES, cut
from hvd_dgc.packing import exchange_bytes, fold_index_bytes, gather_record_bytes, \
    gather_value_bytes, reduces_signs, region_record, sign_chunk_bytes
from hvd_dgc.paths import PathKind

__all__ = ["Prices"]


class Prices:
    """Bytes and seconds of one tensor's exchange on ``world_size`` ranks (``local_size``
    of them on this host, 0 where hierarchical DGC may not run) by ``cost_model``, with
    ``compressor``'s records and dense values of ``dense_value_bytes``."""

    def __init__(self, cost_model, compressor, world_size, local_size, dense_value_bytes):
        self.cost_model, self.compressor = cost_model, compressor
        self.world_size, self.local_size = world_size, local_size
        self.dense_value_bytes = dense_value_bytes

    @property
    def record_bytes(self):
        """A record of the hierarchical path: an int32 index and a value."""
        return getattr(self.compressor, "record_bytes", 8)

    def _gathered(self, numel, k):
        return gather_record_bytes(self.compressor, numel, k)

    def region_record(self, numel, k):
        """A record on region reduce's wire (packing.region_record)."""
        return region_record(self.compressor, numel, k, self.world_size)

    def seconds(self, numel, k, allowed):
        """``{path: (transfer seconds, DGC's local seconds)}`` on each of ``allowed``
        (costmodel.path_seconds)."""
        return self.cost_model.path_seconds(
            numel, k, self.world_size, self.dense_value_bytes, self.compressor.value_bytes,
            allowed=allowed, local_size=self.local_size,
            gather_record_bytes=self._gathered(numel, k),
            region_record_bytes=self.region_record(numel, k))

    def choose(self, numel, k, allowed):
        """The cheapest of ``allowed`` by the cost model's sums, weighed by its
        ``dense_preference`` (costmodel.choose_aggregation)."""
        return self.cost_model.choose_aggregation(
            numel, k, self.world_size, self.dense_value_bytes, self.compressor.value_bytes,
            allowed=allowed, local_size=self.local_size,
            gather_record_bytes=self._gathered(numel, k),
            region_record_bytes=self.region_record(numel, k))

    def exchange(self, numel):
        """EXCHANGE or DENSE for a tensor a compressor of its own collectives takes: a
        payload allgathered from every rank (sign, QSGD, bf16) grows with the world, the
        sign's compressed allreduce does not; both are priced against the dense allreduce
        (costmodel.choose_exchange). PowerSGD's and TernGrad's allreduces are not
        priced."""
        payload_bytes = getattr(self.compressor, "payload_bytes", None)
        if payload_bytes is None:
            return PathKind.EXCHANGE
        world = self.world_size
        chunk = sign_chunk_bytes(numel, world) if reduces_signs(self.compressor, world) \
            else None
        return self.cost_model.choose_exchange(numel, payload_bytes(numel), world,
                                               self.dense_value_bytes, chunk_bytes=chunk)

    def sign_group(self, numels):
        """Which of ``numels`` (the tensors a step's compressed allreduce of the sign may
        carry, in launch order) it carries, the others going dense: positions, sorted.
        Where the sign is not reduced on this world, each tensor as ``exchange`` prices it
        alone. Else a tensor that pays alone stays; one that does not (the scales and
        the padding of N chunks, the latency, all its own) stays while what it adds to
        the group (its marginal seconds: the group's ``reduce_seconds`` with it less
        without it), weighed by ``dense_preference``, costs no more than its dense
        allreduce; the dearest is dropped first and the rest priced again, as each
        departure moves the others' share of the scales and the padding."""
        alone = [self.exchange(n) == PathKind.EXCHANGE for n in numels]
        world = self.world_size
        if not reduces_signs(self.compressor, world):
            return [i for i, pays in enumerate(alone) if pays]
        model, keep = self.cost_model, list(range(len(numels)))

        def seconds(group):
            sizes = [numels[i] for i in group]
            return model.reduce_seconds(sum(sizes), sign_chunk_bytes(sizes, world), world) \
                if sizes else 0.0
        while True:
            total, worst, excess = seconds(keep), None, 0.0
            for i in (i for i in keep if not alone[i]):
                over = (total - seconds([j for j in keep if j != i])) * \
                    model.dense_preference - model.dense_seconds(
                        numels[i], world, self.dense_value_bytes)
                if over > excess:
                    worst, excess = i, over
            if worst is None:
                return keep
            keep.remove(worst)

    def dense_wire(self, path):
        """Does ``path`` move dense values (the allreduce's rate), not records?"""
        return path not in (PathKind.ALLGATHER, PathKind.REGION, PathKind.HIERARCHICAL) and \
            not (path == PathKind.EXCHANGE and hasattr(self.compressor, "payload_bytes"))

    def wire_bytes(self, numel, k, path):
        """Bytes one rank receives for a tensor of ``numel`` elements (``k`` records) on
        ``path`` in one exchange. Hierarchical: its records between hosts only; a
        compressor of its own collectives without a payload (PowerSGD, TernGrad): the
        dense ring's."""
        world = self.world_size
        if path == PathKind.ALLGATHER:
            return allgather_bytes(k, world, self._gathered(numel, k))
        if path == PathKind.REGION:
            return region_bytes(k, world, self.region_record(numel, k))
        if path == PathKind.HIERARCHICAL:
            return hierarchical_bytes(k, world, self.local_size, self.record_bytes)
        if not self.dense_wire(path):  # a payload compressor's allgather, or the sign's
            #                             compressed allreduce
            return exchange_bytes(self.compressor, numel, world)[1]
        return dense_bytes(numel, world, self.dense_value_bytes)

    def wire_seconds(self, numel, k, path):
        """``wire_bytes`` at the rate its kind moves at (the records' or the dense
        allreduce's), without latency."""
        model = self.cost_model
        return self.wire_bytes(numel, k, path) / (
            model.bandwidth if self.dense_wire(path) else model.records_bandwidth)

    def bucketed(self, numel, k, path):
        """``(bytes it adds to a bucket, its transfer's seconds)`` for a tensor going
        DENSE or by ALLGATHER; None on another path (it leaves in no bucket)."""
        if path == PathKind.DENSE:
            return numel * self.dense_value_bytes, self.wire_seconds(numel, k, path)
        if path == PathKind.ALLGATHER:
            return k * self._gathered(numel, k), self.wire_seconds(numel, k, path)
        return None

    def launches(self, transfers, threshold):
        """The launches, as tuples of keys, of ``transfers`` (``(key, numel, k, path)`` in
        launch order) whose path is DENSE or ALLGATHER: fusion.py ``cut`` at ``threshold``
        bytes and ``BUCKET_LATENCIES`` message latencies."""
        priced = ((key, self.bucketed(numel, k, path)) for key, numel, k, path in transfers)
        return cut([(key, *p) for key, p in priced if p is not None], threshold,
                   BUCKET_LATENCIES * self.cost_model.alpha)

    def step_seconds(self, tensors, flat, kind, allowed, batched, threshold, small=0):
        """A step's flat exchange were its sparse path ``kind``: each tensor of ``tensors``
        (``(key, numel, k)``, forward order) whose key is in ``flat`` goes the cheapest of
        ``allowed`` for it alone (weighing DGC's side by ``dense_preference``), and
        ``kind``'s latency is paid once per launch: once a step where the framework
        batches it (``batched``), else once per bucket (``launches``' cut at
        ``threshold``, backward order) or per tensor outside them. ``small``: the
        elements of the tensors too small to compress, which ride the allgather where
        they fold (in its values' bytes, from every rank) and else go dense: at a few
        ranks the allgather's 8-bit values cost a fraction of their dense allreduce,
        which region reduce pays."""
        model, world = self.cost_model, self.world_size
        weight = model.dense_preference
        seconds, paths, sparse = 0.0, {}, 0
        if small and kind == PathKind.ALLGATHER and self.folds(small):
            seconds += weight * (world - 1) * small * gather_value_bytes(
                self.compressor, small) / model.records_bandwidth
        elif small:
            seconds += model.dense_seconds(small, world, self.dense_value_bytes)
        for key, numel, k in tensors:
            if key not in flat:
                continue
            path = paths[key] = self.choose(numel, k, allowed)
            comm, local = self.seconds(numel, k, (path,))[path]
            if path == PathKind.DENSE:
                seconds += comm
            else:
                sparse += 1
                seconds += weight * (comm + local - model.launch_seconds(path, world))
        if not sparse:
            return seconds
        if batched:
            launches = 1
        elif kind == PathKind.ALLGATHER:
            order = [(key, numel, k, paths.get(key, PathKind.DENSE))
                     for key, numel, k in reversed(tensors)]
            launches = sum(any(paths.get(key) == kind for key in bucket)
                           for bucket in self.launches(order, threshold))
        else:
            launches = sparse
        return seconds + weight * launches * model.launch_seconds(kind, world)

    def folds(self, numel):
        """Carry ``numel`` dense elements inside a launch's allgather (costmodel.folds)."""
        return self.cost_model.folds(numel, self.world_size,
                                     gather_value_bytes(self.compressor, numel),
                                     fold_index_bytes(self.compressor), self.dense_value_bytes)
