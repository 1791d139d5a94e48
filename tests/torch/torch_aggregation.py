"""Sparse aggregations through hvd_dgc's torch optimizer (aggregation="allgather" /
"region"), on every rank under horovodrun: equivalence with dense Horovod at density 1,
bit-identical ranks, error feedback's conservation, skipped and delayed steps, and
convergence on digits."""

import sys
import warnings

import torch

import horovod.torch as hvd_stock
import hvd_dgc.torch as hvd
from tests.torch import torch_dgc
from tests.torch.torch_dgc import flat_params, loss_of, max_diff, mlp, ranks_identical, \
    step_all, wide_mlp

METHODS = ("allgather", "region")


def suite(names):
    return torch_dgc.suite(names, sys.modules[__name__])


def _named(tag, model):
    return [(f"{tag}.{n}", p) for n, p in model.named_parameters()]


def density_one():
    """density 1, every tensor through the forced method == Horovod's momentum SGD."""
    rank, out = hvd.rank(), {}
    for method in METHODS + ("region_predivide",):
        ref, ours = mlp(3), mlp(3)
        kw = dict(lr=0.05, momentum=0.9, weight_decay=1e-3)
        opt_ref = hvd_stock.DistributedOptimizer(torch.optim.SGD(ref.parameters(), **kw),
                                                 named_parameters=_named("ref" + method, ref))
        opt = hvd.DistributedOptimizer(torch.optim.SGD(ours.parameters(), **kw),
                                       named_parameters=_named(method, ours), density=1.0,
                                       aggregation=method.split("_")[0], min_compress_size=0,
                                       gradient_predivide_factor=2.0 if "predivide" in method
                                       else 1.0)
        diffs, identical = [], []
        for step in range(8):
            step_all(((ref, opt_ref), (ours, opt)), step, rank)
            diffs.append(max_diff(ref, ours))
            identical.append(ranks_identical(ours, f"d1.{method}.{step}"))
        out[method] = {"max_diff": max(diffs), "identical": identical,
                       "moved": float((flat_params(ref) - flat_params(mlp(3))).abs().max()),
                       "stats": opt.compression_stats()}
    return out


def sparse_steps(steps=10):
    """density 1%: ranks bit-identical after every step; bytes per method."""
    rank, out = hvd.rank(), {}
    for method in METHODS:
        model = wide_mlp(4)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=_named("s" + method, model),
                                       density=0.01, aggregation=method)
        identical = []
        for step in range(steps):
            opt.zero_grad()
            loss_of(model, step, rank, features=64).backward()
            opt.step()
            identical.append(ranks_identical(model, f"sp.{method}.{step}"))
        out[method] = {"identical": identical, "stats": opt.compression_stats(),
                       "moved": float((flat_params(model) - flat_params(wide_mlp(4))).abs().max())}
    return out


def _residuals(opt, model):
    return [opt.residual(p) for p in model.parameters()]


def conservation(steps=6):
    """Error feedback with the re-sparsified sums (no momentum, no weight decay): over
    all ranks, memory after + the summed update == memory before + the gradients."""
    rank, out = hvd.rank(), {}
    for method in METHODS:
        model = wide_mlp(5)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                       named_parameters=_named("c" + method, model),
                                       density=0.02, aggregation=method)
        errors, scale = [], []
        for step in range(steps):
            before = [None if r is None else r.clone() for r in _residuals(opt, model)]
            opt.zero_grad()
            loss_of(model, step, rank, features=64).backward()
            grads = [p.grad.detach().reshape(-1).clone() for p in model.parameters()]
            opt.synchronize()
            update = [p.grad.detach().reshape(-1).clone() for p in model.parameters()]
            with opt.skip_synchronize():
                opt.step()
            after = _residuals(opt, model)
            # summed over ranks: sum(after) + N * avg - sum(before) - sum(grads) == 0
            terms = [a - (torch.zeros_like(g) if b is None else b) - g + u
                     for b, g, u, a in zip(before, grads, update, after)]
            mismatch = hvd_stock.allreduce(torch.cat(terms), op=hvd_stock.Sum,
                                           name=f"cons.{method}.{step}")
            errors.append(float(mismatch.abs().max()))
            scale.append(float(torch.cat(grads).abs().max()))
        out[method] = {"errors": errors, "scale": scale, "stats": opt.compression_stats()}
    return out


def nonfinite_skip():
    """A NaN on one rank at step 2: every rank skips the step; weights and memory as
    before it, region's gives-back included."""
    rank, out = hvd.rank(), {}
    model = wide_mlp(6)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=_named("nan", model), density=0.02,
                                   aggregation="region")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            before_w = flat_params(model).clone()
            before_m = [None if r is None else r.clone() for r in _residuals(opt, model)]
            opt.zero_grad()
            loss_of(model, step, rank, features=64).backward()
            if step == 2 and rank == 1:
                next(model.parameters()).grad[0, 0] = float("nan")
            opt.step()
            if step == 2:
                out["weights_kept"] = torch.equal(before_w, flat_params(model))
                out["memory_kept"] = all(
                    b is None or torch.equal(b, a) for b, a in zip(before_m, _residuals(opt, model)))
    out["nonfinite_steps"] = opt.compression_stats()["nonfinite_steps"]
    out["warned"] = any("non-finite" in str(w.message) for w in caught)
    out["identical"] = ranks_identical(model, "nan.check")
    return out


def delayed():
    """Region reduce under delayed averaging: D=2, then flush: ranks identical."""
    rank, out = hvd.rank(), {}
    dga = mlp(7)
    opt_dga = hvd.DistributedOptimizer(torch.optim.SGD(dga.parameters(), lr=0.05, momentum=0.9),
                                       named_parameters=_named("dga", dga), density=0.05,
                                       aggregation="region", delay=2, min_compress_size=0)
    for step in range(6):
        step_all(((dga, opt_dga),), step, rank)
    out["in_flight"] = opt_dga.in_flight
    opt_dga.flush()
    out["identical"] = ranks_identical(dga, "dga.check")
    out["moved"] = float((flat_params(dga) - flat_params(mlp(7))).abs().max())
    out["stats"] = opt_dga.compression_stats()
    return out


def digits(epochs=30, seeds=(0,), batch=32):
    """Digits at N ranks, an MLP (its two weights compressed), DGC 1%: allgather vs
    region reduce on the same data, seeds and batches; test accuracy per seed."""
    from tests.torch.torch_convergence import accuracy, digits as load
    rank, size = hvd.rank(), hvd.size()
    (x, y), test = load(rank, size)
    x, test = x.view(len(x), -1), (test[0].view(len(test[0]), -1), test[1])
    out = {}
    for method in METHODS:
        accs, stats = [], None
        for seed in seeds:
            torch.manual_seed(seed)
            model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                        torch.nn.Linear(128, 10))
            opt = hvd.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                named_parameters=_named(f"dig{method}{seed}", model), density=0.01, warmup=3,
                aggregation=method)
            for epoch in range(epochs):
                opt.set_epoch(epoch)
                order = torch.randperm(len(y), generator=torch.Generator().manual_seed(
                    epoch * 7 + rank + 100 * seed))
                for i in range(len(y) // batch):
                    idx = order[i * batch:(i + 1) * batch]
                    opt.zero_grad()
                    torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
                    opt.step()
            assert ranks_identical(model, f"dig.{method}.{seed}"), f"{method}: ranks differ"
            accs.append(accuracy(model, test))
            stats = opt.compression_stats()
        out[method] = {"accuracy": accs, "stats": stats}
    return out
