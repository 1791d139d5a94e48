"""Reliability scenarios on every rank (tests/torch/test_reliability.py): kill and resume
from per-rank checkpoints, non-finite gradients, a rank killed mid-step, Horovod's own
optimizer behaviours, elastic Horovod."""

import os
import signal
import sys
import time
import warnings

import torch
import torch.nn as nn

import hvd_dgc.torch as hvd
from tests.torch.torch_dgc import (_run, flat_params, loss_of, mlp,
                                     ranks_identical, wide_mlp)

WIDE = dict(features=64, classes=10)


def _train(model, opt, start, stop, rank, before_backward=None):
    for i in range(start, stop):
        opt.zero_grad()
        if before_backward is not None:
            before_backward(i)
        loss_of(model, i, rank, **WIDE).backward()
        opt.step()


def _memory(opt):
    """A copy of every DGC buffer (residual v, velocity u) of this rank."""
    return {(key, name): t for key, s in opt.dgc_memory().items()
            for name, t in s.items() if t is not None}


def _same_memory(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- 1. kill and resume ---------------------------------------------------------------
# DGC 1% with momentum, weight decay, local clipping and a step warm-up; and the same with
# delayed averaging (delay=2, flushed at the checkpoint, as state_dict() requires).
RESUME_VARIANTS = {
    "dgc": dict(density=0.01, warmup=3, warmup_unit="step", clip_norm=2.0),
    "dga": dict(density=0.01, delay=2),
}
TOTAL, CHECKPOINT = 10, 5


def _resumable(variant, tag):
    model = wide_mlp(21)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4),
        named_parameters=[(tag + n, p) for n, p in model.named_parameters()],
        compression=hvd.Compression.dgc, **RESUME_VARIANTS[variant])
    return model, opt


def _path(ckdir, what, rank):
    return os.path.join(ckdir, f"{what}.rank{rank}.pt")


def kill_after_checkpoint(ckdir):
    """Train the uninterrupted reference, then the run that checkpoints at CHECKPOINT
    (one file per rank), trains on, and is SIGKILLed in the middle of a step."""
    hvd.init()
    rank = hvd.rank()
    for variant in RESUME_VARIANTS:
        model, opt = _resumable(variant, "ref.")
        _train(model, opt, 0, CHECKPOINT, rank)
        opt.flush()  # the interrupted run flushes here to checkpoint: so does the reference
        _train(model, opt, CHECKPOINT, TOTAL, rank)
        opt.flush()
        torch.save(flat_params(model), _path(ckdir, variant + ".reference", rank))

        model, opt = _resumable(variant, "run.")
        _train(model, opt, 0, CHECKPOINT, rank)
        opt.flush()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                   _path(ckdir, variant + ".checkpoint", rank))
    hvd.allreduce(torch.zeros(1), name="checkpoints.written")  # every rank's file is on disk
    _train(model, opt, CHECKPOINT, CHECKPOINT + 2, rank)
    opt.zero_grad()
    loss_of(model, CHECKPOINT + 2, rank, **WIDE).backward()  # collectives now in flight
    print(f"rank {rank}: SIGKILL at step {CHECKPOINT + 2}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def resume(ckdir):
    """A new launch: load this rank's checkpoint, train to TOTAL, compare with the reference."""
    hvd.init()
    rank = hvd.rank()
    out = {}
    for variant in RESUME_VARIANTS:
        saved = torch.load(_path(ckdir, variant + ".checkpoint", rank), weights_only=False)
        reference = torch.load(_path(ckdir, variant + ".reference", rank))
        dgc_state = saved["optimizer"]["hvd_dgc"]
        res = {"saved_step": dgc_state["step"], "saved_rank": dgc_state["rank"],
               "saved_generators": len(dgc_state["compressor"].get("generators", {})),
               "saved_residual": sum(float(s["v"].abs().sum())
                                     for s in dgc_state["memory"].values())}
        # Control: the same resume without hvd_dgc's state (a plain torch checkpoint).
        for with_dgc_state in (True, False):
            model, opt = _resumable(variant, f"resume{int(with_dgc_state)}.")
            model.load_state_dict(saved["model"])
            state = dict(saved["optimizer"])
            if not with_dgc_state:
                del state["hvd_dgc"]
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                opt.load_state_dict(state)
            _train(model, opt, CHECKPOINT, TOTAL, rank)
            opt.flush()
            key = "resumed" if with_dgc_state else "without_dgc_state"
            res[key + "_max_diff"] = float((flat_params(model) - reference).abs().max())
            res[key + "_warnings"] = [str(w.message) for w in caught]
            if with_dgc_state:
                res["step"] = opt.compression_stats()["step"]
                res["identical"] = ranks_identical(model, "resume." + variant)
        res["moved"] = float((reference - flat_params(_resumable(variant, "x.")[0])).abs().max())
        out[variant] = res
    # Loading the other rank's file: a warning that says so.
    other = torch.load(_path(ckdir, "dgc.checkpoint", 1 - rank), weights_only=False)
    _, opt = _resumable("dgc", "other.")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.load_state_dict(other["optimizer"])
    out["other_rank_warnings"] = [str(w.message) for w in caught]
    return out


# -- 2. non-finite gradients -------------------------------------------------------------
BAD_STEP, STEPS = 3, 8
NONFINITE_VARIANTS = {
    # name: (optimizer options, parameter poisoned on rank 1, poison)
    "dgc_sparse_nan": (dict(compression=hvd.Compression.dgc, density=0.01), 2, float("nan")),
    "dgc_dense_inf": (dict(compression=hvd.Compression.dgc, density=0.01), 3, float("inf")),
    "density1_nan": (dict(compression=hvd.Compression.dgc, density=1.0), 2, float("nan")),
}


def _guarded(tag, **options):
    model = wide_mlp(22)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=[(tag + n, p) for n, p in model.named_parameters()], **options)
    return model, opt


def _poisoner(model, index, value, rank, bad_rank=1, bad_step=BAD_STEP):
    """Makes ``list(model.parameters())[index]``'s gradient non-finite on ``bad_rank`` at
    ``bad_step`` (one element; the rest stays finite), inside backward, before hvd_dgc's
    hook sees it. Returns the ``before_step`` callback that tells it the step."""
    param, now = list(model.parameters())[index], {"step": -1}

    def poison(grad):
        if now["step"] == bad_step and rank == bad_rank:
            grad = grad.clone()
            grad.view(-1)[7] = value
        return grad
    param.register_hook(poison)

    def set_step(i):
        now["step"] = i
    return set_step


def nonfinite_skip():
    """One rank's NaN/Inf at step BAD_STEP: both ranks skip that step (weights, memory and
    step count unchanged), and training goes on exactly as a run without that step."""
    rank = hvd.rank()
    out = {}
    for name, (options, index, value) in NONFINITE_VARIANTS.items():
        model, opt = _guarded(name + ".", **options)
        reference, opt_ref = _guarded(name + ".ref.", **options)
        poison = _poisoner(model, index, value, rank)
        _train(model, opt, 0, BAD_STEP, rank, poison)
        _train(reference, opt_ref, 0, BAD_STEP, rank)
        weights, memory = flat_params(model).clone(), _memory(opt)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _train(model, opt, BAD_STEP, BAD_STEP + 1, rank, poison)
        res = {"weights_unchanged": torch.equal(weights, flat_params(model)),
               "memory_unchanged": _same_memory(memory, _memory(opt)),
               "step_after_skip": opt.compression_stats()["step"],
               "warnings": [str(w.message) for w in caught
                            if issubclass(w.category, RuntimeWarning)]}
        _train(model, opt, BAD_STEP + 1, STEPS, rank, poison)
        _train(reference, opt_ref, BAD_STEP + 1, STEPS, rank)  # never sees step BAD_STEP
        stats = opt.compression_stats()
        res.update(max_diff_vs_without_step=float((flat_params(model) -
                                                   flat_params(reference)).abs().max()),
                   moved=float((flat_params(model) - weights).abs().max()),
                   nonfinite_steps=stats["nonfinite_steps"], step=stats["step"],
                   memory_finite=all(bool(torch.isfinite(t).all())
                                     for t in _memory(opt).values()),
                   identical=ranks_identical(model, "nf." + name),
                   paths=stats["paths"])
        out[name] = res
    # The guard is what protects: without it the NaN stays in rank 1's memory (the
    # selection need not pick it), and the weights move on as if the step had happened.
    model, opt = _guarded("off.", density=0.01, skip_nonfinite=False)
    _train(model, opt, 0, STEPS, rank, _poisoner(model, 2, float("nan"), rank))
    out["off"] = {"memory_finite": all(bool(torch.isfinite(t).all())
                                       for t in _memory(opt).values()),
                  "step": opt.compression_stats()["step"]}
    return out


def nonfinite_delayed():
    """delay=2: the rank with the NaN sends zeros for that step and keeps it out of its
    memory; the others keep their part. After flush every rank holds the same finite weights."""
    rank = hvd.rank()
    model, opt = _guarded("nfd.", density=0.01, delay=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(model, opt, 0, STEPS, rank, _poisoner(model, 2, float("nan"), rank))
    opt.flush()
    stats = opt.compression_stats()
    return {"nonfinite_steps": stats["nonfinite_steps"], "step": stats["step"],
            "weights_finite": bool(torch.isfinite(flat_params(model)).all()),
            "memory_finite": all(bool(torch.isfinite(t).all()) for t in _memory(opt).values()),
            "identical": ranks_identical(model, "nfd"),
            "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]}


def suite(names):
    hvd.init()
    return _run(names, sys.modules[__name__])


# -- 4. a rank killed mid-step -----------------------------------------------------------
def killed_rank(kill_step=3):
    """Rank 1 SIGKILLs itself mid-step at ``kill_step`` (forward done, before backward, so
    its part of that step's collectives never leaves); rank 0 must fail with an error, not
    wait forever. Rank 0 prints how long it took."""
    hvd.init()
    rank = hvd.rank()
    model = wide_mlp(23)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), density=0.01)
    for i in range(kill_step + 1):
        opt.zero_grad()
        loss = loss_of(model, i, rank, **WIDE)
        if i == kill_step and rank == 1:
            print(f"rank 1: SIGKILL mid-step at {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        start = time.monotonic()
        try:
            opt.step()
        except Exception as exc:
            print(f"rank 0: {type(exc).__name__} after {time.monotonic() - start:.1f} s: "
                  f"{exc}", flush=True)
            raise
    return "rank 0 finished a step whose peer was dead"


# -- 3. Horovod's own optimizer behaviours (its test_torch.py), at density 1.0 and 0.001 --
import horovod.torch as hvd_stock  # noqa: E402

DENSITIES = (1.0, 0.001)


def _pair(make_model, density, tag, opt_class=torch.optim.SGD, stock=True, **opt_kw):
    """The same model under hvd_dgc at ``density`` and (density 1.0) under Horovod itself."""
    opt_kw = opt_kw or dict(lr=0.1, momentum=0.9)
    ours = make_model()
    opt = hvd.DistributedOptimizer(opt_class(ours.parameters(), **opt_kw),
                                   named_parameters=[(f"{tag}.{density}.{n}", p)
                                                     for n, p in ours.named_parameters()],
                                   density=density)
    if not stock or density != 1.0:
        return ours, opt, None, None
    ref = make_model()
    opt_ref = hvd_stock.DistributedOptimizer(opt_class(ref.parameters(), **opt_kw),
                                             named_parameters=[(f"{tag}.stock.{n}", p)
                                                               for n, p in ref.named_parameters()])
    return ours, opt, ref, opt_ref


def _both(ours, opt, ref, opt_ref):
    """The (model, optimizer) pairs to step: hvd_dgc's, and Horovod's when there is one."""
    return [(ours, opt)] + ([(ref, opt_ref)] if ref is not None else [])


def _report(ours, opt, ref, tag, start):
    out = {"identical": ranks_identical(ours, tag),
           "moved": float((flat_params(ours) - start).abs().max()),
           "finite": bool(torch.isfinite(flat_params(ours)).all()),
           "paths": opt.compression_stats()["paths"]}
    if ref is not None:
        out["max_diff_vs_horovod"] = float((flat_params(ours) - flat_params(ref)).abs().max())
    return out


class _Branches(nn.Module):
    """Rank 0 uses branch a, rank 1 branch b: each rank computes gradients for a different
    subset of parameters (Horovod's test_force_allreduce)."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.trunk = nn.Linear(64, 128)
        self.a, self.b = nn.Linear(128, 10), nn.Linear(128, 10)

    def forward(self, x):
        h = torch.relu(self.trunk(x))
        return self.a(h) if hvd.rank() % 2 == 0 else self.b(h)


def force_allreduce():
    """Parameters unused on a rank still join every collective (zero gradient): no hang,
    the same weights everywhere, and at density 1 Horovod's result."""
    rank, out = hvd.rank(), {}
    for density in DENSITIES:
        ours, opt, ref, opt_ref = _pair(lambda: _Branches(31), density, "fa")
        start = flat_params(ours).clone()
        for i in range(6):
            for model, o in _both(ours, opt, ref, opt_ref):
                o.zero_grad()
                x, y = _xy(i, rank)
                nn.functional.cross_entropy(model(x), y).backward()
                o.step()
        out[density] = _report(ours, opt, ref, f"fa.{density}", start)
        out[density]["branch_moved"] = [float((getattr(ours, b).weight - getattr(
            _Branches(31), b).weight).abs().max()) for b in ("a", "b")]
    return out


def _xy(step, rank):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 64, generator=gen), torch.randint(0, 10, (16,), generator=gen)


def clip_via_synchronize(max_norm=0.05):
    """synchronize(); clip_grad_norm_ on the averaged gradient; skip_synchronize(): step()
    (Horovod's test_gradient_clipping): the applied update is the clipped average."""
    rank, out = hvd.rank(), {}
    for density in DENSITIES:
        ours, opt, ref, opt_ref = _pair(lambda: wide_mlp(32), density, "clip", lr=0.1)
        start = flat_params(ours).clone()
        norms, caught_all = [], []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(5):
                for model, o in _both(ours, opt, ref, opt_ref):
                    o.zero_grad()
                    loss_of(model, i, rank, **WIDE).backward()
                    o.synchronize()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                    before = flat_params(model).clone()
                    with o.skip_synchronize():
                        o.step()
                    if model is ours:  # plain SGD: the step moved by lr * clipped gradient
                        norms.append(float((before - flat_params(model)).norm() / 0.1))
            caught_all = [str(w.message) for w in caught]
        out[density] = _report(ours, opt, ref, f"clip.{density}", start)
        out[density].update(update_norms=norms, warnings=caught_all)
    # step() right after synchronize() without skip_synchronize(): Horovod's warning.
    model, opt, _, _ = _pair(lambda: mlp(33), 0.001, "warn", stock=False)
    loss_of(model, 0, rank).backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    out["step_after_synchronize_warnings"] = [str(w.message) for w in caught]
    return out


def dynamic_requires_grad():
    """Horovod's test_dynamic_requires_grad (a GAN: generator and discriminator trained
    in turn, the other frozen), and one layer frozen after the first step."""
    rank, out = hvd.rank(), {}
    for density in DENSITIES:
        torch.manual_seed(34)
        gen, disc = nn.Linear(64, 128), nn.Linear(128, 1)
        hvd.broadcast_parameters(gen.state_dict(), root_rank=0)
        hvd.broadcast_parameters(disc.state_dict(), root_rank=0)
        opts = [hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                         named_parameters=[(f"gan.{tag}.{density}.{n}", p)
                                                           for n, p in m.named_parameters()],
                                         density=density)
                for tag, m in (("g", gen), ("d", disc))]
        grads_as_expected = []
        for i in range(6):
            train_gen = i % 2 == 0
            for p in gen.parameters():
                p.requires_grad_(train_gen)
            for p in disc.parameters():
                p.requires_grad_(not train_gen)
            for o in opts:
                o.zero_grad()
            x, _ = _xy(i, rank)
            disc(torch.relu(gen(x))).sum().backward()
            grads_as_expected.append(
                all((p.grad is not None) == train_gen for p in gen.parameters()) and
                all((p.grad is not None) != train_gen for p in disc.parameters()))
            opts[0 if train_gen else 1].step()
        for m in (gen, disc):
            for p in m.parameters():
                p.requires_grad_(True)
        both = nn.Sequential(gen, disc)
        res = {"grads_as_expected": grads_as_expected,
               "identical": ranks_identical(both, f"gan{density}")}

        # One layer frozen after step 1 (hooks were registered while it was trainable): it
        # gets a zero gradient like in Horovod; momentum and the residual still apply.
        ours, opt, ref, opt_ref = _pair(lambda: wide_mlp(35), density, "freeze")
        start = flat_params(ours).clone()
        for i in range(5):
            for model, o in _both(ours, opt, ref, opt_ref):
                model[0].weight.requires_grad_(i == 0)
                o.zero_grad()
                loss_of(model, i, rank, **WIDE).backward()
                o.step()
        res.update(_report(ours, opt, ref, f"freeze.{density}", start))
        out[density] = res
    return out


def broadcast_state():
    """Horovod's test_broadcast_state(_options): after broadcast_optimizer_state every rank
    holds rank 0's optimizer state and options (lr, momentum, Adam's moments), while each
    rank's DGC residual stays its own."""
    rank, out = hvd.rank(), {}
    for density in DENSITIES:
        res = {}
        options = ((torch.optim.SGD, dict(lr=0.1 * (rank + 1), momentum=0.5 + 0.1 * rank)),
                   (torch.optim.Adam, dict(lr=1e-3 * (rank + 1), betas=(0.8 + 0.1 * rank, 0.99))))
        for opt_class, kw in options:
            tag = f"bs.{opt_class.__name__}.{density}"
            model = wide_mlp(36 + rank)  # different weights on every rank
            opt = hvd.DistributedOptimizer(opt_class(model.parameters(), **kw),
                                           named_parameters=[(f"{tag}.{n}", p) for n, p in
                                                             model.named_parameters()],
                                           density=density)
            _train(model, opt, 0, 2, rank)
            residual = _memory(opt)
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            hvd.broadcast_optimizer_state(opt, root_rank=0)
            kept = _same_memory(residual, _memory(opt))
            group = opt.param_groups[0]
            base = [t for s in opt.state_dict()["state"].values() for t in s.values()
                    if torch.is_tensor(t) and t.numel() > 1]
            flat = torch.cat([t.reshape(-1).float() for t in base]) if base else torch.zeros(1)
            everyone = hvd.allgather(flat.unsqueeze(0), name=tag)
            _train(model, opt, 2, 4, rank)
            res[opt_class.__name__] = {
                "options": [group["lr"], group["momentum"] if "momentum" in group
                            else list(group["betas"])],
                "base_state_identical": all(torch.equal(everyone[0], e) for e in everyone),
                "base_state_tensors": len(base),
                "residual_buffers": len(residual),
                "residual_kept": kept,
                "identical_after": ranks_identical(model, tag + ".after"),
            }
        out[density] = res
    return out


class _TwoParts(nn.Module):
    """Horovod's test_model_parallelism puts a model's two halves on two GPUs; with only a
    CPU here the halves differ in dtype instead (float32 then float64, casts between), and a
    rank-local head is trained by a plain torch optimizer, outside DistributedOptimizer."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.first = nn.Linear(64, 128)
        self.second = nn.Linear(128, 10).double()
        torch.manual_seed(seed + 1 + hvd.rank())
        self.local = nn.Linear(10, 10)

    def forward(self, x):
        return self.local(self.second(torch.relu(self.first(x)).double()).float())


def model_parallel():
    rank, out = hvd.rank(), {}
    for density in DENSITIES:
        models, opts = [], []
        for stock in (False, True):
            if stock and density != 1.0:
                break
            m = _TwoParts(37)
            shared = [(n, p) for n, p in m.named_parameters() if not n.startswith("local")]
            base = torch.optim.SGD([p for _, p in shared], lr=0.1, momentum=0.9)
            named = [(f"mp.{stock}.{density}.{n}", p) for n, p in shared]
            opt = (hvd_stock.DistributedOptimizer(base, named_parameters=named) if stock else
                   hvd.DistributedOptimizer(base, named_parameters=named, density=density))
            models.append(m)
            opts.append((opt, torch.optim.SGD(m.local.parameters(), lr=0.1)))
        start = flat_params(models[0]).clone()
        for i in range(5):
            for m, (opt, local_opt) in zip(models, opts):
                opt.zero_grad()
                local_opt.zero_grad()
                x, y = _xy(i, rank)
                nn.functional.cross_entropy(m(x), y).backward()
                opt.step()
                local_opt.step()
        ours = models[0]
        shared = nn.ModuleList([ours.first, ours.second])
        res = {"shared_identical": ranks_identical(shared, f"mp.{density}"),
               "local_identical": ranks_identical(ours.local, f"mpl.{density}"),
               "dtypes": [str(ours.first.weight.dtype), str(ours.second.weight.dtype)],
               "moved": float((flat_params(ours) - start).abs().max()),
               "buffer_dtypes": sorted({str(t.dtype) for t in _memory(opts[0][0]).values()})}
        if len(models) > 1:
            res["max_diff_vs_horovod"] = max(
                float((a.detach().double() - b.detach().double()).abs().max())
                for a, b in zip(shared.parameters(),
                                nn.ModuleList([models[1].first, models[1].second]).parameters()))
        out[density] = res
    return out


def no_named_parameters():
    """Horovod's test_optimizer_no_named_parameters: names are generated, training works."""
    rank, out = hvd.rank(), {}
    for density in DENSITIES:
        model = wide_mlp(38)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       density=density)
        start = flat_params(model).clone()
        _train(model, opt, 0, 3, rank)
        out[density] = {"identical": ranks_identical(model, f"nn.{density}"),
                        "moved": float((flat_params(model) - start).abs().max()),
                        "names": sorted(opt.compression_stats()["last_step"]["tensors"])[:2]}
    return out

