"""Hierarchical DGC through hvd_dgc's torch optimizer, on every rank under horovodrun
with ranks on several hosts (-H localhost:L,127.0.0.1:L: Horovod sees two hosts; or
the emulated hosts of bench/wan/hosts.py): density 1 == flat == dense Horovod,
bit-identical ranks at 0.1%, error feedback's conservation with slice-owned residuals,
bytes across hosts, a skipped step, and the wrap-time errors."""

import sys
import warnings

import torch

import horovod.torch as hvd_stock
import hvd_dgc.torch as hvd
from hvd_dgc.schedule import num_selected
from hvd_dgc.aggregation import slices
from tests.torch import torch_dgc
from tests.torch.torch_aggregation import _named
from tests.torch.torch_dgc import expect_error, flat_params, loss_of, max_diff, mlp, \
    ranks_identical, step_all, train, wide_mlp

WIDE = {"features": 64}  # wide_mlp's inputs


def suite(names):
    return torch_dgc.suite(names, sys.modules[__name__])


def topology():
    return {"rank": hvd.rank(), "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
            "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size()}


def density_one(steps=8):
    """density 1, every tensor forced hierarchical / flat allgather == Horovod's
    momentum SGD (weight decay too)."""
    rank, out = hvd.rank(), {}
    kw = dict(lr=0.05, momentum=0.9, weight_decay=1e-3)
    ref = mlp(3)
    opt_ref = hvd_stock.DistributedOptimizer(torch.optim.SGD(ref.parameters(), **kw),
                                             named_parameters=_named("ref", ref))
    models = {"reference": (ref, opt_ref)}
    for method in ("hierarchical", "allgather"):
        model = mlp(3)
        models[method] = (model, hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), **kw), named_parameters=_named(method, model),
            density=1.0, aggregation=method, min_compress_size=0))
    identical = []
    for step in range(steps):
        step_all(list(models.values()), step, rank)
        identical.append(ranks_identical(models["hierarchical"][0], f"d1.{step}"))
    hier, flat = models["hierarchical"][0], models["allgather"][0]
    out["hierarchical_vs_dense"] = max_diff(ref, hier)
    out["hierarchical_vs_flat"] = max_diff(flat, hier)
    out["moved"] = float((flat_params(ref) - flat_params(mlp(3))).abs().max())
    out["identical"] = identical
    out["stats"] = models["hierarchical"][1].compression_stats()
    return out


def sparse_steps(steps=10, density=0.001):
    """density 0.1% (warm-up off): ranks bit-identical after every step; records this
    rank sent, hierarchical vs flat allgather of the same model."""
    rank, out = hvd.rank(), {}
    for method in ("hierarchical", "allgather"):
        model = wide_mlp(4)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=_named("s" + method, model),
                                       density=density, aggregation=method)
        identical = []
        for step in range(steps):
            train(model, opt, 1, rank, start=step, **WIDE)
            identical.append(ranks_identical(model, f"sp.{method}.{step}"))
        stats = opt.compression_stats()
        # the last step's records (what crosses hosts), summed over each host's ranks:
        # hierarchical's of 8 bytes (int32 index, fp32 value), the allgather's k a tensor
        # (its positions coded: its bytes are no count of records)
        records = sum(t["bytes"] // 8 if t["path"] == "hierarchical" else
                      num_selected(t["numel"], density)
                      for t in stats["last_step"]["tensors"].values() if t["path"] != "dense")
        host = hvd_stock.allreduce(torch.tensor([float(records)]), op=hvd_stock.Sum,
                                   name=f"sp.{method}.records") / hvd.cross_size()
        out[method] = {"identical": identical, "stats": stats, "host_records": float(host),
                       "moved": float((flat_params(model) - flat_params(wide_mlp(4))).abs().max())}
    return out


def conservation(steps=6):
    """No momentum, no weight decay: over all ranks, the residuals after (each a slice of
    its host's summed gradient) + N x the update == the residuals before + every rank's
    gradient; nothing a host did not send is lost."""
    rank, world = hvd.rank(), hvd.size()
    model = wide_mlp(5)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=_named("cons", model), density=0.02,
                                   aggregation="hierarchical")
    peers = opt._wire.peers
    me = peers.index(rank)

    def residuals():
        """This rank's residual slices, placed in full-size zero tensors."""
        out = []
        for p in model.parameters():
            full = torch.zeros(p.numel(), device=p.device)
            r = opt.residual(p)
            if r is not None and r.numel() == p.numel():  # a dense tensor: all of it here
                full = r.reshape(-1).clone()
            elif r is not None:  # hierarchical: this rank's slice of its host's residual
                lo, hi = slices(p.numel(), len(peers))[me]
                full[lo:hi] = r.reshape(-1)
            out.append(full)
        return torch.cat(out)

    errors, scale = [], []
    for step in range(steps):
        before = residuals()
        opt.zero_grad()
        loss_of(model, step, rank, **WIDE).backward()
        grads = torch.cat([p.grad.detach().reshape(-1).clone() for p in model.parameters()])
        opt.synchronize()
        update = torch.cat([p.grad.detach().reshape(-1).clone() for p in model.parameters()])
        with opt.skip_synchronize():
            opt.step()
        terms = residuals() - before - grads + update  # summed: + N avg, as avg = sum / N
        mismatch = hvd_stock.allreduce(terms, op=hvd_stock.Sum, name=f"cons.{step}")
        errors.append(float(mismatch.abs().max()))
        scale.append(float(grads.abs().max()))
    return {"errors": errors, "scale": max(scale), "world": world,
            "stats": opt.compression_stats()}


def nonfinite_skip():
    """A NaN on one rank at step 2: every rank skips the step, weights and every rank's
    memory (its host peers' too, which summed the NaN) as before it."""
    rank, out = hvd.rank(), {}
    model = wide_mlp(6)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=_named("nan", model), density=0.02,
                                   aggregation="hierarchical")

    def memory():
        return [None if r is None else r.clone() for r in (
            opt.residual(p) for p in model.parameters())]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            before_w, before_m = flat_params(model).clone(), memory()
            opt.zero_grad()
            loss = loss_of(model, step, rank, **WIDE)
            if step == 2 and rank == 1:  # in the graph: the hooks launch during backward
                loss = loss * float("nan")
            loss.backward()
            opt.step()
            if step == 2:
                out["weights_kept"] = torch.equal(before_w, flat_params(model))
                out["memory_kept"] = all(b is None or torch.equal(b, a)
                                         for b, a in zip(before_m, memory()))
    out["nonfinite_steps"] = opt.compression_stats()["nonfinite_steps"]
    out["warned"] = any("non-finite" in str(w.message) for w in caught)
    out["identical"] = ranks_identical(model, "nan.check")
    return out


def auto_choice():
    """aggregation="auto" at 0.1% across a 100 Mbit/s link: hierarchical for the largest
    weight, the coded allgather for the two others (the cost model, one choice per tensor);
    at 1 Gbit/s (the default model) the local reduce costs more than the records it
    saves: flat; "flat" never takes it; with delay > 0 auto takes it as without. (fp32
    values: in 8 bits the allgather's records weigh a third of hierarchical DGC's
    ``[int32 | fp32]`` ones, and it wins.)"""
    out = {}
    slow = hvd.CostModel(bandwidth=100e6 / 8)
    for tag, kwargs in (("auto", {"cost_model": slow}), ("auto_1gbit", {}),
                        ("flat", {"aggregation": "flat", "cost_model": slow}),
                        ("auto_delay", {"delay": 1, "cost_model": slow})):
        model = wide_mlp(7)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=_named("auto" + tag, model),
                                       density=0.001,
                                       compression=hvd.Compression.dgc(value_bits=32), **kwargs)
        train(model, opt, 2, hvd.rank(), **WIDE)
        if kwargs.get("delay"):
            opt.flush()
        out[tag] = opt.compression_stats()["paths"]
    return out


def delayed(steps=6):
    """Delayed averaging (D=2) over hierarchical DGC: each rank applies what it sent (its
    slice of its host's sum) at once and the average two steps later; after the flush
    every rank holds the same weights. Also at density 1 against flat allgather with the
    same delay: equal after the flush up to float rounding only where the updates are
    linear in the gradients, so only identity across ranks is asserted there."""
    rank, out = hvd.rank(), {}
    for tag, density in (("sparse", 0.01), ("dense", 1.0)):
        model = wide_mlp(9)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                       named_parameters=_named("dga" + tag, model),
                                       density=density, aggregation="hierarchical", delay=2,
                                       min_compress_size=0)
        train(model, opt, steps, rank, **WIDE)
        in_flight = opt.in_flight
        opt.flush()
        out[tag] = {"in_flight": in_flight, "identical": ranks_identical(model, "dga." + tag),
                    "moved": float((flat_params(model) - flat_params(wide_mlp(9))).abs().max()),
                    "paths": opt.compression_stats()["paths"]}
    return out


def checkpoint_resume(total=8, at=4):
    """The optimizer's state (each rank's residual slices) saved at step ``at`` and
    loaded into a new model and optimizer: the rest of training is bit-identical to
    the uninterrupted run (every tensor hierarchical: no allreduce whose sum order
    could vary)."""
    import io
    rank = hvd.rank()

    def make(tag):
        model = wide_mlp(10)
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4),
            named_parameters=_named(tag, model), density=0.01, aggregation="hierarchical",
            min_compress_size=0)
        return model, opt

    model, opt = make("ck.ref")
    train(model, opt, at, rank, **WIDE)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
    train(model, opt, total - at, rank, start=at, **WIDE)
    reference = flat_params(model).clone()
    out = {"saved_residual": sum(float(s["v"].abs().sum()) for s in
                                 opt.state_dict()["hvd_dgc"]["memory"].values())}
    for with_state in (True, False):
        buffer.seek(0)
        saved = torch.load(buffer, weights_only=False)
        model, opt = make(f"ck.{with_state}")
        model.load_state_dict(saved["model"])
        state = saved["optimizer"]
        if not with_state:
            state = dict(state)
            del state["hvd_dgc"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.load_state_dict(state)
        train(model, opt, total - at, rank, start=at, **WIDE)
        out[f"max_diff_{'with' if with_state else 'without'}_state"] = float(
            (flat_params(model) - reference).abs().max())
    out["identical"] = ranks_identical(model, "ck.id")
    return out


def bad_inputs():
    """A forced hierarchical aggregation that cannot run says why and what to use."""
    out = {}
    model = mlp(8)
    for tag, kwargs in (("dense_compressor", {"compression": hvd.Compression.powersgd}),
                        ("single_host", {})):
        if tag == "single_host" and hvd.cross_size() > 1:
            continue
        out[tag] = expect_error(lambda: hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=_named("bad" + tag, model), aggregation="hierarchical",
            **kwargs), ValueError)
    return out
