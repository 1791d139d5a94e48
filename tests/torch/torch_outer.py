"""The outer loop (``outer=hvd_dgc.OuterLoop(...)``) on every rank: bodies of
tests/torch/test_outer.py, run under horovodrun."""

import copy

import horovod.torch as horovod_torch
import numpy as np
import torch
from torch import nn

import hvd_dgc.torch as hvd
from tests import reference as ref
from tests.torch.torch_dgc import flat_params, loss_of, mlp, ranks_identical, wide_mlp


class Quadratic(nn.Module):
    """Two tensors pulled towards per-rank, per-step targets: the gradient is ``x - T``,
    so tests/torch/test_outer.py replays the inner steps in NumPy."""

    def __init__(self):
        super().__init__()
        rng = np.random.RandomState(7)
        self.w = nn.Parameter(torch.from_numpy(rng.randn(40, 50).astype(np.float32)))
        self.b = nn.Parameter(torch.from_numpy(rng.randn(30).astype(np.float32)))

    def loss(self, step, rank):
        tw, tb = ref.outer_targets(step, rank)
        return 0.5 * ((self.w - torch.from_numpy(tw)) ** 2).sum() + \
            0.5 * ((self.b - torch.from_numpy(tb)) ** 2).sum()


class Launched:
    """Counts the Horovod operations launched inside it (Horovod's own functions still
    run: this only counts the calls)."""

    NAMES = ("allreduce_async_", "allgather_async")

    def __init__(self):
        self.counts = dict.fromkeys(self.NAMES, 0)

    def __enter__(self):
        self.saved = {n: getattr(horovod_torch, n) for n in self.NAMES}
        for name, real in self.saved.items():
            setattr(horovod_torch, name, self._counted(name, real))
        return self

    def _counted(self, name, real):
        def call(*args, **kwargs):
            self.counts[name] += 1
            return real(*args, **kwargs)
        return call

    def __exit__(self, *exc):
        for name, real in self.saved.items():
            setattr(horovod_torch, name, real)


def _quadratic(tag, steps, lr, **options):
    model = Quadratic()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                   named_parameters=model.named_parameters(), **options)
    start = flat_params(model).tolist()
    with Launched() as launched:
        for step in range(steps):
            opt.zero_grad()
            model.loss(step, hvd.rank()).backward()
            opt.step()
    out = {"start": start, "final": flat_params(model).tolist(), "launched": launched.counts,
           "identical": ranks_identical(model, f"outer.q.{tag}"),
           "stats": opt.compression_stats()}
    opt.flush()
    out.update(flushed=flat_params(model).tolist(), flushed_stats=opt.compression_stats(),
               identical_after_flush=ranks_identical(model, f"outer.qf.{tag}"))
    return out


def reference_quadratic():
    outer = hvd.OuterLoop(steps=3, lr=0.7, momentum=0.9, nesterov=True)
    return {name: _quadratic(name, steps, 0.1, outer=outer._replace(**changes), **options)
            for name, (steps, changes, options, _) in ref.OUTER_RUNS.items()}


def sync_equivalence():
    """H = 1, the change sent whole, outer SGD of lr 1: synchronous training."""
    outer_model, sync_model = mlp(seed=3), mlp(seed=3)
    outer = hvd.DistributedOptimizer(
        torch.optim.SGD(outer_model.parameters(), lr=0.05),
        named_parameters=outer_model.named_parameters(),
        outer=hvd.OuterLoop(steps=1, lr=1.0, momentum=0.0, nesterov=False))
    sync = hvd.DistributedOptimizer(torch.optim.SGD(sync_model.parameters(), lr=0.05),
                                    named_parameters=sync_model.named_parameters(),
                                    density=1.0)
    diffs, identical = [], []
    for step in range(12):
        for model, opt in ((outer_model, outer), (sync_model, sync)):
            opt.zero_grad()
            loss_of(model, step, hvd.rank()).backward()
            opt.step()
        diffs.append(float((flat_params(outer_model) - flat_params(sync_model)).abs().max()))
        identical.append(ranks_identical(outer_model, f"outer.sync.{step}"))
    moved = float((flat_params(outer_model) - flat_params(mlp(seed=3))).abs().max())
    return {"diffs": diffs, "identical": identical, "moved": moved}


def adamw_trains():
    """AdamW inside, 4 inner steps a round, 5% of each large tensor's change sent."""
    model = wide_mlp(seed=5)
    opt = hvd.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01),
        named_parameters=model.named_parameters(), outer=hvd.OuterLoop(steps=4),
        density=0.05, min_compress_size=1000)
    hvd.broadcast_optimizer_state(opt, root_rank=0)  # as Horovod's examples do
    log = []
    for step in range(40):
        opt.zero_grad()
        # four batches per rank, seen again and again: something to learn
        loss = loss_of(model, step % 4, hvd.rank(), features=64, classes=10)
        loss.backward()
        opt.step()
        log.append({"step": step + 1, "loss": float(loss),
                    "identical": ranks_identical(model, f"outer.adamw.{step}")})
    return {"log": log, "stats": opt.compression_stats(),
            "numels": [p.numel() for p in model.parameters()]}


def checkpoint_resumes_exactly():
    """A checkpoint in the middle of a round (anchor, outer momentum, residual, the
    inner optimizer's state) resumes bit for bit."""
    def build(seed=4):
        model = mlp(seed=seed)
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
            named_parameters=model.named_parameters(), outer=hvd.OuterLoop(steps=4),
            density=0.1, min_compress_size=100)
        return model, opt

    def train(model, opt, steps):
        for step in steps:
            opt.zero_grad()
            loss_of(model, step, hvd.rank()).backward()
            opt.step()

    model, opt = build()
    train(model, opt, range(6))
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    train(model, opt, range(6, 14))
    resumed_model, resumed_opt = build(seed=9)
    resumed_model.load_state_dict(saved[0])
    resumed_opt.load_state_dict(saved[1])
    train(resumed_model, resumed_opt, range(6, 14))
    return {"equal": torch.equal(flat_params(model), flat_params(resumed_model)),
            "rounds": resumed_opt.compression_stats()["rounds"],
            "inner": resumed_opt.compression_stats()["inner_steps"]}


def overlap_checkpoint_needs_flush():
    model = mlp(seed=2)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters(),
        outer=hvd.OuterLoop(steps=2, overlap=True))
    for step in range(4):
        opt.zero_grad()
        loss_of(model, step, hvd.rank()).backward()
        opt.step()
    try:
        opt.state_dict()
        refused = "NO EXCEPTION"
    except RuntimeError as exc:
        refused = str(exc)
    opt.flush()
    return {"refused": refused, "saved": "hvd_dgc_outer" in opt.state_dict(),
            "identical": ranks_identical(model, "outer.ovck")}


def elastic_sync_takes_rank_0s_round():
    """``hvd.elastic.TorchState``'s sync (what a reset runs on every rank): a rank that
    joins, here rank 1 with other weights and fewer steps, takes rank 0's anchor, outer
    momentum and step count."""
    model = mlp(seed=6 + hvd.rank())
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters(), outer=hvd.OuterLoop(steps=2))
    for step in range(5 if hvd.rank() == 0 else 0):  # rank 0 alone: no round
        opt.zero_grad()
        loss_of(model, step, 0).backward()
        super(opt.__class__, opt).step()
        opt._inner += 1
    if hvd.rank() == 0:  # a round's results, as if it had had a partner
        opt._take_anchor()
        opt._buffer = torch.ones_like(opt._anchor)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, epoch=0)
    state.sync()
    mine = torch.cat([opt._anchor, opt._buffer, torch.tensor([float(opt._inner)], device=opt._anchor.device)])
    every = hvd.allgather(mine.unsqueeze(0), name="outer.elastic")
    return {"same": torch.equal(every[0], every[1]), "inner": opt._inner,
            "weights_identical": ranks_identical(model, "outer.elastic.w")}


def suite(names):
    from tests.torch.torch_dgc import suite as run_suite
    return run_suite(names, module=__import__(__name__, fromlist=["_"]))
