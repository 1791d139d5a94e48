"""When a step's tensors leave: backward-pass counts, Horovod's groups, buckets, and
what waits for ``synchronize``.

A parameter's gradient is ready when its hook has fired ``backward_passes_per_step``
times. Then, in this order:

    Horovod ``groups``     a group leaves when all its members are ready (as Horovod)
    batched                left for synchronize, to leave together: on an accelerator
                           with a sparse compressor every tensor (kernel launches, not
                           bytes, bound the selection there: one for all costs what one
                           tensor's would), elsewhere the tensors going by region reduce
                           this step (one alltoall and one allgather carry them all)
    a bucket               consecutive tensors in backward order, up to
                           ``fusion_threshold`` bytes on the wire (plan.Planner.buckets),
                           leave when the last of them is ready: one Horovod negotiation
                           per bucket, which costs round trips on a slow link
    alone                  otherwise, from its own hook

``finish`` (synchronize) says what has not left: parameters whose hook has not fired
(unused this step, or fewer backward passes) still join every collective, so the
launches are the same on every rank.

The scheduler decides and returns; it starts nothing. ``ready`` and ``finish`` return
the groups of parameters that leave now, and the optimizer launches them at this step's
place (exchange.py ``StepPlace``, made once a step: its density and step are what the
buckets and the batching are decided by, here as in the exchange).
"""

from hvd_dgc.packing import reduces_signs
from hvd_dgc.paths import PathKind
from hvd_dgc.torch.paths import CLASSES

__all__ = ["LaunchScheduler"]


class LaunchScheduler:
    """Counts of one optimizer's step, and which parameters leave together when."""

    def __init__(self, params, index, infos, groups, passes, planner, fusion_threshold,
                 on_accelerator, sparse_as_dense):
        self.params = list(params)             # trainable, in parameter order
        self.index, self.infos = index, infos  # param -> int, param -> plan.TensorInfo
        self.passes = passes
        self.planner, self.fusion_threshold = planner, fusion_threshold
        self.sparse = planner.resolved.sparse
        self._by_key = {index[p]: p for p in self.params}
        self._left = {p: passes for p in self.params}   # backward passes still to come
        self._seen = set()      # parameters whose hook fired since the last finish
        self._gone = set()      # parameters that left this step
        self._group_of, self._group_counts = {}, {}
        self._groups = groups is not None
        if groups is not None:
            self._make_groups(groups)
        self._bucket_ready = {}  # id(bucket) -> its parameters whose hook fired this step
        self._bucket_plan, self._bucket_params = None, {}  # keys -> bucket, for one plan
        devices = {p.device for p in self.params}
        self._batch_all = bool(self.sparse and self.params and on_accelerator(self.params[0])
                               and len(devices) == 1 and not self._groups)
        self.sparse_as_dense = sparse_as_dense
        self._may_batch = self.sparse and any(CLASSES[k].batched
                                              for k in planner.resolved.aggregations)
        self._order = [infos[q] for q in reversed(self.params)]  # backward order, roughly

    def _make_groups(self, groups):
        names = {p: self.infos[p].name for p in self.params}
        order = sorted(self.params, key=names.get)
        if isinstance(groups, list):
            ids = {id(p) for p in self.params}
            p_groups = [tuple(p for p in g if id(p) in ids) for g in groups]
            grouped = {id(p) for g in p_groups for p in g}
            p_groups += [(p,) for p in order if id(p) not in grouped]
        else:
            p_groups = [tuple(order[i::groups]) for i in range(groups)]
        for g in p_groups:
            if g:
                self._group_counts[g] = 0
                for p in g:
                    self._group_of[p] = g

    @property
    def batch_all(self):
        """Does every launch wait for synchronize (an accelerator, a sparse compressor)?"""
        return self._batch_all

    # -- the hook ------------------------------------------------------------------------
    def ready(self, p, place):
        """``p``'s hook fired (its gradient accumulated) at this step's ``place``: the
        groups of parameters that leave now (none, one, or two where a sparse gradient
        leaves alone and completes its bucket)."""
        if self._left[p] <= 0:
            raise AssertionError(
                "Gradients were computed more than backward_passes_per_step times "
                "before call to step(). Increase backward_passes_per_step to "
                "accumulate gradients locally.")
        self._left[p] -= 1
        self._seen.add(p)
        if self._left[p] > 0:
            return []
        group = self._group_of.get(p)
        if group is not None:
            self._group_counts[group] += 1
            if self._group_counts[group] < len(group):
                return []
            self._group_counts[group] = 0
            return [self._leave(group)]
        if self._batched(p, place):  # leaves with the others, in synchronize
            return []
        bucket = self._bucket_of(p, place)
        out = [self._leave((p,))] if bucket is None or self._sparse_grad(p) else []
        if bucket is not None:
            ready = self._bucket_ready.setdefault(id(bucket), set())
            ready.add(p)
            if len(ready) == len(bucket):
                out += self._bucket_leaves(bucket)
        return out

    def _leave(self, members):
        self._gone.update(members)
        return members

    def _sparse_grad(self, p):
        return p.grad is not None and p.grad.is_sparse and not self.sparse_as_dense

    def _batched(self, p, place):
        """Launch ``p`` with the others, in synchronize, rather than from its hook? The
        launch's members, order and name are the same on every rank (by index). The
        sign's compressed allreduce carries all of a step's tensors in one alltoall and
        one allgather (packing.sign_chunk_bytes: the scales and the padding once)."""
        if self._groups:
            return False
        if self._batch_all:
            return True
        signs = reduces_signs(self.planner.compressor, self.planner.world_size)
        if not (self._may_batch or signs) or self._sparse_grad(p):
            return False
        path = self.planner.path(self.infos[p], place.density, place.step)
        return CLASSES[path].batched or (signs and path == PathKind.EXCHANGE)

    def _bucket_of(self, p, place):
        """The bucket ``p`` leaves with (a tuple of parameters), or None (alone)."""
        if self._groups:
            return None
        plan = self.planner.buckets(place.density, self._order, self.fusion_threshold)
        keys = plan.get(self.index[p])
        if keys is None:
            return None
        # each bucket's tuple made once per plan, and kept apart by id: every hook asks,
        # and a tuple of tensors hashes tensor by tensor (O(n^2) a step for n tensors)
        if plan is not self._bucket_plan:
            self._bucket_plan, self._bucket_params = plan, {}
        bucket = self._bucket_params.get(keys)
        if bucket is None:
            bucket = self._bucket_params[keys] = tuple(self._by_key[k] for k in keys)
        return bucket

    def _bucket_leaves(self, bucket):
        """The bucket's parameters that have not left this step (a sparse gradient,
        nn.Embedding(sparse=True), leaves alone from its hook), as one group, or none."""
        self._bucket_ready.pop(id(bucket), None)
        members = tuple(p for p in bucket if p not in self._gone)
        return [self._leave(members)] if members else []

    # -- synchronize ---------------------------------------------------------------------
    def finish(self, place):
        """The groups that have not left this step, in launch order; the step's counts
        of what left start afresh."""
        rest = [p for p in self.params if p not in self._gone]
        out = []
        together = tuple(p for p in rest if self._batched(p, place))
        if together:
            out.append(self._leave(together))
        for p in rest:
            if p in self._gone:  # left with its bucket just now
                continue
            bucket = self._bucket_of(p, place)
            out += [self._leave((p,))] if bucket is None else self._bucket_leaves(bucket)
        self._gone.clear()
        self._seen.clear()
        return out

    @property
    def pending(self):
        """Whether a backward pass has run since the last synchronize."""
        return bool(self._seen)

    def restart(self, passes=None):
        """What the hooks count within a step, back to its start: backward passes left,
        parameters ready in each group and bucket (after a step, or a step cut short)."""
        if passes is not None:
            self.passes = passes
        for p in self._left:
            self._left[p] = self.passes
        for g in self._group_counts:
            self._group_counts[g] = 0
        self._bucket_ready.clear()

    def clear(self):
        self._gone.clear()
        self._seen.clear()
        self.restart()
