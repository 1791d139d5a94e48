"""Bodies of the PyTorch DistributedOptimizer tests, run on every rank under horovodrun.

``suite(names)`` runs several scenarios in one launch (launches cost seconds)
and returns ``{name: result}``; a scenario that raises returns its traceback
under ``"error"`` so the test shows it and the other scenarios still report.
"""

import copy
import traceback
import warnings

import numpy as np
import torch
import torch.nn as nn

import horovod.torch as hvd_stock
import hvd_dgc.torch as hvd
from hvd_dgc.schedule import num_selected
from tests.device import device, sparse_momentum_deterministic


# -- helpers -------------------------------------------------------------------
def mlp(seed=0, width=64):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(20, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 5)).to(device())


def wide_mlp(seed=0):
    """Tensors large enough to be compressed at density 0.001 (k > 1)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 10)).to(device())


def batch(step, rank, n=16, features=20, classes=5):
    """Drawn on the CPU (the same numbers whatever the device), then moved."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(n, features, generator=gen), torch.randint(0, classes, (n,), generator=gen)
    return x.to(device()), y.to(device())


def loss_of(model, step, rank, **kw):
    x, y = batch(step, rank, **kw)
    return nn.functional.cross_entropy(model(x), y)


def flat_params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def max_diff(a, b):
    return float((flat_params(a) - flat_params(b)).abs().max())


def rank_spread(model, name):
    """Largest difference between rank 0's parameters and any rank's."""
    everyone = hvd.allgather(flat_params(model).unsqueeze(0), name=name)
    return float((everyone - everyone[0]).abs().max())


def ranks_identical(model, name):
    """True when every rank holds bit-identical parameters."""
    mine = flat_params(model)
    everyone = hvd.allgather(mine.unsqueeze(0), name=name)
    return all(torch.equal(everyone[0], everyone[r]) for r in range(everyone.shape[0]))


def step_all(pairs, step, rank, **kw):
    """One step of every (model, optimizer) pair on the same batch: runs side by side."""
    for model, opt in pairs:
        opt.zero_grad()
        loss_of(model, step, rank, **kw).backward()
        opt.step()


def train(model, opt, steps, rank, start=0, **kw):
    for step in range(start, start + steps):
        opt.zero_grad()
        loss_of(model, step, rank, **kw).backward()
        opt.step()


def expect_error(fn, exc_type):
    try:
        fn()
    except exc_type as exc:
        return str(exc)
    except Exception as exc:  # wrong type: report it so the test fails with it
        return f"WRONG EXCEPTION {type(exc).__name__}: {exc}"
    return "NO EXCEPTION"


# -- scenarios ---------------------------------------------------------------------
def dense_equivalence():
    """density 1.0 == Horovod's DistributedOptimizer + SGD(momentum, nesterov, wd)."""
    rank = hvd.rank()
    out = {}
    for nesterov in (False, True):
        ref, ours = mlp(1), mlp(1)
        kw = dict(lr=0.05, momentum=0.9, nesterov=nesterov, weight_decay=1e-3)
        opt_ref = hvd_stock.DistributedOptimizer(torch.optim.SGD(ref.parameters(), **kw),
                                                 named_parameters=ref.named_parameters())
        opt = hvd.DistributedOptimizer(torch.optim.SGD(ours.parameters(), **kw),
                                       named_parameters=[("dgc." + n, p) for n, p in
                                                         ours.named_parameters()],
                                       density=1.0)
        diffs = []
        for step in range(20):
            step_all(((ref, opt_ref), (ours, opt)), step, rank)
            diffs.append(max_diff(ref, ours))
        moved = float((flat_params(ref) - flat_params(mlp(1))).abs().max())
        out["nesterov" if nesterov else "momentum"] = {
            "max_diff": max(diffs), "moved": moved,
            "identical": ranks_identical(ours, f"eq.{nesterov}"),
            "stats": opt.compression_stats()}
    # Horovod's dense compressors through hvd_dgc's optimizer: same maths.
    ref, ours = mlp(2), mlp(2)
    opt_ref = hvd_stock.DistributedOptimizer(torch.optim.SGD(ref.parameters(), lr=0.05,
                                                             momentum=0.9),
                                             named_parameters=ref.named_parameters())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=[("none." + n, p) for n, p in
                                                     ours.named_parameters()],
                                   density=1.0)
    for step in range(10):
        step_all(((ref, opt_ref), (ours, opt)), step, rank)
    out["compression_none_max_diff"] = max_diff(ref, ours)
    return out


def in_place():
    """Where nothing of DGC's is pending (plain SGD, every tensor dense, residual zero) the
    gradients go as stock Horovod sends them (paths.py ``InPlacePath.takes``): the weights
    equal Horovod's bit for bit; a NaN on one rank is still skipped on every rank; and
    from a checkpoint holding residuals, the steps equal those of the memory's own path
    (the residual leaves once through the memory, then the gradients go in place)."""
    from hvd_dgc.torch.paths import InPlacePath
    rank, out = hvd.rank(), {}
    ref, ours = mlp(4), mlp(4)
    opt_ref = hvd_stock.DistributedOptimizer(torch.optim.SGD(ref.parameters(), lr=0.05),
                                             named_parameters=ref.named_parameters())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(ours.parameters(), lr=0.05),
                                   named_parameters=[("inplace." + n, p) for n, p in
                                                     ours.named_parameters()], density=1.0)
    for step in range(8):
        step_all(((ref, opt_ref), (ours, opt)), step, rank)
    out["max_diff"] = max_diff(ref, ours)
    out["moved"] = float((flat_params(ref) - flat_params(mlp(4))).abs().max())
    before = flat_params(ours).clone()
    opt.zero_grad()
    loss = loss_of(ours, 8, rank)
    (loss * float("nan") if rank == 1 else loss).backward()
    opt.step()
    out["nan_step_unchanged"] = bool(torch.equal(flat_params(ours), before))
    out["nonfinite_steps"] = opt.compression_stats()["nonfinite_steps"]
    out["identical"] = ranks_identical(ours, "inplace.identical")

    # residuals in a checkpoint: the first step sends them through the memory
    src = mlp(5)
    opt_src = hvd.DistributedOptimizer(torch.optim.SGD(src.parameters(), lr=0.05),
                                       named_parameters=[("res." + n, p) for n, p in
                                                         src.named_parameters()],
                                       density=0.01, warmup=0)
    train(src, opt_src, 3, rank)
    saved = opt_src.state_dict()
    out["saved_residual"] = sum(float(s["v"].abs().sum())
                                for s in opt_src.dgc_memory().values())
    trails = {}
    for tag in ("in_place", "memory"):
        model = mlp(5)
        model.load_state_dict(src.state_dict())
        opt_b = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                         named_parameters=[("res." + n, p) for n, p in
                                                           model.named_parameters()],
                                         density=1.0)
        opt_b.load_state_dict(saved)
        used = InPlacePath.takes
        if tag == "memory":
            InPlacePath.takes = lambda self, *_: False
        try:
            trails[tag] = []
            for step in range(3, 7):
                opt_b.zero_grad()
                loss_of(model, step, rank).backward()
                opt_b.step()
                trails[tag].append(flat_params(model).clone())
        finally:
            InPlacePath.takes = used
        out[tag + "_residual"] = sum(float(s["v"].abs().sum())
                                     for s in opt_b.dgc_memory().values())
    out["checkpoint_same"] = all(torch.equal(a, b) for a, b in
                                 zip(trails["in_place"], trails["memory"]))
    return out


def dense_fp16():
    """dense_compression=fp16: half the bytes, ranks identical, and fp16's rounding error
    kept as residual, so the trajectory tracks fp32 closer than Horovod's fp16 does."""
    rank = hvd.rank()
    ref, ours, stock16 = mlp(16), mlp(16), mlp(16)
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)  # noqa: E731
    opt_ref = hvd_stock.DistributedOptimizer(sgd(ref), named_parameters=ref.named_parameters())
    opt_16 = hvd_stock.DistributedOptimizer(sgd(stock16), compression=hvd_stock.Compression.fp16,
                                            named_parameters=[("s16." + n, p) for n, p in
                                                              stock16.named_parameters()])
    opt = hvd.DistributedOptimizer(sgd(ours), density=1.0, dense_compression=hvd.Compression.fp16,
                                   named_parameters=[("f16." + n, p) for n, p in
                                                     ours.named_parameters()])
    for step in range(20):
        step_all(((ref, opt_ref), (stock16, opt_16), (ours, opt)), step, rank)
    stats = opt.compression_stats()
    return {"ours_vs_fp32": max_diff(ref, ours), "stock_fp16_vs_fp32": max_diff(ref, stock16),
            "ratio": stats["compression_ratio"], "identical": ranks_identical(ours, "f16")}


def sparse_consistency(compression="dgc", steps=12):
    """density 0.001: identical weights on every rank after every step; the sampled
    threshold's count stays within the adaptation window of k."""
    rank = hvd.rank()
    model = wide_mlp(3)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    comp = getattr(hvd.Compression, compression)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   compression=comp, density=0.001, min_compress_size=1024)
    identical, counts = [], []
    start = flat_params(model).clone()
    for step in range(steps):
        opt.zero_grad()
        loss_of(model, step, rank, features=64, classes=10).backward()
        opt.step()
        identical.append(ranks_identical(model, f"sc.{compression}.{step}"))
        for name, t in opt.compression_stats()["last_step"]["tensors"].items():
            counts.append({"name": name, "path": t["path"], "numel": t["numel"],
                           "sent": t["sent"], "bytes": t["bytes"]})
    return {"identical": identical, "counts": counts, "stats": opt.compression_stats(),
            "moved": float((flat_params(model) - start).abs().max()),
            "own_compressor": opt.compressor is not comp and opt.compressor == comp}


def np1_compresses():
    """At np=1 the optimizer still compresses (Horovod would skip its hooks)."""
    out = sparse_consistency("dgc", steps=3)
    out["size"] = hvd.size()
    return out


def log_every():
    """log_every=2 prints compression statistics on rank 0 only, every 2nd step."""
    import contextlib
    import io
    model = wide_mlp(seed=6)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=[("log." + n, p) for n, p in
                                                     model.named_parameters()],
                                   density=0.01, log_every=2)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        train(model, opt, 5, hvd.rank(), features=64, classes=10)
    return buf.getvalue().splitlines()


def horovod_patterns():
    """Horovod's example scripts with only the import line switched: an explicit
    ``compression=Compression.none`` / ``fp16`` (DGC with fp32 / fp16 values), a name, a
    class; ``density=1.0`` for dense; each against Horovod's own dense optimizer on the
    same data. Rank 0's wrap-time line; warnings where DGC would do nothing; refusals."""
    import contextlib
    import io
    from horovod.torch.compression import Compressor
    from hvd_dgc.torch.compression import DGCCompressor
    from tests.torch.torch_convergence import accuracy, digits
    rank = hvd.rank()
    (x, y), test = digits(rank, hvd.size())

    def fit(model, opt, epochs=4, batch=32, amp=False):
        # amp: Horovod's AMP / clipping pattern (pytorch_imagenet_resnet50.py and the
        # mnist example with --use-mixed-precision): synchronize(), unscale_, clip,
        # then step() inside skip_synchronize()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if amp else None
        for epoch in range(epochs):
            order = torch.randperm(len(y), generator=torch.Generator().manual_seed(epoch))
            for i in range(len(y) // batch):
                idx = order[i * batch:(i + 1) * batch]
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
                if not amp:
                    loss.backward()
                    opt.step()
                    continue
                scaler.scale(loss).backward()
                opt.synchronize()
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                with opt.skip_synchronize():
                    scaler.step(opt)
                scaler.update()
        return accuracy(model, test)

    out = {}
    ref = nn.Sequential(nn.Flatten(), *wide_mlp(3))
    hvd.broadcast_parameters(ref.state_dict(), root_rank=0)
    opt_ref = hvd_stock.DistributedOptimizer(
        torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9),
        named_parameters=[("hpref." + n, p) for n, p in ref.named_parameters()],
        compression=hvd_stock.Compression.none)
    out["dense_accuracy"] = fit(ref, opt_ref)
    none = {"compression": hvd.Compression.none}
    cases = {"none": none, "fp16": {"compression": hvd.Compression.fp16},
             "name": {"compression": "dgc"}, "name_case": {"compression": " TopK "},
             "class": {"compression": DGCCompressor},
             "dense": {"compression": hvd.Compression.none, "density": 1.0},
             # more of the examples' arguments and calls, each with Compression.none
             "average": {**none, "op": hvd.Average},
             "predivide": {**none, "gradient_predivide_factor": 2.0},
             "amp": none, "broadcast_state": none}
    for tag, kwargs in cases.items():
        model = nn.Sequential(nn.Flatten(), *wide_mlp(3))
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            opt = hvd.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                named_parameters=[(f"hp{tag}." + n, p) for n, p in model.named_parameters()],
                **kwargs)
        if tag == "broadcast_state":  # the examples call it right after wrapping
            hvd.broadcast_optimizer_state(opt, root_rank=0)
        acc = fit(model, opt, amp=tag == "amp")
        if tag == "none":
            after_none = model
        stats = opt.compression_stats()
        tensors = stats["last_step"]["tensors"].values()
        out[tag] = {
            "printed": printed.getvalue(), "ratio": stats["compression_ratio"],
            "paths": stats["paths"], "identical": ranks_identical(model, f"hp{tag}"),
            "compressor": type(opt.compressor).__name__,
            # every rank sends k records per tensor (a CPU selection's padded to k)
            "record_bytes": sorted({round(t["bytes"] / num_selected(t["numel"], t["density"]),
                                          1) for t in tensors if t["path"] == "sparse"}),
            "dense_bytes": sorted({t["bytes"] / t["numel"] for t in tensors
                                   if t["path"] == "dense"}),
            "accuracy": acc, "max_diff_vs_horovod": max_diff(ref, model),
            "density_now": opt.density, "density_at_10000": opt.schedule(10000, 0.0),
            "max_diff_vs_none": max_diff(after_none, model)}
    m = wide_mlp(4)

    def wrap(**kw):
        return hvd.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.1),
            named_parameters=[("hpw." + n, p) for n, p in m.named_parameters()], **kw)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with contextlib.redirect_stdout(io.StringIO()):
            wrap(min_compress_size=10 ** 6)
            # near 1 with no latency to save, fp32 values (the coded records cost more
            # than dense; in 8 bits they cost less)
            wrap(density=0.99, cost_model=hvd.CostModel(alpha=1e-7),
                 compression=hvd.Compression.dgc(value_bits=32))
    out["warnings"] = [str(w.message) for w in caught if "does nothing" in str(w.message)]
    with contextlib.redirect_stdout(io.StringIO()):  # the one-line default for AdamW
        adamw = hvd.DistributedOptimizer(
            torch.optim.AdamW(m.parameters()),
            named_parameters=[("hpadamw." + n, p) for n, p in m.named_parameters()])
        topk = hvd.DistributedOptimizer(
            torch.optim.AdamW(m.parameters()), compression=hvd.Compression.dgc,
            named_parameters=[("hpadamk." + n, p) for n, p in m.named_parameters()])
        feedback = hvd.DistributedOptimizer(
            torch.optim.AdamW(m.parameters()), freeze_variance=False,
            named_parameters=[("hpadamf." + n, p) for n, p in m.named_parameters()])
    out["adamw_schedule"] = adamw.schedule.config()
    out["adamw_default"] = [type(adamw._resolved.compressor).__name__, adamw._delayed.period]
    out["adamw_topk_schedule"] = topk.schedule.config()
    out["adamw_feedback_boundaries"] = feedback.schedule.boundaries

    class Custom(Compressor):
        pass
    out["bad_name"] = expect_error(lambda: wrap(compression="dgcc"), ValueError)
    out["foreign_class"] = expect_error(lambda: wrap(compression=Custom), TypeError)
    out["foreign_instance"] = expect_error(lambda: wrap(compression=Custom()), TypeError)
    out["module"] = expect_error(lambda: wrap(compression=nn.Linear), TypeError)
    return out


class EmbedNet(nn.Module):
    """A recommender's shape: a sparse embedding bag and a dense head DGC compresses."""

    def __init__(self, sparse, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(100, 32, sparse=sparse)
        self.head = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 5))

    def forward(self, ids):
        return self.head(self.emb(ids).mean(1))


def _train_embeddings(module, tag, steps=6, sparse=True, grads=None, **kw):
    """``grads``: a list that gets the embedding's averaged gradient of every step
    (dense), as the optimizer handed it to the base SGD."""
    model = EmbedNet(sparse).to(device())
    opt = module.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=[(f"{tag}.{n}", p) for n, p in model.named_parameters()], **kw)
    rank = hvd.rank()
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 * step + rank)
        ids = torch.randint(0, 100 if rank else 50, (16, 4), generator=gen).to(device())
        y = torch.randint(0, 5, (16,), generator=gen).to(device())
        opt.zero_grad()
        nn.functional.cross_entropy(model(ids), y).backward()
        opt.step()
        if grads is not None:
            grads.append(model.emb.weight.grad.to_dense().reshape(-1).clone())
    return model, opt


def sparse_embeddings():
    """nn.Embedding(sparse=True) as Horovod runs it: its rows allgathered and averaged,
    the base SGD's momentum for it; sparse_as_dense=True densifies it (then DGC). Each
    against Horovod's own optimizer on the same data (rank 0 looks up rows 0-49 only,
    rank 1 rows 0-99: the ranks' sparse gradients differ in their rows)."""
    import contextlib
    import io
    out = {}
    with contextlib.redirect_stdout(io.StringIO()):
        stock, _ = _train_embeddings(hvd_stock, "se_stock")
        ours, opt = _train_embeddings(hvd, "se_ours", density=1.0)
        stock_sad, _ = _train_embeddings(hvd_stock, "se_stock_sad", sparse_as_dense=True)
        ours_sad, opt_sad = _train_embeddings(hvd, "se_ours_sad", density=1.0,
                                              sparse_as_dense=True)
        dgc_grads = []
        dgc, opt_dgc = _train_embeddings(hvd, "se_dgc", steps=20, density=0.01,
                                         min_compress_size=1000, grads=dgc_grads)
        dense_of_dgc, _ = _train_embeddings(hvd_stock, "se_dense20", steps=20)
    out["max_diff"] = max_diff(stock, ours)
    out["max_diff_sparse_as_dense"] = max_diff(stock_sad, ours_sad)
    out["grad_is_sparse"] = [ours.emb.weight.grad.is_sparse, ours_sad.emb.weight.grad.is_sparse]
    out["momentum_buffer_sparse"] = opt.state[ours.emb.weight]["momentum_buffer"].is_sparse
    out["paths"] = [opt.compression_stats()["paths"], opt_sad.compression_stats()["paths"],
                    opt_dgc.compression_stats()["paths"]]
    last = opt_dgc.compression_stats()["last_step"]["tensors"]
    out["emb_last_step"] = last["se_dgc.emb.weight"]
    out["dgc_ratio"] = opt_dgc.compression_stats()["compression_ratio"]
    out["dgc_identical"] = ranks_identical(dgc, "se_dgc_identical")
    # What hvd_dgc hands the base SGD, every step: the same on every rank.
    everyone = hvd.allgather(torch.stack(dgc_grads).unsqueeze(0), name="se_dgc_grads")
    out["dgc_grads_identical"] = all(torch.equal(everyone[0], everyone[r])
                                     for r in range(everyone.shape[0]))
    out["dgc_grads_rank_diff"] = float(max((everyone[0] - everyone[r]).abs().max()
                                     for r in range(everyone.shape[0])))
    out["dgc_rank_weight_diff"] = rank_spread(dgc, "se_dgc_spread")
    out["sparse_momentum_deterministic"] = sparse_momentum_deterministic()
    out["dgc_moved_from_dense"] = max_diff(dgc, dense_of_dgc)
    out["delay"] = expect_error(lambda: _train_embeddings(hvd, "se_delay", steps=1, delay=2),
                                ValueError)
    out.update(_sparse_grad_nan())
    return out


def _sparse_grad_nan():
    """A NaN in rank 1's sparse embedding gradient: every rank skips the step."""
    import contextlib
    import io
    rank, poisoned = hvd.rank(), [False]

    def poison(grad):
        if not (poisoned[0] and rank == 1):
            return grad
        values = torch.full_like(grad.coalesce().values(), float("nan"))
        return torch.sparse_coo_tensor(grad.coalesce().indices(), values, grad.shape)

    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = EmbedNet(True).to(device())
        model.emb.weight.register_hook(poison)
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), density=1.0,
            named_parameters=[("se_nan." + n, p) for n, p in model.named_parameters()])
        weights = []
        for step in range(2):
            poisoned[0] = step == 1
            gen = torch.Generator().manual_seed(step + 10 * rank)
            ids = torch.randint(0, 100, (16, 4), generator=gen).to(device())
            opt.zero_grad()
            nn.functional.cross_entropy(model(ids), torch.zeros(16, dtype=torch.long,
                                                                  device=device())).backward()
            opt.step()
            weights.append(flat_params(model))
    return {"nan_step_changed": float((weights[1] - weights[0]).abs().max()),
            "nan_steps": opt.compression_stats()["nonfinite_steps"],
            "nan_warned": any("se_nan.emb.weight" in str(w.message) for w in caught),
            "nan_identical": ranks_identical(model, "se_nan")}


def backward_passes():
    """backward_passes_per_step=2 on half batches == 1 pass on the whole batch."""
    rank = hvd.rank()
    one, two = wide_mlp(4), wide_mlp(4)
    mk = lambda m, bpps, tag: hvd.DistributedOptimizer(  # noqa: E731
        torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
        named_parameters=[(tag + n, p) for n, p in m.named_parameters()],
        compression=hvd.Compression.topk, density=0.01, backward_passes_per_step=bpps)
    opt1, opt2 = mk(one, 1, "b1."), mk(two, 2, "b2.")
    for step in range(6):
        x, y = batch(step, rank, n=32, features=64, classes=10)
        opt1.zero_grad()
        nn.functional.cross_entropy(one(x), y).backward()
        opt1.step()
        opt2.zero_grad()
        for half in (slice(0, 16), slice(16, 32)):
            (nn.functional.cross_entropy(two(x[half]), y[half]) / 2).backward()
        opt2.step()
    too_many = expect_error(lambda: _three_passes(two, opt2, rank), AssertionError)
    return {"max_diff": max_diff(one, two), "too_many": too_many}


def _three_passes(model, opt, rank):
    opt.zero_grad()
    x, y = batch(99, rank, n=8, features=64, classes=10)
    for _ in range(3):
        nn.functional.cross_entropy(model(x), y).backward()


def _train_grouped(tag, seed, compression, explicit_groups):
    """Three copies of one model, trained with groups=None, groups=2 and explicit groups."""
    rank = hvd.rank()
    models = [wide_mlp(seed) for _ in range(3)]
    opts = []
    for i, m in enumerate(models):
        groups = [None, 2, explicit_groups(m)][i]
        opts.append(hvd.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
            named_parameters=[(f"{tag}{i}.{n}", p) for n, p in m.named_parameters()],
            compression=compression, density=0.01, groups=groups))
    for step in range(6):
        step_all(zip(models, opts), step, rank, features=64, classes=10)
    return models


def grouping():
    """groups=2 and explicit groups give the same weights as no grouping."""
    models = _train_grouped("g", 5, hvd.Compression.dgc,
                            lambda m: [[m[0].weight, m[2].weight], [m[0].bias, m[4].weight]])
    # The DGC sampler draws per tensor in launch order, which grouping changes, so
    # compare with exact top-k; with DGC every rank must still agree.
    # (fp32 values: in 8 bits a small tensor folded into a group's allgather is rounded,
    # with the rounding kept in its memory, where alone it goes exact in an allreduce)
    exact = _train_grouped("gt", 6, hvd.Compression.topk(value_bits=32),
                           lambda m: [[m[0].weight, m[2].weight]])
    # Horovod's own test_optimizer_no_named_parameters reads _parameter_names
    two = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10))
    unnamed = hvd.DistributedOptimizer(torch.optim.SGD(
        [{"params": two[0].parameters()}, {"params": two[1].parameters()}], lr=0.001))
    names = unnamed._parameter_names
    return {"identical": [ranks_identical(m, f"grp{i}") for i, m in enumerate(models)],
            "unnamed": sorted(names.values()),
            "unnamed_keys_are_params": sorted(id(p) for p in names) == sorted(
                id(p) for p in two.parameters()),
            "unnamed_everywhere": hvd.allgather_object(sorted(names.values())),
            "bad_groups": expect_error(lambda: hvd.DistributedOptimizer(
                torch.optim.SGD(models[0].parameters(), lr=0.1),
                named_parameters=[("x." + n, p) for n, p in models[0].named_parameters()],
                groups=[[models[0][0].weight, models[0][0].weight]]), ValueError),
            "topk_diffs": [max_diff(exact[0], exact[1]), max_diff(exact[0], exact[2])]}


def adam():
    """Adam: density 1.0 equals Horovod + Adam; at 0.01 with freeze_variance=False ranks stay
    identical (error feedback; the take-over: tests/torch/torch_adam.py)."""
    rank = hvd.rank()
    ref, ours, sparse = mlp(7), mlp(7), wide_mlp(7)
    opt_ref = hvd_stock.DistributedOptimizer(torch.optim.Adam(ref.parameters(), lr=1e-3),
                                             named_parameters=ref.named_parameters())
    opt = hvd.DistributedOptimizer(torch.optim.Adam(ours.parameters(), lr=1e-3),
                                   named_parameters=[("adam." + n, p) for n, p in
                                                     ours.named_parameters()], density=1.0)
    opt_s = hvd.DistributedOptimizer(torch.optim.Adam(sparse.parameters(), lr=1e-3),
                                     named_parameters=[("adams." + n, p) for n, p in
                                                       sparse.named_parameters()], density=0.01,
                                     freeze_variance=False)
    for step in range(15):
        step_all(((ref, opt_ref), (ours, opt)), step, rank)
        opt_s.zero_grad()
        loss_of(sparse, step, rank, features=64, classes=10).backward()
        opt_s.step()
    return {"max_diff": max_diff(ref, ours), "sparse_identical": ranks_identical(sparse, "adam"),
            "sparse_paths": opt_s.compression_stats()["paths"]}


def amp_pattern():
    """pytorch_mnist.py's AMP pattern: synchronize, unscale_, skip_synchronize + step.
    With a power-of-two loss scale the weights equal the unscaled run bit for bit, and an
    overflow on one rank makes every rank skip that step with nothing entering the memory."""
    rank = hvd.rank()
    plain, amp = wide_mlp(8), wide_mlp(8)
    kw = dict(compression=hvd.Compression.topk, density=0.01)
    opt_p = hvd.DistributedOptimizer(torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9),
                                     named_parameters=[("pl." + n, p) for n, p in
                                                       plain.named_parameters()], **kw)
    scaler = torch.amp.GradScaler(device().type, init_scale=2.0 ** 12, growth_interval=10 ** 6)
    opt_a = hvd.DistributedOptimizer(torch.optim.SGD(amp.parameters(), lr=0.1, momentum=0.9),
                                     named_parameters=[("amp." + n, p) for n, p in
                                                       amp.named_parameters()],
                                     grad_scaler=scaler, **kw)
    overflow_step = 4
    state = {"step": -1}

    def poison(grad):
        if state["step"] == overflow_step and rank == 1:
            return grad * float("inf")
        return grad
    amp[2].weight.register_hook(poison)

    caught, diffs, before_after = [], [], None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(8):
            state["step"] = step
            if step != overflow_step:
                opt_p.zero_grad()
                loss_of(plain, step, rank, features=64, classes=10).backward()
                opt_p.step()
            opt_a.zero_grad()
            before = flat_params(amp).clone()
            scaler.scale(loss_of(amp, step, rank, features=64, classes=10)).backward()
            opt_a.synchronize()
            scaler.unscale_(opt_a)
            with opt_a.skip_synchronize():
                scaler.step(opt_a)
            scaler.update()
            if step == overflow_step:
                before_after = float((flat_params(amp) - before).abs().max())
            diffs.append(max_diff(plain, amp))
    residual_finite = all(bool(torch.isfinite(s["v"]).all())
                          for s in opt_a.dgc_memory().values())
    return {"diffs": diffs, "warnings": [str(w.message) for w in caught],
            "overflow_steps": opt_a.compression_stats()["overflow_steps"],
            "skipped_step_change": before_after, "residual_finite": residual_finite,
            "identical": ranks_identical(amp, "amp"), "scale": float(scaler.get_scale())}


def state_roundtrip():
    """state_dict after k steps, loaded into fresh objects, resumes bit-identically."""
    rank = hvd.rank()

    def fresh(tag):
        m = wide_mlp(9)
        o = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                                     named_parameters=[(tag + n, p) for n, p in
                                                       m.named_parameters()],
                                     compression=hvd.Compression.dgc, density=0.01,
                                     warmup=4, warmup_unit="step")
        return m, o

    model, opt = fresh("a.")
    train(model, opt, 5, rank, features=64, classes=10)
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    train(model, opt, 5, rank, start=5, features=64, classes=10)

    model2, opt2 = fresh("b.")
    model2.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    train(model2, opt2, 5, rank, start=5, features=64, classes=10)
    has_residual = any(float(s["v"].abs().sum()) > 0 for s in saved_opt["hvd_dgc"]["memory"].values())
    return {"equal": torch.equal(flat_params(model), flat_params(model2)),
            "step": saved_opt["hvd_dgc"]["step"], "has_residual": has_residual,
            "broadcast_ok": _broadcast_state_keeps_residual(rank)}


def _broadcast_state_keeps_residual(rank):
    """hvd.broadcast_optimizer_state initialises with the base step (no collectives) and
    never overwrites a rank's own residual."""
    m = wide_mlp(10)
    o = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                                 named_parameters=[("bc." + n, p) for n, p in
                                                   m.named_parameters()], density=0.01)
    hvd.broadcast_parameters(m.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(o, root_rank=0)
    train(m, o, 2, rank, features=64, classes=10)
    before = {k: s["v"].clone() for k, s in o.dgc_memory().items()}
    hvd.broadcast_optimizer_state(o, root_rank=0)
    after = o.dgc_memory()
    return all(torch.equal(before[k], after[k]["v"]) for k in before)


def bad_inputs():
    rank = hvd.rank()
    m = mlp(11)
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    out = {}
    for bad in (0, 1.5, -0.1, float("nan")):
        out[f"density={bad}"] = expect_error(
            lambda: hvd.DistributedOptimizer(sgd(m.parameters()), density=bad), ValueError)
    out["density=str"] = expect_error(
        lambda: hvd.DistributedOptimizer(sgd(m.parameters()), density="0.1"), TypeError)
    out["missing_name"] = expect_error(lambda: hvd.DistributedOptimizer(
        sgd(m.parameters()), named_parameters=list(m.named_parameters())[:-1]), ValueError)
    out["duplicate_name"] = expect_error(lambda: hvd.DistributedOptimizer(
        sgd(m.parameters()), named_parameters=[("same", p) for p in m.parameters()]), ValueError)
    out["not_tuples"] = expect_error(lambda: hvd.DistributedOptimizer(
        sgd(m.parameters()), named_parameters=[[n, p] for n, p in m.named_parameters()]),
        ValueError)
    out["bpps=0"] = expect_error(lambda: hvd.DistributedOptimizer(
        sgd(m.parameters()), backward_passes_per_step=0), ValueError)
    out["adasum"] = expect_error(lambda: hvd.DistributedOptimizer(
        sgd(m.parameters()), op=hvd.Adasum), ValueError)
    out["dampening"] = expect_error(lambda: hvd.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, dampening=0.1)), ValueError)
    out["density_with_dense_compressor"] = expect_error(lambda: hvd.DistributedOptimizer(
        sgd(m.parameters()), compression=hvd.Compression.sign, density=0.01), ValueError)
    cplx = nn.Parameter(torch.zeros(4, dtype=torch.complex64))
    out["complex"] = expect_error(lambda: hvd.DistributedOptimizer(
        sgd([cplx]), named_parameters=[("c", cplx)]), TypeError)
    # sparse_as_dense=True: a sparse gradient densified, then DGC (sparse_embeddings: the
    # rest of the sparse-gradient behaviour, against Horovod's)
    emb2 = nn.Embedding(3000, 8, sparse=True)
    hvd.broadcast_parameters(emb2.state_dict(), root_rank=0)
    before = emb2.weight.detach().clone()
    o2 = hvd.DistributedOptimizer(sgd(emb2.parameters()), named_parameters=[("emb2", emb2.weight)],
                                  sparse_as_dense=True, density=0.01)
    emb2(torch.tensor([1, 2 + rank])).sum().backward()
    o2.step()
    changed = (emb2.weight.detach() - before).abs().sum(dim=1).nonzero().view(-1).tolist()
    out["sparse_as_dense_rows_changed"] = changed
    out["sparse_as_dense_identical"] = ranks_identical(emb2, "emb2")
    # Horovod's own optimizer given a sparse compressor: refused, naming the fix.
    m2 = mlp(12)
    stock = hvd_stock.DistributedOptimizer(sgd(m2.parameters()),
                                           named_parameters=[("stock." + n, p) for n, p in
                                                             m2.named_parameters()],
                                           compression=hvd.Compression.dgc)
    out["stock_optimizer"] = expect_error(lambda: loss_of(m2, 0, rank).backward(), TypeError)
    stock._handles.clear()
    return out


def inconsistent_config():
    """Different density on each rank: both ranks fail at wrap time, naming the difference."""
    m = mlp(13)
    density = 0.001 if hvd.rank() == 0 else 0.01
    return expect_error(lambda: hvd.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
        density=density), ValueError)


def process_sets():
    """Each rank in a process set of its own: averaging runs over that set only (size 1),
    so the two ranks drift apart, while a global-set optimizer beside it keeps them equal."""
    rank = hvd.rank()
    mine = _PROCESS_SETS[rank]
    a, b = wide_mlp(14), wide_mlp(14)
    oa = hvd.DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9),
                                  named_parameters=[("psg." + n, p) for n, p in a.named_parameters()],
                                  compression=hvd.Compression.topk, density=0.01)
    ob = hvd.DistributedOptimizer(torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9),
                                  named_parameters=[("pss." + n, p) for n, p in b.named_parameters()],
                                  compression=hvd.Compression.topk, density=0.01,
                                  process_set=mine)
    train(a, oa, 4, rank, features=64, classes=10)
    train(b, ob, 4, rank, features=64, classes=10)
    stats = ob.compression_stats()
    return {"global_identical": ranks_identical(a, "ps.a"),
            "set_identical": ranks_identical(b, "ps.b"),
            "set_world_size": stats["world_size"], "set_steps": stats["steps"],
            "set_paths": stats["paths"]}


_PROCESS_SETS = ()


def with_process_sets(names):
    global _PROCESS_SETS
    _PROCESS_SETS = (hvd.ProcessSet([0]), hvd.ProcessSet([1]))
    hvd.init(process_sets=list(_PROCESS_SETS))
    return _run(names)


def sparse_step():
    """step() synchronizing itself: the averages become views of the exchange's buffers and
    the step runs where the records landed only (update.py ViewUpdate and
    step_at_records: SGD's, frozen AdamW's). Against the explicit synchronize();
    skip_synchronize(): step() (dense gradients, the dense step over them), side by
    side: weights and gradients bit-identical after every step, with zero_grad's
    set_to_none True and False and the patterns mixed, two param groups, maximize."""
    import hvd_dgc.torch.adam as adam_module
    import hvd_dgc.torch.sgd as sgd_module
    rank = hvd.rank()
    stepped = []
    original = sgd_module.step_at_records

    def spy(updates, alphas):
        params = original(updates, alphas)
        stepped.append(len(params))
        return params

    def make(tag, variant):
        model = nn.Sequential(nn.Flatten(), *wide_mlp(5))
        first, rest = list(model.parameters())[:2], list(model.parameters())[2:]
        named = [(f"{tag}.{n}", p) for n, p in model.named_parameters()]
        if variant == "adamw":  # the variance frozen after 2 steps
            opt = torch.optim.AdamW([{"params": first, "lr": 0.01},
                                     {"params": rest, "lr": 0.005, "weight_decay": 0.1}])
            return model, hvd.DistributedOptimizer(
                opt, named_parameters=named, density=0.004, freeze_variance=2)
        opt = torch.optim.SGD([{"params": first, "lr": 0.05},
                               {"params": rest, "lr": 0.02, "weight_decay": 1e-3}],
                              momentum=0.9, maximize=variant == "sgd maximize")
        return model, hvd.DistributedOptimizer(
            opt, named_parameters=named, compression="dgc", density=0.004)

    out = {}
    sgd_module.step_at_records = adam_module.step_at_records = spy
    try:
        for n, variant in enumerate(("sgd", "sgd maximize", "adamw")):
            runs = {how: make(f"ss{n}{how}", variant)
                    for how in ("explicit", "step", "kept", "mixed")}
            diffs, grad_diffs, counts = [], [], {}
            for step in range(8):
                grads = {}
                for how, (model, opt) in runs.items():
                    # mixed: the patterns in turn (a buffer written through its views
                    # by the explicit pattern must be zeroed in full afterwards)
                    explicit = how == "explicit" or (how == "mixed" and step % 3 == 1)
                    opt.zero_grad(set_to_none=how != "kept" and not (
                        how == "mixed" and step % 3 == 1))
                    loss_of(model, step, rank, features=64, classes=10).backward()
                    before = len(stepped)
                    if explicit:
                        opt.synchronize()
                        with opt.skip_synchronize():
                            opt.step()
                    else:
                        opt.step()
                    counts[how] = counts.get(how, 0) + sum(stepped[before:])
                    grads[how] = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
                ref = runs["explicit"][0]
                others = ("step", "kept", "mixed")
                diffs.append(max(max_diff(ref, runs[h][0]) for h in others))
                grad_diffs.append(max(float((grads["explicit"] - grads[h]).abs().max())
                                      for h in others))
            out[variant] = {
                "max_diff": max(diffs), "grad_diff": max(grad_diffs), "stepped": counts,
                "moved": max_diff(ref, nn.Sequential(nn.Flatten(), *wide_mlp(5))),
                "grad_sum": float(grads["explicit"].abs().sum()),
                "identical": ranks_identical(runs["step"][0], f"ss_ident{n}")}
    finally:
        sgd_module.step_at_records = adam_module.step_at_records = original
    return out


def fp16_records():
    """fp16 record values (Compression.dgc(fp16_values=True, value_bits=16)): what fp16
    rounds off a sent value stays in the sender's memory (error feedback), the rest of
    the memory is the gradient untouched, and the average is the fp32 mean of what the
    ranks sent."""
    rank, n = hvd.rank(), 4096
    p = nn.Parameter(torch.zeros(n))
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD([p], lr=1.0), named_parameters=[("fp16r.w", p)], density=0.01,
        warmup=0, cost_model=hvd.CostModel(),
        compression=hvd.Compression.dgc(fp16_values=True, value_bits=16))
    g = (torch.arange(n, dtype=torch.float32) * 1e-3 + 1 / 3) * (1 + rank)
    p.grad = g.clone()
    opt.step()
    v = opt.residual(p).detach().clone()
    sent = v != g  # a sent value leaves only its rounding behind
    rounding = g - g.half().float()
    gathered = hvd.allgather(torch.where(sent, g.half().float(), 0.0).view(1, -1))
    return {"sent": int(sent.sum()), "rounding_kept": float((v - rounding)[sent].abs().max()),
            "rounding_nonzero": int((rounding[sent] != 0).sum()),
            "unsent_untouched": bool(torch.equal(v[~sent], g[~sent])),
            "average_diff": float((-p.detach() - gathered.mean(0)).abs().max())}


def fp8_records():
    """8-bit record values (the default, value_bits=8): each sent value arrives as
    tests/reference.py ``fp8_values`` says (float8 e4m3 of value / scale, the scale the
    tensor's largest sent magnitude / 448), what the rounding loses stays in the
    sender's memory, the rest of the memory is the gradient untouched, and the average
    is the mean of what arrived from each rank."""
    from tests.reference import fp8_values
    rank, n = hvd.rank(), 4096
    p = nn.Parameter(torch.zeros(n))
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD([p], lr=1.0), named_parameters=[("fp8r.w", p)], density=0.01,
        warmup=0, cost_model=hvd.CostModel())
    g = (torch.arange(n, dtype=torch.float32) * 1e-3 + 1 / 3) * (1 + rank)
    p.grad = g.clone()
    opt.step()
    v = opt.residual(p).detach().clone()
    sent = (v != g).numpy()
    _, _, arrived = fp8_values(g.numpy()[sent], np.zeros(sent.sum(), np.int64), 1)
    arrived = torch.from_numpy(arrived)
    gathered = hvd.allgather(torch.zeros(n).index_put_(
        (torch.from_numpy(sent.nonzero()[0]),), arrived).view(1, -1))
    sent = torch.from_numpy(sent)
    return {"sent": int(sent.sum()),
            "rounding_kept": float((v[sent] - (g[sent] - arrived)).abs().max()),
            "rounding_nonzero": int((g[sent] != arrived).sum()),
            "unsent_untouched": bool(torch.equal(v[~sent], g[~sent])),
            "average_diff": float((-p.detach() - gathered.mean(0)).abs().max()),
            "bytes": opt.compression_stats()["last_step"]["bytes_sent"]}


def fp16_outlier():  # in the gloo launch of tests/torch/test_optimizer.py
    from tests.fp16_wire import torch_outlier
    return torch_outlier()


def suite(names, module=None):
    """Run scenarios by name (from ``module``, default this one) after ``hvd.init()``."""
    hvd.init()
    return _run(names, module)


def _run(names, module=None):
    scope = globals() if module is None else vars(module)
    results = {}
    for name in names:
        try:
            results[name] = scope[name]()
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    return results
