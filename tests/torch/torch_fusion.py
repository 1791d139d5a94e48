"""Scenarios for hvd_dgc's buckets (``fusion_threshold``), run on every rank under
horovodrun (tests/torch/test_fusion.py): a step's tensors leave in one launch per
bucket, and the training is the same, bit for bit, as with one launch per tensor."""

import os

import torch
import torch.nn as nn

import hvd_dgc.torch as hvd
from hvd_dgc.packing import index_bytes
from tests.device import device, sparse_momentum_deterministic
from tests.torch.torch_dgc import (batch, expect_error, flat_params, loss_of, mlp,
                                     rank_spread, ranks_identical)

#: mlp(): weights of 1280, 4096 (DGC) and 320, biases of 64, 64, 5 (dense) elements.
#: fp32 values: a dense tensor folded into a bucket's allgather then goes exact, as in
#: its own allreduce (in 8 bits it is rounded, the rounding kept in its memory).
OPTIONS = dict(density=0.05, warmup=0, aggregation="allgather",
               compression=hvd.Compression.dgc(value_bits=32))


def _wrap(model, tag, threshold, **options):
    opts = dict(OPTIONS, **options)
    return hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=[(f"{tag}.{n}", p) for n, p in model.named_parameters()],
        fusion_threshold=threshold, **opts)


def _pair(tag, thresholds, steps=8, passes=1, **options):
    """The same training with each threshold: weights equal after every step? launches
    in the last step, ranks identical at the end."""
    rank = hvd.rank()
    models = [mlp(seed=4) for _ in thresholds]
    opts = [_wrap(m, f"{tag}{i}", t, backward_passes_per_step=passes, **options)
            for i, (m, t) in enumerate(zip(models, thresholds))]
    equal = []
    for step in range(steps):
        for model, opt in zip(models, opts):
            opt.zero_grad()
            for pass_ in range(passes):
                loss_of(model, step * passes + pass_, rank).backward()
            opt.step()
        first = flat_params(models[0])
        equal.append(all(torch.equal(first, flat_params(m)) for m in models[1:]))
    for opt in opts:
        if opt.in_flight:
            opt.flush()
    stats = [opt.compression_stats() for opt in opts]
    moved = float((flat_params(models[0]) - flat_params(mlp(seed=4))).abs().max())
    return {"equal_each_step": equal, "moved": moved,
            "launches": [s["last_step"]["launches"] for s in stats],
            "dense_bytes": [{name: t["bytes"] for name, t in s["last_step"]["tensors"].items()
                             if t["path"] == "dense"} for s in stats],
            "paths": [s["paths"] for s in stats],
            "identical": [ranks_identical(m, f"{tag}.same{i}") for i, m in enumerate(models)]}


def bundled_equals_per_tensor():
    """Default threshold (one bucket), a threshold that cuts the step in two, and 0 (one
    launch per tensor, as Horovod's hooks): the same weights after every step."""
    # the 4096-element weight's k = 205 records: fp32 values, positions coded
    records = 205 * 4 + index_bytes(4096, 205)
    out = {"sync": _pair("fz", [None, records + 400, 0])}
    out["delay"] = _pair("fzd", [None, 0], delay=2)
    out["period"] = _pair("fzp", [None, 0], delay=1, period=2, steps=9)
    out["passes"] = _pair("fzb", [None, 0], passes=2)
    out["region"] = _pair("fzr", [None, 0], aggregation="region")
    # little latency in the cost model (16 us; the records' collectives at 28% of the
    # allreduce's rate): the step's bytes take less than fusion.BUCKET_LATENCIES of it, so
    # one bucket, but the dense tensors keep their allreduce (costmodel.folds: their 453
    # values in the allgather, 52 us, cost more than it, 46 us)
    out["unfolded"] = _pair("fzn", [None, 0], cost_model=hvd.CostModel(
        alpha=16e-6, gather_bandwidth=3.5e7))
    # 8-bit values (the default): each tensor's scale is its own, so with nothing folded
    # buckets still train exactly as one launch per tensor (no latency and a slow
    # allgather keep the biases' allreduce against their 8-bit values, costmodel.folds);
    # folded, the biases go in 8 bits
    eight = hvd.Compression.dgc()
    out["unfolded_8bit"] = _pair("fz8n", [None, 0], compression=eight,
                                 cost_model=hvd.CostModel(alpha=0.0, gather_bandwidth=1e7))
    out["folded_8bit"] = _pair("fz8f", [None], compression=eight)
    return out


class _Branchy(nn.Module):
    """A head that only rank 0 uses: its hook never fires on rank 1."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.body = mlp(seed=5)
        self.extra = nn.Linear(5, 5).to(device())

    def forward(self, x, use_extra):
        out = self.body(x)
        return self.extra(out) if use_extra else out


def unused_parameter_on_one_rank(steps=6):
    """Rank 1 never uses a tensor of the bucket: its launch waits for synchronize there
    and leaves at once on rank 0; same launch (members, name) on both, no hang."""
    rank = hvd.rank()
    model = _Branchy()
    opt = _wrap(model, "fzu", None)
    same = []
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(step, rank)
        nn.functional.cross_entropy(model(x, rank == 0), y).backward()
        opt.step()
        same.append(ranks_identical(model, f"fzu.{step}"))
    return {"identical_each_step": same,
            "launches": opt.compression_stats()["last_step"]["launches"]}


class _WithEmbedding(nn.Module):
    def __init__(self, sparse):
        super().__init__()
        torch.manual_seed(6)
        self.emb = nn.Embedding(50, 20, sparse=sparse).to(device())
        self.body = mlp(seed=6)

    def forward(self, tokens):
        return self.body(self.emb(tokens).mean(1))


def sparse_gradient_in_a_bucket(steps=6):
    """nn.Embedding(sparse=True) leaves alone (Horovod's sparse path), the rest of its
    bucket without it: same weights as one launch per tensor."""
    rank = hvd.rank()
    models = [_WithEmbedding(True) for _ in range(2)]
    opts = [_wrap(m, f"fze{i}", t) for i, (m, t) in enumerate(zip(models, (None, 0)))]
    equal, grads_equal, spread = [], [], 0.0
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        tokens = torch.randint(0, 50, (16, 3), generator=gen).to(device())
        y = torch.randint(0, 5, (16,), generator=gen).to(device())
        for model, opt in zip(models, opts):
            opt.zero_grad()
            nn.functional.cross_entropy(model(tokens), y).backward()
            opt.step()
        equal.append(torch.equal(flat_params(models[0]), flat_params(models[1])))
        grads_equal.append(all(torch.equal(a.grad.to_dense(), b.grad.to_dense()) for a, b in
                               zip(models[0].parameters(), models[1].parameters())))
        spread = max(spread, float((flat_params(models[0]) - flat_params(models[1])).abs().max()))
    stats = opts[0].compression_stats()
    return {"equal_each_step": equal, "grads_equal_each_step": grads_equal, "spread": spread,
            "launches": stats["last_step"]["launches"],
            "identical": ranks_identical(models[0], "fze.same"),
            "rank_spread": rank_spread(models[0], "fze.spread"),
            "sparse_momentum_deterministic": sparse_momentum_deterministic()}


def bad_threshold():
    def wrap(threshold):
        return lambda: _wrap(mlp(), "fzbad", threshold)
    out = {name: expect_error(wrap(value), ValueError)
           for name, value in (("negative", -1), ("float", 1.5), ("bool", True))}
    saved = os.environ.get("HOROVOD_FUSION_THRESHOLD")
    os.environ["HOROVOD_FUSION_THRESHOLD"] = "64MB"
    try:
        out["environment"] = expect_error(wrap(None), ValueError)
    finally:
        if saved is None:
            del os.environ["HOROVOD_FUSION_THRESHOLD"]
        else:
            os.environ["HOROVOD_FUSION_THRESHOLD"] = saved
    return out


def suite(names):
    from tests.torch import torch_dgc
    return torch_dgc.suite(names, module=__import__(__name__, fromlist=["_"]))
