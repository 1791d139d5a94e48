"""hvd_dgc's DistributedOptimizer for PyTorch: Horovod's, with Deep Gradient Compression.

Same signature and behaviour as ``horovod.torch.DistributedOptimizer``
(synchronize, skip_synchronize, backward_passes_per_step, groups, process
sets, broadcast_optimizer_state), plus DGC (Lin et al., ICLR 2018): momentum
correction, momentum factor masking, local gradient clipping, warm-up, and a
per-tensor choice among dense allreduce, sparse allgather and region reduce.

The path of one gradient (this file, and paths.py for how each way travels):

    backward hook (last of backward_passes_per_step)      _launch -> _prepare
      (launched together in synchronize instead: on a GPU with a sparse compressor,
      every tensor; elsewhere the tensors going by region reduce. Otherwise, with a
      sparse compressor, a tensor waits for the others of its bucket: consecutive
      tensors in backward order up to ``fusion_threshold`` bytes on the wire, one
      launch when the last of them is ready, so a step's records leave in as few
      collectives as the backward pass allows: one per bucket, each a round of
      Horovod's negotiation, which costs round trips on a slow link)
      g = local_gradient(p.grad)     clip (N^-1/2), weight decay
      path = choose_aggregation(...) dense / allgather / region, by the cost model;
                                     or the compressor's own collectives (exchange);
                                     or Horovod's for a sparse gradient (sparse_grad);
                                     or hierarchical DGC (several hosts of several
                                     ranks: chosen once per tensor), which sends g
                                     itself and accumulates the host's sum in advance
      v = memory.accumulate(g)       u = m u + g; v += u  (+ |v| block maxima if sparse)
      payload = path.take(v)         what leaves the memory; it keeps the rest
        dense:     v (fp16: its rounding error stays)             memory.sent_all()
        allgather, region: selected with the launch's other sparse tensors at launch:
                   sel = sparsify_many(vs, ks); memory.sent(idx)
        exchange:  the compressor takes what it sent out of v (error feedback)
        sparse_grad (nn.Embedding(sparse=True)): its rows, as Horovod; no memory
      path.launch(payloads)          non-blocking collectives, one set per path
    optimizer.step()                                      synchronize -> _collect
      path.advance(...)              second rounds, every launch before any wait
                                     (region: owners reduce, give back the unsent)
      avg = path.collect(...)        the average (sum of records / N, or allreduced v)
      delay 0: p.grad = avg_i
      delay D: p.grad = own_i - own_{i-D} + avg_{i-D}    (DGA; own = what this rank sent)
      period p: between exchanges (every p-th step) the memory only accumulates and
               p.grad = own_i, this rank's velocity; the exchange's average, D steps
               after it, replaces everything this rank applied for its p steps
      base optimizer step, with SGD's momentum and weight decay switched off
      (the memory applied them already; a sparse gradient gets the base SGD's own)

Delayed gradient averaging (Zhu et al., NeurIPS 2021) keeps the collectives of
the last D steps in flight: step i waits only for step i-D's, and replaces that
step's local contribution by the average. The correction is applied to the
velocity the memory sends (what DGC already communicates); with SGD, whose
update is linear in the gradient, that equals feeding the corrected gradient to
SGD's own momentum (sum_j m^(i-j) (g_j - g_(j-D) + avg_(j-D)) is the same sum),
so one form serves dense and sparse paths alike.

Temporally sparse updates (``period=p``; Zhu et al., "Distributed Training Across the
World", 2019, the DTS update's second half) exchange every p-th step only. In between,
each rank steps with its own velocity (the increment its memory just accumulated,
``own``) and sends nothing; the memory keeps the whole sum, and the p-th step's
exchange sends from it as any step would. When that exchange's average arrives (at
once, or D steps later with ``delay``), it replaces every ``own`` this rank applied for
those p steps, so each rank is back on the common trajectory: ``avg - sum(own)``.
At p = 1 this is the DGA rule above, and at p = 1, D = 0 synchronous training.
"""

import os
import time
import warnings
from collections import deque
from contextlib import contextmanager
from typing import NamedTuple

import torch
import horovod.torch as _hvd
from horovod.torch.mpi_ops import Adasum, Average, Max, Sum, global_process_set

from hvd_dgc import consistency
from hvd_dgc.config import DGCConfig, check_horovod_arguments, check_linear_update
from hvd_dgc.autodelay import AutoDelayState
from hvd_dgc.costmodel import AGGREGATION_OPTIONS, DENSE, HIERARCHICAL, REGION, SPARSE, \
    CostModel, aggregation_choices
from hvd_dgc.fp16wire import clip_warning
from hvd_dgc.schedule import as_schedule, num_selected
from hvd_dgc.stats import CompressionStats
from hvd_dgc.switch import dense_requested, idle_warning, resolve_compression, summary
from hvd_dgc.torch.collective import EXCHANGE, ExchangeCompressor, is_exchange
from hvd_dgc.torch.compression import Compression, SparseCompressor, is_sparse, on_accelerator
from hvd_dgc.torch.memory import DGCMemory, buffer_dtype, local_gradient
from hvd_dgc.torch.paths import ORDER as PATH_ORDER, SPARSE_GRAD, Item, Job, Wire, \
    make_paths, own_of, subtract_own

__all__ = ["DistributedOptimizer"]

STATE_KEY = "hvd_dgc"
STATE_VERSION = 1
_TAKEN_OVER = ("momentum", "weight_decay", "nesterov")
LOCAL = "local"  # a tensor's item on a step between exchanges (period > 1): no path
HOROVOD_FUSION_DEFAULT = 64 * 1024 * 1024  # Horovod's HOROVOD_FUSION_THRESHOLD default


class _Part(NamedTuple):
    """One path's share of a launch."""

    path: object
    positions: list        # of its tensors in the launch
    handle: object


class _Pending(NamedTuple):
    """One launch: its parameters, their items and each path's collectives."""

    params: tuple
    items: list
    parts: list


class _InFlight(NamedTuple):
    """One step's launches (none on a step between exchanges) and its own terms, waiting
    for the step at which the exchange that covers them is applied."""

    due: int        # the optimizer step (DGCState.step) that applies its average
    launches: list  # of _Pending


class _DistributedOptimizer(torch.optim.Optimizer):
    # Horovod's broadcast_optimizer_state calls the *base* step (no collectives)
    # to initialise state only for classes from horovod.torch.optimizer's module.
    __module__ = "horovod.torch.optimizer"
    _hvd_dgc_optimizer = True  # hvd_dgc/torch/elastic_state.py recognises it by this

    def __init__(self, params, named_parameters, compression, backward_passes_per_step,
                 op, gradient_predivide_factor, groups, sparse_as_dense, process_set, dgc):
        super(self.__class__, self).__init__(params)
        self._compression = compression
        self._dgc = dgc
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self._groups = groups

        all_params = [p for group in self.param_groups for p in group["params"]]
        self._param_index = {p: i for i, p in enumerate(all_params)}
        self._parameter_names = _name_parameters(named_parameters, self.param_groups)
        _check_dtypes(self.param_groups, self._parameter_names)
        self._takes_over_sgd = isinstance(self, torch.optim.SGD) and process_set.included()
        if self._takes_over_sgd:
            for group in self.param_groups:
                _check_dampening(group)

        self._inflight = deque()    # DGA, period: _InFlight not yet applied, oldest first
        self._average_after_step = False
        self._allreduce_delay = {p: backward_passes_per_step for p in all_params}
        self._handles = {}          # p or tuple(group) -> _Pending, or None while counting
        self._requires_update = set()
        self._synchronized = False
        self._should_synchronize = True
        self._p_to_group = {}
        self._group_counts = {}
        self._hook_handles = []
        self._skip_step = False        # synchronize found a non-finite average: skip step()
        self._compressor_saved = None  # the sampler's RNG before a guarded step
        self._dropped = []             # delay > 0: tensors this rank sent as zeros this step
        self._batch = None             # one launch per step, in synchronize (_batched)
        self._sparse_grads = set()     # parameters whose update this step is a sparse grad
        self._hierarchical = {}        # numel -> whether such a tensor goes hierarchical
        self._plans = {}               # (density, world) -> {p: its bucket} (_bucket_of)
        self._bucket_ready = {}        # bucket -> its parameters whose hook fired this step
        self._step_ended = None        # delay="auto": when the last synchronize ended
        self._agreeing = None          # delay="auto": a window's sums, being agreed on
        peers = ()

        if self.process_set.included():
            # Elastic: a worker added later wraps its optimizer alone, while the others
            # wait in a reset; a collective here would hang it. All run the same script.
            if os.environ.get("HOROVOD_ELASTIC") != "1":
                _check_consistent_config(self._config(), self.process_set)
            peers = _host_peers(dgc, process_set)
        self._paths = make_paths(dgc, Wire(process_set, op, gradient_predivide_factor, peers))
        if self.process_set.included():
            # Unlike Horovod, hooks are registered at np=1 too: the same maths at any size.
            self._register_hooks()

    # -- set-up ------------------------------------------------------------
    def _config(self):
        """What must agree on every rank, or collectives would mismatch and hang."""
        d = self._dgc
        names = [self._parameter_names[p] for group in self.param_groups
                 for p in group["params"] if p.requires_grad]
        shapes = {self._parameter_names[p]: list(p.shape) for group in self.param_groups
                  for p in group["params"] if p.requires_grad}
        config = d.config.to_dict(shared=True)
        config.update({  # what the options resolved to here, and the model
            "compression": _describe(self._compression),
            "dense_compression": _describe(d.dense_compression),
            "density": repr(d.schedule.config()),
            "cost_model": repr(d.cost_model.config()),
            "op": repr(self.op),
            "backward_passes_per_step": self.backward_passes_per_step,
            "gradient_predivide_factor": self.gradient_predivide_factor,
            "fusion_threshold": d.fusion_threshold,
            "parameters": names,
            "shapes": shapes,
        })
        return config

    def _register_hooks(self):
        trainable = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        if self._groups is not None:
            order = sorted(trainable, key=lambda p: self._parameter_names[p])
            if isinstance(self._groups, list):
                ids = {id(p) for p in trainable}
                p_groups = [tuple(p for p in g if id(p) in ids) for g in self._groups]
                grouped = {id(p) for g in p_groups for p in g}
                p_groups += [(p,) for p in order if id(p) not in grouped]
            else:
                n = self._groups
                p_groups = [tuple(order[i::n]) for i in range(n)]
            for g in p_groups:
                if g:
                    self._group_counts[g] = 0
                    for p in g:
                        self._p_to_group[p] = g
        for p in trainable:
            self._requires_update.add(p)
            self._hook_handles.append(p.register_post_accumulate_grad_hook(self._make_hook(p)))

    def _make_hook(self, p):
        def hook(*ignore):
            if self._allreduce_delay[p] <= 0:
                raise AssertionError(
                    "Gradients were computed more than backward_passes_per_step times "
                    "before call to step(). Increase backward_passes_per_step to "
                    "accumulate gradients locally.")
            assert self._allreduce_delay[p] > 0
            self._allreduce_delay[p] -= 1
            if self._allreduce_delay[p] > 0:
                self._handles[p] = None
                return
            group = self._p_to_group.get(p)
            if group is None:
                if self._batched(p):  # launched with the others in synchronize
                    self._handles[p] = None
                    return
                bucket = self._bucket_of(p)
                alone = bucket is None or (p.grad is not None and p.grad.is_sparse
                                           and not self.sparse_as_dense)
                self._handles[p] = self._launch((p,)) if alone else None
                if bucket is not None:
                    ready = self._bucket_ready.setdefault(bucket, set())
                    ready.add(p)
                    if len(ready) == len(bucket):
                        self._launch_bucket(bucket)
                return
            self._group_counts[group] += 1
            if self._group_counts[group] == len(group):
                self._group_counts[group] = 0
                for gp in group:
                    self._handles.pop(gp, None)
                self._handles[group] = self._launch(group)
            else:
                self._handles[p] = None
        return hook

    def _batched(self, p):
        """Launch ``p`` with the others, in synchronize, rather than from its hook?

        On an accelerator, with a sparse compressor, every ungrouped parameter: there
        kernel launches, not bytes, bound the selection, and one selection for all
        tensors (gpu_select.py) costs what one tensor's would. A model spread over
        several devices launches per tensor. Elsewhere, the tensors going by region
        reduce this step: one alltoall and one allgather carry them all (two rounds per
        tensor would cost more in latency than their bytes). The launch's members, order
        and name are the same on every rank (by parameter index)."""
        if self._groups is not None:
            return False
        if self._batch is None:
            devices = {q.device for q in self._requires_update}
            self._batch = bool(is_sparse(self._compression) and on_accelerator(p)
                               and len(devices) == 1)
        if self._batch:
            return True
        if REGION not in self._dgc.aggregations or not is_sparse(self._compression) \
                or (p.grad is not None and p.grad.is_sparse and not self.sparse_as_dense):
            return False
        numel = p.numel()
        return self._choose_path(numel, num_selected(numel, self._dgc.density()),
                                 p.shape) == REGION

    def _bucket_of(self, p):
        """The bucket ``p`` leaves with (a tuple of parameters), or None (alone).

        Horovod's tensor fusion at hvd_dgc's level. Horovod fuses what is ready within
        one of its cycles, but a tensor whose hook fires while a cycle negotiates waits
        for the next one, and each cycle costs round trips; on a slow link a step of
        per-tensor launches spans several. Buckets are fixed from what every rank knows
        alike (parameter order, sizes, the density, the cost model's choice), so they
        are the same on every rank: consecutive tensors in reverse parameter order
        (backward order, roughly), cut where the wire bytes would pass
        ``fusion_threshold``. Tensors going by region reduce (launched together in
        synchronize) or hierarchically (their own rounds) stay out, as does every
        tensor of a dense compressor or of a Horovod ``groups`` set-up."""
        density = self._dgc.density()
        key = (density, self._world())  # an elastic reset changes the cost model's choice
        plan = self._plans.get(key)
        if plan is None:  # the latest only: a callable schedule may change every step
            plan = self._plan_buckets(density)
            self._plans = {key: plan}
        return plan.get(p)

    def _plan_buckets(self, density):
        d, comp, threshold = self._dgc, self._compression, self._dgc.fusion_threshold
        if threshold <= 0 or self._groups is not None or not is_sparse(comp):
            return {}
        buckets, members, size = [], [], 0
        for p in sorted(self._requires_update, key=self._param_index.get, reverse=True):
            numel = p.numel()
            k = num_selected(numel, density)
            path = self._choose_path(numel, k, p.shape)
            if path == DENSE:
                wire = numel * (2 if d.dense_fp16 else 4)
            elif path == SPARSE:
                wire = k * comp.record_bytes
            else:
                continue
            if members and size + wire > threshold:
                buckets.append(tuple(members))
                members, size = [], 0
            members.append(p)
            size += wire
        if members:
            buckets.append(tuple(members))
        return {p: bucket for bucket in buckets if len(bucket) > 1 for p in bucket}

    def _launch_bucket(self, bucket):
        """One launch for the bucket's parameters not launched yet this step (a sparse
        gradient, nn.Embedding(sparse=True), leaves alone from its hook)."""
        self._bucket_ready.pop(bucket, None)
        members = tuple(p for p in bucket if self._handles.get(p) is None)
        for p in members:
            self._handles.pop(p, None)
        if members:
            self._handles[members] = self._launch(members)
        return members

    def _announce(self):
        """Rank 0, once: what hvd_dgc does here and how to turn it off; every rank: a
        warning where a setting leaves DGC nothing to do."""
        d = self._dgc
        sizes = [p.numel() for group in self.param_groups for p in group["params"]
                 if p.requires_grad]
        comp = self._compression
        kind = "dense" if not (is_sparse(comp) or is_exchange(comp)) else comp.name
        large = [n for n in sizes if n >= d.min_compress_size]
        final, warm = 1.0, ""
        if is_sparse(comp):
            final = getattr(d.schedule, "density", None)
            if hasattr(d.schedule, "describe"):
                warm = d.schedule.describe()
            if final is None:  # a callable: its value now
                final, warm = d.density(), "warm-up set by a callable schedule"
        sums = {self._choose_path(n, num_selected(n, final), None) for n in large} \
            if is_sparse(comp) else set()
        if is_sparse(comp) or is_exchange(comp):
            sparse_at_final = not is_sparse(comp) or bool(sums - {DENSE})
            message = idle_warning(kind, d.min_compress_size, bool(large), sparse_at_final,
                                   final, self._world())
            if message:
                warnings.warn(message, UserWarning)
        if _hvd.rank() == 0:
            print(summary(kind, final, warm, d.min_compress_size, d.dense_fp16,
                          getattr(comp, "value_bytes", 4) == 2, d.describe_delay(),
                          len(large), len(sizes), "torch", sums, d.period), flush=True)

    # -- the gradient's path -------------------------------------------------
    def _world(self):
        return self.process_set.size()

    def _hyper(self, p):
        """(momentum, nesterov, weight_decay) the memory applies for ``p``."""
        if not self._takes_over_sgd:
            return 0.0, False, 0.0
        group = self._group_of[p]
        _check_dampening(group)
        return group["momentum"], group["nesterov"], group["weight_decay"]

    def _grad_of(self, p):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        # sparse_as_dense (Horovod's meaning): a dense allreduce, here through DGC; the
        # update goes back into p.grad as a sparse tensor (_set_grad).
        return p.grad.to_dense() if p.grad.is_sparse else p.grad

    def _prepare(self, p):
        """One parameter's gradient, up to its path: clip, accumulate, choose the path;
        the path takes its payload out of the memory (paths.py)."""
        d = self._dgc
        key, name = self._param_index[p], self._parameter_names[p]
        scale = None
        if d.grad_scaler is not None and d.grad_scaler.is_enabled():
            scale = d.loss_scale()
        if p.grad is not None and p.grad.is_sparse and not self.sparse_as_dense:
            return self._prepare_sparse_grad(p, scale)
        grad = self._grad_of(p)
        if scale is not None:
            grad = grad / scale

        momentum, nesterov, weight_decay = self._hyper(p)
        g = local_gradient(grad, p, weight_decay, d.clip_norm, self._world())
        if not d.exchanges_now():  # period > 1, a step between exchanges
            return self._prepare_local(Job(key, name, p.shape, g, 0, 1.0, momentum,
                                           nesterov=nesterov))
        numel, density = g.numel(), d.density()
        k = num_selected(numel, density)
        path = self._paths[self._choose_path(numel, k, p.shape)]
        job = Job(key, name, p.shape, g, k, density, momentum, nesterov=nesterov)
        guard = self._guard()
        if guard == "skip":  # before anything can change the memory (region gives back)
            self._save_compressor_state(g.device)
            d.memory.snapshot(key)
        if guard is not None:
            # Sparse: a NaN the selection leaves behind would stay in the memory unseen, so
            # look at g; dense: every rank's NaN shows in the allreduced sum (synchronize).
            if path.selects and guard == "skip" and on_accelerator(g):
                # Reading the answer back would wait for the device: send inf instead when
                # g is not finite; every rank then skips and restores the snapshot.
                job = job._replace(poison=~torch.isfinite(_sum(g)))
            elif (path.selects or guard == "drop") and not _finite(g):
                return self._prepare_nonfinite(path, job, guard)
        if path.reduces_first:  # hierarchical: the memory gets the host's sum (paths.py)
            return Item(path.name, job, path.take(job), scale)
        if path.selects and self._compression.wants_block_max(g.device):
            v, block_max = d.memory.accumulate(key, g, momentum, nesterov, with_block_max=True)
            job = job._replace(v=v, block_max=block_max)
        else:
            job = job._replace(v=d.memory.accumulate(key, g, momentum, nesterov))
        return Item(path.name, job, path.take(job), scale)

    def _prepare_local(self, job):
        """A step between exchanges (period > 1): the memory accumulates, nothing is sent;
        this rank steps with what its memory just took in (the exchange replaces it later).
        A non-finite gradient stays out of the memory and this rank applies zeros."""
        d = self._dgc
        if d.skip_nonfinite and not _finite(job.v):
            self._dropped.append(job.name)
            return Item(LOCAL, job, None, None, torch.zeros_like(job.v))
        d.memory.accumulate(job.key, job.v, job.momentum, job.nesterov)
        return Item(LOCAL, job, None, None, d.memory.increment(job.key, job.v, job.nesterov))

    def _prepare_sparse_grad(self, p, scale):
        """A sparse gradient travels as Horovod sends it: its indices and values,
        allgathered; DGC's memory never sees it. Coalesced first (a batch that looks a
        row up twice sends it once). A non-finite value shows in every rank's sum."""
        d, name = self._dgc, self._parameter_names[p]
        if d.keeps_own:
            raise ValueError(
                f"hvd_dgc: parameter '{name}' has a sparse gradient (e.g. "
                f"nn.Embedding(sparse=True)) and delay={d.delay}, period={d.period}: "
                f"delayed averaging and temporally sparse updates need dense gradients. "
                f"Pass sparse_as_dense=True to DistributedOptimizer, or delay=0 and "
                f"period=1.")
        g = p.grad.coalesce()
        if scale is not None:
            g = g / scale
        indices, values = g.indices().t().contiguous(), g.values()
        sent = indices.numel() * indices.element_size() + values.numel() * values.element_size()
        d.stats.record(name, SPARSE_GRAD, p.numel(), values.numel(), sent,
                       values.numel() / max(1, p.numel()))
        job = Job(self._param_index[p], name, p.shape, values, 0, 1.0)
        return Item(SPARSE_GRAD, job, (indices, values), scale)

    def _guard(self):
        """How this step treats a non-finite gradient: "skip" (every rank skips the step
        and the memory is restored), "drop" (delay > 0 or period > 1: the rank that has it
        sends zeros) or None (skip_nonfinite=False and no GradScaler: it goes through)."""
        d = self._dgc
        if d.grad_scaler is not None and d.grad_scaler.is_enabled():
            return "skip"
        if not d.skip_nonfinite:
            return None
        return "drop" if d.keeps_own else "skip"

    def _prepare_nonfinite(self, path, job, guard):
        """A non-finite local gradient stays out of the memory. "skip": send inf, so every
        rank sees a non-finite update and skips the step; "drop" (delayed averaging, where
        the other ranks applied this step's own contribution already): send zeros."""
        value = float("inf") if guard == "skip" else 0.0
        own = None
        if guard == "drop":
            own = torch.zeros_like(job.v)
            self._dropped.append(job.name)
        return Item(path.name, job, path.placeholder(job, value), None, own)

    def _save_compressor_state(self, device):
        """The sampler's RNG as it was before this step, for a step that gets skipped."""
        if self._compressor_saved is None and hasattr(self._compression, "state_dict"):
            if hasattr(self._compression, "generator"):  # they exist before they are saved
                self._compression.generator(device, _hvd.rank())
                self._compression.generator("cpu", _hvd.rank())
            self._compressor_saved = self._compression.state_dict()

    def _settle(self, nonfinite):
        """End of a guarded step. Every rank saw the same averaged updates, so every rank
        agrees on ``nonfinite``: then the step must leave no trace in the memory (or what
        was sent this step would be lost) nor in the sampler's RNG."""
        d, saved = self._dgc, self._compressor_saved
        self._compressor_saved = None
        if not nonfinite:
            d.memory.commit()
            return
        d.memory.rollback()
        d.fp16_clipped = []  # the step left no trace: nor did its clipping
        if saved is not None:
            self._compression.load_state_dict(saved, _hvd.rank())
        if d.grad_scaler is not None and d.grad_scaler.is_enabled():
            d.overflow_steps += 1  # p.grad holds inf: GradScaler.step skips step()
            return
        d.nonfinite_steps += 1
        self._skip_step = True
        warnings.warn(
            f"hvd_dgc: step {d.step}: non-finite gradient (NaN/Inf) on at least one rank in "
            f"{', '.join(nonfinite[:3])}{' ...' if len(nonfinite) > 3 else ''}; this step is "
            f"skipped on every rank (weights, DGC memory and step count unchanged; "
            f"{d.nonfinite_steps} skipped so far). Look at the learning rate, the loss or "
            f"the data; skip_nonfinite=False lets such gradients through.", RuntimeWarning)

    def _choose_path(self, numel, k, shape):
        """Same inputs on every rank, so every rank joins the same collective."""
        d = self._dgc
        if is_exchange(self._compression) and numel >= d.min_compress_size:
            return EXCHANGE if self._compression.compressible(shape, d.step) else DENSE
        if not is_sparse(self._compression) or numel < d.min_compress_size:
            return DENSE
        if self._goes_hierarchical(numel):
            return HIERARCHICAL
        return d.cost_model.choose_aggregation(
            numel, k, self._world(), 2 if d.dense_fp16 else 4, self._compression.value_bytes,
            allowed=tuple(a for a in d.aggregations if a != HIERARCHICAL) or (DENSE,))

    def _goes_hierarchical(self, numel):
        """Hierarchical DGC keeps a host's residual in slices across its ranks, flat DGC
        each rank's whole residual: a tensor cannot move between them, so the choice is
        made once per tensor (by the cost model at the final density), not per step."""
        d, peers = self._dgc, self._paths[HIERARCHICAL].wire.peers
        if not peers or HIERARCHICAL not in d.aggregations:
            return False
        if d.aggregations == (HIERARCHICAL,):
            return True
        final = getattr(d.schedule, "density", None)  # None: a callable schedule, stay flat
        if numel not in self._hierarchical and final is not None:
            self._hierarchical[numel] = d.cost_model.choose_aggregation(
                numel, num_selected(numel, final), self._world(), 2 if d.dense_fp16 else 4,
                self._compression.value_bytes, allowed=d.aggregations,
                local_size=len(peers)) == HIERARCHICAL
        return self._hierarchical.get(numel, False)

    def _launch(self, params):
        """Start the collectives for ``params`` (one tensor, one Horovod group, or the
        tensors launched together in synchronize): each path its own, in a fixed order.
        Small dense tensors ride in the launch's allgather (paths.py ``fold``)."""
        items = self._paths[SPARSE].fold([self._prepare(p) for p in params])
        name = "hvd_dgc." + self._parameter_names[params[0]]
        if self._dgc.keeps_own:  # steps in flight at once; Horovod names must be unique
            name += ".d%d" % (self._dgc.step % self._dgc.name_slots())
        parts = []
        for path_name in PATH_ORDER:
            positions = [i for i, item in enumerate(items) if item.path == path_name]
            if not positions:
                continue
            path = self._paths[path_name]
            launched = path.launch([items[i] for i in positions], name)
            if launched.sent is not None:  # delay > 0: what this rank sent (dropped: zeros)
                for i, sent in zip(positions, launched.sent):
                    if items[i].own is None:
                        items[i] = items[i]._replace(own=sent)
            parts.append(_Part(path, positions, launched.handle))
        self._dgc.stats.add_launches(len(parts))
        return _Pending(params, items, parts)

    def _advance(self, pending):
        for part in pending.parts:
            sent = part.path.advance(part.handle)
            if sent is not None and self._dgc.keeps_own:  # known only now (hierarchical)
                for i, own in zip(part.positions, sent):
                    if pending.items[i].own is None:  # a dropped gradient keeps its zeros
                        pending.items[i] = pending.items[i]._replace(own=own)

    def _collect(self, pending):
        """Wait for one launch; yield ``(p, item, averaged update as a flat tensor)``."""
        updates = [None] * len(pending.items)
        for part in pending.parts:
            for i, update in zip(part.positions, part.path.collect(part.handle)):
                updates[i] = update
        yield from zip(pending.params, pending.items, updates)

    def _set_grad(self, p, update, scale=None):
        if scale is not None:
            update = update * scale  # back to the scaled space GradScaler.unscale_ expects
        if update.is_sparse:  # a sparse gradient's average (SPARSE_GRAD)
            p.grad = update.to(p.dtype)
            self._sparse_grads.add(p)
            return
        update = update.view(p.shape).to(p.dtype)
        if p.grad is not None and p.grad.is_sparse:
            p.grad = update.to_sparse()
        elif p.grad is None:
            p.grad = update
        else:
            p.grad.copy_(update)

    def _drain(self, steps, corrections):
        """Wait for the launches of ``steps`` (``_InFlight``); add ``avg - own`` of each
        into ``corrections`` (``-own`` for a step between exchanges: no average)."""
        for entry in steps:
            for pending in entry.launches:
                for p, item, update in self._collect(pending):
                    if update is None:  # LOCAL: the exchange at the period's end covers it
                        correction = own_of(item, buffer_dtype(p.dtype)).neg_()
                    else:
                        correction = subtract_own(update, item)
                    if p in corrections:
                        corrections[p].add_(correction)
                    else:
                        corrections[p] = correction
        return corrections

    # -- Horovod's optimizer API ---------------------------------------------
    def synchronize(self, flush=False):
        """Launch what has not been launched, wait for what is due, fill ``p.grad``.

        With ``delay=D`` only the launches of D steps ago are due (``period=p``: those of
        the exchange D steps ago, and the p steps it covers); ``flush=True`` waits for
        all of them, so the step that follows leaves every rank with the same weights
        (end of training, before evaluation or a checkpoint). A flush between exchanges
        takes back this rank's own steps since the last one: its memory still holds
        them, and the next exchange sends them."""
        self._skip_step = False
        self._sparse_grads = set()
        if not self.process_set.included():
            self._synchronized = True
            return
        launched = set()
        for key, pending in self._handles.items():
            if pending is not None:
                launched.update(key if isinstance(key, tuple) else (key,))
        # Parameters whose hook has not fired (unused this step, or fewer backward
        # passes than backward_passes_per_step) still join every collective; on a GPU
        # those _batched keeps for synchronize go in one launch, and a bucket's go with
        # those of its tensors that are waiting for them (same launches on every rank).
        rest = sorted(self._requires_update - launched, key=self._param_index.get)
        for p in rest:
            self._handles.pop(p, None)
        together = tuple(p for p in rest if self._batched(p))
        if together:
            self._handles[together] = self._launch(together)
        done = set(together)
        for p in rest:
            if p in done:  # launched with its bucket just now
                continue
            bucket = self._bucket_of(p)
            if bucket is None:
                self._handles[(p,)] = self._launch((p,))
            else:
                done.update(self._launch_bucket(bucket))
        for key in [k for k, v in self._handles.items() if v is None]:
            del self._handles[key]
        launches = list(self._handles.values())
        self._handles.clear()
        # Second rounds (PowerSGD's Q, TernGrad's sum) start on every launch before any is
        # waited on, so no rank can wait on one that another rank has not started.
        for pending in launches:
            self._advance(pending)
        d = self._dgc
        if not d.keeps_own:
            guarded, sums = self._guard() == "skip", []
            for pending in launches:
                for p, item, update in self._collect(pending):
                    if guarded:
                        sums.append((self._parameter_names[p], _sum(update)))
                    self._set_grad(p, update, item.scale)
            if guarded:  # one read-back for the whole step, not one per tensor
                self._settle(_nonfinite_names(sums))
        else:
            # DGA: apply this rank's own contribution now, and the average of the step
            # launched `delay` steps ago in place of what this rank applied for it then.
            grads = {}
            for pending in launches:
                for p, item in zip(pending.params, pending.items):
                    grads[p] = own_of(item, buffer_dtype(p.dtype))
            started = time.perf_counter()
            # first in, first applied: a D lowered by delay="auto" waits for the older ones
            after = self._inflight[-1].due if self._inflight else -1
            self._inflight.append(_InFlight(max(d.applied_at(), after), launches))
            due = []
            while self._inflight and (flush or self._inflight[0].due <= d.step):
                due.append(self._inflight.popleft())
            self._drain(due, grads)
            if d.auto is not None and not flush:
                self._tune_delay(started, time.perf_counter() - started)
            for p, g in grads.items():
                self._set_grad(p, g)
            self._average_after_step = flush
            if self._dropped:
                self._dgc.nonfinite_steps += 1
                warnings.warn(
                    f"hvd_dgc: step {d.step}: non-finite gradient (NaN/Inf) in "
                    f"{', '.join(self._dropped[:3])} on rank {_hvd.rank()}: with delay="
                    f"{d.delay}, period={d.period} this rank contributes zero to the step "
                    f"and keeps it out of its memory; the other ranks have applied their own "
                    f"part already and keep it ({d.nonfinite_steps} such steps here).",
                    RuntimeWarning)
                self._dropped = []
        self._report_fp16()
        self._restart_counts()
        d.stats.end_step()
        self._synchronized = True

    def _report_fp16(self):
        """Dense fp16 values this step sent clipped (hvd_dgc/fp16wire.py): counted in the
        statistics, and a warning the first time (a skipped step's are dropped: _settle)."""
        d = self._dgc
        counts, d.fp16_clipped = d.fp16_clipped, []
        if not counts:
            return
        count = int(torch.stack([c.to(counts[0].device) for c in counts]).sum())  # one read
        if not count:
            return
        if not d.stats.fp16_clipped:
            warnings.warn(clip_warning("torch", d.step, count, self._paths[DENSE].half_bound())
                          + " Later ones are counted in compression_stats()['fp16_clipped'].",
                          RuntimeWarning)
        d.stats.add_fp16_clipped(count)

    def _restart_counts(self):
        """What the hooks count within a step, back to its start: backward passes left,
        parameters ready in each Horovod group and each bucket."""
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        for g in self._group_counts:
            self._group_counts[g] = 0
        self._bucket_ready.clear()

    def _tune_delay(self, started, waited):
        """delay="auto" (hvd_dgc/autodelay.py): measure this step, and at the end of a
        window read the previous window's agreed sums (long arrived: no wait), decide
        D from them (every rank the same, from this step on), and start agreeing on
        this window's (max over ranks, non-blocking)."""
        d, auto = self._dgc, self._dgc.auto
        if self._step_ended is not None:
            auto.observe(started - self._step_ended, waited)
        self._step_ended = time.perf_counter()
        if not auto.window_done():
            return
        sums = torch.tensor(auto.take_window(), dtype=torch.float64)
        if self._agreeing is not None:
            handle, self._agreeing = self._agreeing, None
            auto.decide(tuple(_hvd.synchronize(handle).tolist()), d.step, d.period)
        self._agreeing = _hvd.allreduce_async(sums, op=Max, process_set=self.process_set,
                                              name="hvd_dgc.autodelay.%d" % (d.step % 2))
        self._step_ended = time.perf_counter()

    @contextmanager
    def skip_synchronize(self):
        """For ``synchronize(); unscale/clip; with skip_synchronize(): step()``."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(). This can cause training "
                              "slowdown. You may want to consider using "
                              "optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.")
            self.synchronize()
        self._synchronized = False
        if self._skip_step:  # a non-finite average: every rank skips (see _settle)
            self._skip_step = False
            return None
        loss = self._base_step(closure)
        if self._average_after_step:
            self._average_parameters()
        self._dgc.step += 1
        self._dgc.maybe_log()
        return loss

    def _base_step(self, closure):
        """The wrapped optimizer's step. With SGD taken over, parameters whose update is
        a sparse gradient (no memory: nothing applied their momentum) step in a second
        call with SGD's own hyper-parameters; each call sees only its own gradients."""
        base = super(self.__class__, self)
        sparse, self._sparse_grads = self._sparse_grads, set()
        if not (self._takes_over_sgd and sparse):
            with self._sgd_hyperparameters_off():
                return base.step(closure)
        with _grads_hidden(sparse):
            with self._sgd_hyperparameters_off():
                loss = base.step(closure)
        others = [p for p in self._param_index if p not in sparse and p.grad is not None]
        with _grads_hidden(others):
            base.step()
        return loss

    @contextmanager
    def _sgd_hyperparameters_off(self):
        """The memory applied momentum and weight decay already; the base SGD must not."""
        if not self._takes_over_sgd:
            yield
            return
        saved = [{k: g[k] for k in _TAKEN_OVER} for g in self.param_groups]
        try:
            for g in self.param_groups:
                g["momentum"], g["weight_decay"], g["nesterov"] = 0.0, 0.0, False
            yield
        finally:
            for g, s in zip(self.param_groups, saved):
                g.update(s)

    def zero_grad(self, set_to_none=True):
        if self._handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() "
                                 "but before optimizer.step() or optimizer.synchronize(). "
                                 "This is prohibited as it can cause a race condition.")
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)

    def set_backward_passes_per_step(self, passes):
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    # -- hvd_dgc's additions ---------------------------------------------------
    def set_epoch(self, epoch):
        """Drive an epoch-based warm-up (call at the start of each epoch, on every rank)."""
        self._dgc.epoch = float(epoch)

    def flush(self):
        """Drain delayed averaging: wait for every step still in flight, apply its
        average in place of this rank's own contribution, and leave every rank with
        identical weights. Call after ``step()``; a no-op when nothing is in flight."""
        if self._handles:
            raise RuntimeError("hvd_dgc: flush() was called between backward() and step(); "
                               "call it after optimizer.step() (or use "
                               "optimizer.synchronize(flush=True) before step()).")
        if not self._inflight:
            return
        corrections = self._drain(list(self._inflight), {})  # all: none is due yet
        self._inflight.clear()
        self._step_ended = None  # delay="auto": the flush is not a step's compute
        saved = {p: p.grad for p in corrections}
        try:
            for p, c in corrections.items():
                p.grad = c.view(p.shape).to(p.dtype)
            with self._sgd_hyperparameters_off():  # lr * correction, linear: see module doc
                super(self.__class__, self).step()
        finally:
            for p, g in saved.items():
                p.grad = g
        self._average_parameters()

    def _average_parameters(self):
        """Mathematically equal after a flush, the ranks' weights still differ in float
        rounding (each summed its corrections in its own order): average them once."""
        self._average_after_step = False
        params = sorted(self._requires_update, key=self._param_index.get)
        if params and self._world() > 1:
            _hvd.grouped_allreduce_([p.data for p in params], name="hvd_dgc.flush",
                                    op=Average, process_set=self.process_set)

    @property
    def in_flight(self):
        """Number of steps whose averages have not been applied yet (delay > 0, or
        period > 1 between exchanges)."""
        return len(self._inflight)

    @property
    def density(self):
        """Density the next step will use."""
        return self._dgc.density()

    def compression_stats(self):
        """Bytes sent vs dense fp32, density and path counts (this rank), as a dict."""
        out = self._dgc.stats.summary()
        d = self._dgc
        out.update(step=d.step, epoch=d.epoch, current_density=self.density,
                   world_size=self._world(), overflow_steps=d.overflow_steps,
                   nonfinite_steps=d.nonfinite_steps, delay=d.delay, period=d.period)
        if d.auto is not None:
            out.update(delay_decisions=list(d.auto.decisions))
        return out

    def state_dict(self):
        if self._inflight:
            raise RuntimeError(
                f"hvd_dgc: {len(self._inflight)} step(s) await an average (delay="
                f"{self._dgc.delay}, period={self._dgc.period}); their averages cannot be "
                f"saved. Call optimizer.flush() after step() before optimizer.state_dict().")
        state = super(self.__class__, self).state_dict()
        state[STATE_KEY] = self._dgc.state_dict()
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        dgc_state = state_dict.pop(STATE_KEY, None)
        for launches in self._inflight:  # Horovod must finish them; their results are moot
            for pending in launches.launches:
                try:
                    for _ in self._collect(pending):
                        pass
                except Exception:  # noqa: BLE001  from a Horovod since shut down (elastic)
                    pass
        self._inflight.clear()
        if self._agreeing is not None:  # delay="auto": a window's agreement, now moot
            try:
                _hvd.synchronize(self._agreeing)
            except Exception:  # noqa: BLE001  from a Horovod since shut down (elastic)
                pass
        self._agreeing, self._step_ended = None, None
        self._handles = {}
        self._restart_counts()  # a step cut short (elastic reset) starts counting afresh
        self._dgc.memory.commit()  # a step cut short (elastic reset) has nothing to undo
        self._skip_step, self._compressor_saved, self._dropped = False, None, []
        self._synchronized = False
        self._should_synchronize = True
        super(self.__class__, self).load_state_dict(state_dict)
        if dgc_state is None:
            warnings.warn("hvd_dgc: the loaded optimizer state has no hvd_dgc entry (a plain "
                          "Horovod/torch checkpoint?); residuals and velocities start at zero.")
            return
        index_to_param = {i: p for p, i in self._param_index.items()}
        self._dgc.load_state_dict(dgc_state, lambda key: index_to_param[key].device,
                                  _hvd.rank())

    @property
    def _group_of(self):
        lookup = getattr(self, "_group_of_cache", None)
        if lookup is None:
            lookup = {p: g for g in self.param_groups for p in g["params"]}
            self._group_of_cache = lookup
        return lookup


class DGCState:
    """Every hvd_dgc knob and buffer of one optimizer, kept apart from the base
    optimizer's state so ``hvd.broadcast_optimizer_state`` (which broadcasts
    rank 0's ``state``) never overwrites a rank's own residual."""

    def __init__(self, config, schedule, compression, dense_compression, grad_scaler=None,
                 fusion_threshold=HOROVOD_FUSION_DEFAULT):
        self.config = config  # the options as given (hvd_dgc/config.py); the rest is state
        self.schedule = schedule
        self.fusion_threshold = fusion_threshold
        self.aggregation = config.aggregation
        self.aggregations = AGGREGATION_OPTIONS[config.aggregation]
        auto_delay = config.auto_delay
        self.auto = None if auto_delay is None else AutoDelayState(auto_delay)
        self._delay = config.fixed_delay or 0
        self.period = config.period
        self.period_delay = None    # the delay of the period under way (applied_at)
        self.skip_nonfinite = config.skip_nonfinite
        self.compression = compression
        self.dense_compression = dense_compression
        self.dense_fp16 = dense_compression is Compression.fp16 or compression is Compression.fp16
        self.memory = DGCMemory(config.momentum_masking)
        self.cost_model = config.cost_model or CostModel()
        self.min_compress_size = config.min_compress_size
        self.clip_norm = config.clip_norm
        self.grad_scaler = grad_scaler
        self.log_every = config.log_every
        self.stats = CompressionStats()
        self.step = 0
        self.epoch = 0.0
        self.overflow_steps = 0    # GradScaler overflows (steps skipped by the scaler)
        self.nonfinite_steps = 0   # skip_nonfinite: steps skipped (delay > 0: dropped here)
        self.fp16_clipped = []     # this step's counts of dense fp16 values clipped (device)

    def density(self):
        return self.schedule(self.step, self.epoch) if is_sparse(self.compression) else 1.0

    @property
    def delay(self):
        """The D in force: the fixed one, or delay="auto"'s last decision."""
        return self._delay if self.auto is None else self.auto.delay

    @delay.setter
    def delay(self, value):
        if self.auto is None:
            self._delay = value
        else:
            self.auto.delay = value

    def describe_delay(self):
        if self.auto is None:
            return self.delay
        return f"auto (from {self.auto.config.start}, at most {self.auto.config.max_delay})"

    def name_slots(self):
        """How many steps' collectives may be in flight at once (their names differ)."""
        return (self.delay if self.auto is None else self.auto.config.max_delay) + 1

    @property
    def keeps_own(self):
        """Whether a step applies this rank's own contribution before the average comes."""
        return self.delay > 0 or self.period > 1

    def exchanges_now(self):
        """Whether this step exchanges: every ``period``-th (the same step on every rank,
        as ``step`` is; it comes back with checkpoints and elastic commits)."""
        return (self.step + 1) % self.period == 0

    def applied_at(self):
        """The step that applies the average covering this one: the period's exchange,
        ``delay`` steps after it (the delay in force when the period began: a change
        by delay="auto" waits for the next period, so a period's steps stay together)."""
        if self.step % self.period == 0 or self.period_delay is None:
            self.period_delay = self.delay
        return self.step + (-(self.step + 1)) % self.period + self.period_delay

    def loss_scale(self):
        """The GradScaler's scale as a tensor: ``get_scale()`` reads it back from the device,
        which would wait for the device once per tensor. A copy, as ``update()`` changes it
        in place."""
        read = getattr(self.grad_scaler, "_get_scale_async", None)
        scale = read() if read is not None else None
        return self.grad_scaler.get_scale() if scale is None else scale.detach().clone()

    def maybe_log(self):
        if self.log_every and self.step % self.log_every == 0 and _hvd.rank() == 0:
            print(f"[hvd_dgc] step {self.step} density={self.density():.4g} "
                  f"{self.stats.format()}", flush=True)

    def state_dict(self):
        comp = self.compression.state_dict() if hasattr(self.compression, "state_dict") else {}
        return {"version": STATE_VERSION, "step": self.step, "epoch": self.epoch,
                "rank": _hvd.rank(), "memory": self.memory.state_dict(),
                "compressor": comp, "stats": self.stats.state_dict(),
                "overflow_steps": self.overflow_steps, "nonfinite_steps": self.nonfinite_steps,
                "delay": self.delay}

    def load_state_dict(self, state, device_of, rank):
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"hvd_dgc state version {state.get('version')!r} is not "
                             f"{STATE_VERSION}; this checkpoint was written by another "
                             f"hvd_dgc release")
        if state.get("rank", rank) != rank:
            warnings.warn(f"hvd_dgc: rank {rank} is loading the DGC memory that rank "
                          f"{state['rank']} saved. Residuals are per rank: save and load one "
                          f"file per rank (e.g. 'ckpt.rank{{hvd.rank()}}.pt'), or every rank "
                          f"resends rank {state['rank']}'s residual.")
        self.step, self.epoch = state["step"], state["epoch"]
        self.memory.load_state_dict(state["memory"], device_of)
        if hasattr(self.compression, "load_state_dict") and state["compressor"]:
            self.compression.load_state_dict(state["compressor"], rank)
        self.stats.load_state_dict(state["stats"])
        self.overflow_steps = state.get("overflow_steps", 0)
        self.nonfinite_steps = state.get("nonfinite_steps", 0)
        if self.auto is not None:  # delay="auto" goes on from the D it had reached
            self.resume_delay(int(state.get("delay", self.delay)))

    def resume_delay(self, delay):
        """Go on from ``delay`` (a checkpoint's, or rank 0's after an elastic reset); with
        delay="auto", from a fresh window of measurements (the old ones were another run's
        or another world's)."""
        self.delay = delay
        if self.auto is not None:
            self.auto.reset_window()


# -- helpers -------------------------------------------------------------------
def _sum(t):
    """Sum of ``t`` as a device scalar: non-finite iff ``t`` holds a NaN/Inf (one pass, no
    mask tensor; ~30x cheaper than ``isfinite(t).all()`` on a CPU). A finite tensor whose
    sum overflows counts as non-finite."""
    if t.is_sparse:
        t = t._values()
    return t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32)


@contextmanager
def _grads_hidden(params):
    """``p.grad = None`` for ``params`` meanwhile: torch's optimizers skip them."""
    saved = {p: p.grad for p in params}
    try:
        for p in saved:
            p.grad = None
        yield
    finally:
        for p, g in saved.items():
            p.grad = g


def _finite(t):
    return bool(torch.isfinite(_sum(t)))


def _nonfinite_names(sums):
    """Names whose sum is not finite, from ``[(name, device scalar)]``: one read-back per
    device instead of one per tensor."""
    by_device = {}
    for name, total in sums:
        by_device.setdefault(total.device, []).append((name, total))
    bad = []
    for pairs in by_device.values():
        finite = torch.isfinite(torch.stack([total for _, total in pairs])).tolist()
        bad += [name for (name, _), ok in zip(pairs, finite) if not ok]
    return bad


def _describe(compression):
    if hasattr(compression, "config"):
        return repr(compression.config())
    return getattr(compression, "__name__", type(compression).__name__)


def _name_parameters(named_parameters, param_groups):
    if named_parameters is not None:
        named_parameters = list(named_parameters)
    else:
        named_parameters = [(f"allreduce.noname.{i}.{j}", v)
                            for i, group in enumerate(param_groups)
                            for j, v in enumerate(group["params"])]
    if any(not isinstance(p, tuple) for p in named_parameters):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         "usually produced by model.named_parameters().")
    seen, dups = set(), set()
    for name, _ in named_parameters:
        (dups if name in seen else seen).add(name)
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. "
                         "Found duplicates: %s" % ", ".join(sorted(dups)))
    named_ids = {id(v) for _, v in named_parameters}
    unnamed = [p for g in param_groups for p in g["params"] if id(p) not in named_ids]
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters "
                         "were not named (shapes: %s). Pass model.named_parameters() for the "
                         "whole model the optimizer holds."
                         % ", ".join(str(tuple(p.shape)) for p in unnamed))
    return {v: k for k, v in named_parameters}


def _check_dtypes(param_groups, names):
    for group in param_groups:
        for p in group["params"]:
            if p.requires_grad and not (p.is_floating_point() and not p.is_complex()):
                raise TypeError(f"hvd_dgc: parameter '{names[p]}' has dtype {p.dtype}; DGC "
                                f"compresses real floating-point gradients only (float16, "
                                f"bfloat16, float32, float64). Leave it out of the optimizer "
                                f"or set requires_grad=False.")


def _check_dampening(group):
    if group.get("momentum", 0) and group.get("dampening", 0):
        raise ValueError(f"hvd_dgc: SGD dampening={group['dampening']} is not supported: DGC's "
                         f"momentum correction accumulates u = m*u + g. Use dampening=0.")


def _host_peers(dgc, process_set):
    """The global ranks sharing this rank's host, sorted, where hierarchical DGC may run
    (several hosts of several ranks, the global process set, not elastic); else ().
    One allgather at wrap time, after the config check (every rank gets here alike)."""
    if HIERARCHICAL not in dgc.aggregations or not is_sparse(dgc.compression):
        return ()
    forced = dgc.aggregations == (HIERARCHICAL,)
    local, cross = _hvd.local_size(), _hvd.cross_size()
    problem = None
    if not (local > 1 and cross > 1):
        problem = (f"it needs several hosts of several ranks each, and this job has "
                   f"{cross} host(s) with local_size={local} (horovodrun -H host1:4,host2:4)")
    elif process_set.process_set_id != global_process_set.process_set_id:
        problem = "it runs on the global process set only"
    elif os.environ.get("HOROVOD_ELASTIC") == "1":  # a collective at wrap time would hang
        problem = "it does not run under elastic Horovod yet"
    elif dgc.period > 1:  # its memory holds the host's sum: no own step to take back
        problem = f"it does not run with period={dgc.period} (use period=1)"
    if problem:
        if forced:
            raise ValueError(f"aggregation='hierarchical': {problem}. Use aggregation='auto' "
                             f"(hierarchical where it applies) or 'flat'.")
        return ()
    hosts = _hvd.allgather(torch.tensor([_hvd.cross_rank()], dtype=torch.int64),
                           name="hvd_dgc.hosts", process_set=process_set).tolist()
    return tuple(r for r, h in enumerate(hosts) if h == _hvd.cross_rank())


def _fusion_threshold(value):
    """``fusion_threshold`` in bytes: the option (checked by DGCConfig), else Horovod's
    environment variable, else Horovod's default."""
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


def _check_consistent_config(config, process_set):
    """One allgather at wrap time (see hvd_dgc/consistency.py)."""
    mine = torch.frombuffer(bytearray(consistency.encode(config)), dtype=torch.uint8)
    sizes = _hvd.allgather(torch.tensor([mine.numel()], dtype=torch.int64),
                           name="hvd_dgc.config.size", process_set=process_set)
    everything = _hvd.allgather(mine, name="hvd_dgc.config", process_set=process_set)
    configs = consistency.decode_all(sizes.tolist(), everything.numpy().tobytes())
    ranks = process_set.ranks if process_set.ranks else list(range(len(configs)))
    consistency.check_same(configs, ranks, "DistributedOptimizer")


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.dgc,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=global_process_set, *, dense_compression=None,
                         grad_scaler=None, **options):
    """Wrap a torch optimizer so it averages gradients with DGC over Horovod.

    Horovod's arguments keep their meaning (see horovod.torch.DistributedOptimizer).
    ``compression`` defaults to ``Compression.dgc``. Horovod's ``Compression.none`` /
    ``Compression.fp16``, which Horovod's example scripts pass explicitly, keep their
    meaning of how values travel: DGC with fp32 / fp16 values (hvd_dgc/switch.py); a
    compressor's name ("dgc", "topk", ...) works too. Dense averaging is asked for
    explicitly with ``density=1.0`` (through the memory, so the maths is unchanged at
    any world size). ``Compression.powersgd``, ``sign``, ``terngrad``, ``qsgd`` and
    ``bf16`` run their own collectives (collective.py), with error feedback through the
    same memory. Rank 0 prints one line at wrap time saying what runs. hvd_dgc's options,
    keyword only, the same for TensorFlow and Keras (checked by hvd_dgc.config.DGCConfig;
    an unknown one is refused, with the closest name):

    Args:
        density: fraction of each large tensor sent per step (default 0.001), a
            ``hvd_dgc.DensitySchedule``, or a callable ``f(step, epoch)``.
        warmup: warm-up length in ``warmup_unit`` ("epoch", driven by
            ``optimizer.set_epoch(e)``, or "step"); densities fall through
            ``warmup_densities`` (default the paper's 25%, 6.25%, 1.5625%, 0.4%).
            With neither ``density`` nor ``warmup`` given: the paper's stages by
            steps, each as long as density * step >= 10 allows (0.1% from step 10000;
            hvd_dgc.schedule.DEFAULT_SENDS; 40 and step 40000 for optimizers other
            than SGD, ADAPTIVE_SENDS); ``warmup=0`` for none.
        min_compress_size: tensors with fewer elements always go dense (biases,
            norm layers: the paper sends them dense).
        momentum_masking: zero the momentum of sent coordinates: True (always, as the
            paper), False, or "auto" (default: only at densities where the momentum tail
            it drops is small, <= 1.1% at momentum 0.9; hvd_dgc/masking.py).
        clip_norm: local per-tensor gradient clipping at ``clip_norm / sqrt(N)``.
        dense_compression: ``Compression.none`` or ``Compression.fp16`` for the
            dense path (fp16's rounding error stays in the residual); default: fp16
            with ``compression=Compression.fp16``, else none.
        cost_model: ``hvd_dgc.CostModel(alpha, bandwidth)`` choosing per tensor per
            step among dense allreduce, sparse allgather and region reduce.
        aggregation: how sparse tensors are summed: "auto" (the cost model's choice),
            "allgather" (every rank's records to every rank: k(N-1) records received
            per worker), "region" (region reduce, after Ok-Topk: ~3k(N-1)/N, flat in
            N; what an owner does not keep stays in its memory), "hierarchical"
            (several hosts of several ranks: the gradient summed densely inside each
            host, about k/L records per rank across hosts; each host's residual kept in
            slices by its ranks), "flat" (the cost model's choice without
            hierarchical), or "dense". A forced method runs even at density 1 (the
            equivalence with dense averaging); tensors below ``min_compress_size`` stay
            dense.
        grad_scaler: the ``torch.amp.GradScaler`` in use, so the memory holds
            unscaled gradients and overflowed steps never enter it.
        log_every: print compression statistics on rank 0 every N steps.
        delay: delayed gradient averaging (DGA): step i waits only for the
            collectives of step i-D and applies ``own_i - own_(i-D) + avg_(i-D)``,
            so D steps of compute hide each round trip. 0 is synchronous. "auto":
            D chosen from the measured compute and exchange times, adapted as
            training goes, the same on every rank (hvd_dgc/autodelay.py; at most 8
            steps, ``hvd_dgc.AutoDelay(max_delay=...)`` to change that); the D in
            force is ``compression_stats()["delay"]``. Needs ``torch.optim.SGD``;
            call ``optimizer.flush()`` (or ``synchronize(flush=True)``) before
            evaluating or checkpointing.
        period: temporally sparse updates: exchange every ``period``-th step only; in
            between each rank steps with its own velocity and its memory keeps
            accumulating; the exchange's average then replaces those own steps (module
            doc). 1 exchanges every step. Composes with ``delay`` and any aggregation
            but hierarchical; needs ``torch.optim.SGD``; ``flush()`` before evaluating
            or checkpointing, as with delay.
        fusion_threshold: bytes on the wire of one launch. With a sparse compressor,
            tensors ready one after another in backward wait for each other and leave
            together, up to this many bytes (their records; a dense tensor's values), so
            a step takes as few of Horovod's negotiation rounds as it can: on a slow
            link each costs round trips. None (default): Horovod's own,
            ``HOROVOD_FUSION_THRESHOLD`` (``horovodrun --fusion-threshold-mb``), 64 MiB
            if unset; 0: each tensor leaves from its own hook.
        skip_nonfinite: a NaN/Inf gradient on any rank never enters the memory, and
            the step is skipped on every rank (weights, memory, step count unchanged;
            counted in ``compression_stats()["nonfinite_steps"]``, with a warning).
            Costs a summing pass per tensor and two copies of the memory per step
            (what ``rollback`` restores). With ``delay > 0`` the rank that has it sends
            zeros for that step instead (the others applied their part already).

    With ``torch.optim.SGD`` the memory applies SGD's momentum (momentum
    correction) and weight decay, and the base step runs with both switched off.

    Sparse gradients (``nn.Embedding(sparse=True)``) travel as in Horovod: their rows
    allgathered and averaged, no DGC (they are sparse already), their momentum applied
    by the base SGD; ``sparse_as_dense=True`` densifies them first, and they then go
    through DGC like any dense gradient.
    """
    config = DGCConfig.from_options(options, "torch", "DistributedOptimizer")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be "
                      "removed in v0.23.0.", DeprecationWarning)
        if groups is None:
            groups = num_groups
    check_horovod_arguments(op, gradient_predivide_factor, backward_passes_per_step, groups,
                            (Average, Sum, Adasum), "torch.Tensor")
    if isinstance(groups, list):
        seen = set()
        for group in groups:
            for p in group:
                if not isinstance(p, torch.Tensor):
                    raise ValueError("groups must consist of torch.Tensor.")
                if id(p) in seen:
                    raise ValueError("A parameter can only appear once in groups.")
                seen.add(id(p))
    choice = resolve_compression(compression, Compression,
                                 (SparseCompressor, ExchangeCompressor), "torch")
    compression = choice.compressor
    if choice.fp16:
        compression = compression(fp16_values=True)
    if dense_compression is None:
        dense_compression = Compression.fp16 if choice.fp16 else Compression.none
    if dense_compression not in (Compression.none, Compression.fp16):
        raise ValueError("dense_compression must be Compression.none or Compression.fp16, got "
                         f"{dense_compression!r}")
    check_linear_update(config, isinstance(optimizer, torch.optim.SGD),
                        type(optimizer).__name__, "torch")
    lagging, undo = config.lagging, config.undo_lagging
    if lagging and grad_scaler is not None:
        raise ValueError(f"{lagging} with grad_scaler is not supported: an overflow seen "
                         f"steps later cannot be undone. Use {undo} with mixed precision.")
    aggregation_choices(config.aggregation, is_sparse(compression), _describe(compression),
                        "hvd_dgc.torch.Compression.dgc")
    density, warmup = config.density, config.warmup
    if is_sparse(compression) and dense_requested(density, warmup) \
            and config.aggregation not in ("allgather", "region", "hierarchical"):
        compression, schedule = Compression.none, as_schedule(1.0)
    elif is_sparse(compression):
        # A copy per optimizer: the sampler's RNG state belongs to one optimizer's
        # checkpoint, not to the shared Compression.dgc default.
        compression = compression()
        schedule = as_schedule(density, warmup, config.warmup_unit, config.warmup_densities,
                               adaptive=not isinstance(optimizer, torch.optim.SGD))
    else:
        if density is not None or warmup:
            raise ValueError(f"density/warmup apply to sparse compressors, but compression="
                             f"{_describe(compression)} is dense. Use compression="
                             f"hvd_dgc.torch.Compression.dgc to sparsify.")
        schedule = as_schedule(1.0)
    if is_exchange(compression):
        if lagging and not compression.sent_at_launch:
            raise ValueError(f"{lagging} does not work with compression={compression!r}: "
                             f"what this rank sent is known only after its first allreduce, "
                             f"and a later correction needs it at once. Use {undo}, or a "
                             f"one-round compressor (Compression.sign, qsgd, bf16, dgc).")
        compression = compression()  # a copy per optimizer: Q, RNG state (checkpointed)
    dgc = DGCState(config, schedule, compression, dense_compression, grad_scaler,
                   _fusion_threshold(config.fusion_threshold))
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_DistributedOptimizer.__dict__))
    wrapped = cls(optimizer.param_groups, named_parameters, compression,
                  backward_passes_per_step, op, gradient_predivide_factor, groups,
                  sparse_as_dense, process_set, dgc)
    if process_set.included():
        wrapped._announce()
    return wrapped

