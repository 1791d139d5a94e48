"""Delayed gradient averaging (``delay=D``) on every rank, checked against a
single-process simulation of the DGA update rule written out here."""

import copy
import math
import time

import torch

import horovod.torch as hvd_stock
import hvd_dgc.torch as hvd
from hvd_dgc.schedule import as_schedule
from tests.lagged import AUTO
from tests.torch.torch_dgc import (expect_error, flat_params, loss_of, mlp,
                                     ranks_identical, step_all)


def simulate_dga(model0, steps, size, delay, lr, momentum=0.0, weight_decay=0.0,
                 density=None, passes=1, period=1):
    """Every worker of a DGA run, in one process. ``density(step)`` None = dense.

    Per worker r and step i (DGC momentum correction, then DGA):
        g = sum of the step's backward passes + wd * w_r
        u = m u + g;  v += u
        an exchange step ((i + 1) % period == 0):
            own = v[top-k] (all of v when dense);  v[sent] = 0
            (and u[sent] = 0 when sparse: momentum factor masking);  avg_i = mean of own
        a step between exchanges (period > 1): own = u (what v just took in); no avg
        w_r -= lr * own_i
        at step s + D, for each exchange step s:
            w_r -= lr * (avg_s - sum of own_j over s's period, j = s-period+1 .. s)
    flush: the same for every exchange not yet applied, and -own_j for the steps
    after the last exchange (their v is still in the memory).
    ``delay`` may be a list, the D in force at each step (delay="auto"): an exchange
    takes the D its period began with, and is applied no earlier than the one before.
    """
    delays = list(delay) if isinstance(delay, (list, tuple)) else [delay] * steps
    due, last = {}, -1
    for s in range(period - 1, steps, period):
        due[s] = last = max(s + delays[s - period + 1], last)
    workers = [copy.deepcopy(model0) for _ in range(size)]
    shapes = [p.numel() for p in model0.parameters()]
    dev = next(model0.parameters()).device
    u = [[torch.zeros(n, device=dev) for n in shapes] for _ in range(size)]
    v = [[torch.zeros(n, device=dev) for n in shapes] for _ in range(size)]
    history = []  # per step: (own[r][j], avg[j] or None between exchanges)

    def correct(s):
        """Apply exchange s's average in place of its period's own steps."""
        owns_of = [history[j][0] for j in range(s - period + 1, s + 1)]
        avg = history[s][1]
        for r, model in enumerate(workers):
            with torch.no_grad():
                for j, p in enumerate(model.parameters()):
                    took = sum(o[r][j] for o in owns_of)
                    p -= lr * (avg[j] - took).view(p.shape)

    for i in range(steps):
        exchange = (i + 1) % period == 0
        owns = []
        for r, model in enumerate(workers):
            model.zero_grad()
            for pass_ in range(passes):
                loss_of(model, i * passes + pass_, r).backward()
            own_r = []
            for j, p in enumerate(model.parameters()):
                g = p.grad.reshape(-1) + weight_decay * p.detach().reshape(-1)
                u[r][j] = momentum * u[r][j] + g
                v[r][j] += u[r][j]
                if not exchange:
                    own = u[r][j].clone()
                elif density is None:
                    own = v[r][j].clone()
                    v[r][j].zero_()
                else:
                    k = max(1, math.ceil(v[r][j].numel() * density(i)))
                    idx = torch.topk(v[r][j].abs(), k).indices
                    own = torch.zeros_like(v[r][j])
                    own[idx] = v[r][j][idx]
                    v[r][j][idx] = 0
                    u[r][j][idx] = 0
                own_r.append(own)
            owns.append(own_r)
        avg = [sum(owns[r][j] for r in range(size)) / size
               for j in range(len(shapes))] if exchange else None
        history.append((owns, avg))
        for r, model in enumerate(workers):
            with torch.no_grad():
                for j, p in enumerate(model.parameters()):
                    p -= lr * owns[r][j].view(p.shape)
        for s in sorted(s for s, at in due.items() if at == i):
            correct(s)
    for s in sorted(s for s, at in due.items() if at >= steps):  # flush
        correct(s)
    last = max([s for s in range(steps) if history[s][1] is not None], default=-1)
    for r, model in enumerate(workers):
        with torch.no_grad():
            for i in range(last + 1, steps):
                for j, p in enumerate(model.parameters()):
                    p += lr * history[i][0][r][j].view(p.shape)
    return workers


def _train(model, opt, steps, rank, passes=1, start=0):
    identical_before_flush = []
    for i in range(start, start + steps):
        opt.zero_grad()
        for pass_ in range(passes):
            loss_of(model, i * passes + pass_, rank).backward()
        opt.step()
        identical_before_flush.append(ranks_identical(model, "dga.check.%d" % i))
    return identical_before_flush


def delay_zero_is_synchronous():
    """delay=0, period=1 == Horovod's synchronous DistributedOptimizer, bit for bit (plain
    SGD)."""
    rank = hvd.rank()
    ref, ours = mlp(seed=3), mlp(seed=3)
    opt_ref = hvd_stock.DistributedOptimizer(torch.optim.SGD(ref.parameters(), lr=0.1),
                                             named_parameters=ref.named_parameters())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(ours.parameters(), lr=0.1),
                                   named_parameters=[("d0." + n, p) for n, p in
                                                     ours.named_parameters()],
                                   density=1.0, delay=0, period=1)
    equal = []
    for i in range(20):
        step_all(((ref, opt_ref), (ours, opt)), i, rank)
        equal.append(torch.equal(flat_params(ref), flat_params(ours)))
    moved = float((flat_params(ours) - flat_params(mlp(seed=3))).abs().max())
    return {"equal_each_step": equal, "moved": moved, "in_flight": opt.in_flight}


def _compression(name):
    """The compressor by name; top-k with fp32 values, as the simulations send them (8-bit
    values' rounding: tests/torch/test_optimizer.py)."""
    return hvd.Compression.topk(value_bits=32) if name == "topk" else \
        getattr(hvd.Compression, name)


VARIANTS = {
    # name: (compression, density or None, momentum, weight decay, passes, warm-up steps)
    "dense_sgd": ("none", None, 0.0, 0.0, 1, 0),
    "dense_momentum": ("none", None, 0.9, 1e-3, 1, 0),
    "dense_momentum_bpps2": ("none", None, 0.9, 0.0, 2, 0),
    "topk_momentum_warmup": ("topk", 0.02, 0.9, 1e-3, 1, 4),
}


def delay_two_matches_simulation(steps=10, delay=2, lr=0.05):
    rank, size = hvd.rank(), hvd.size()
    out = {}
    for name, (comp, density, momentum, wd, passes, warmup) in VARIANTS.items():
        model = mlp(seed=5)
        start = copy.deepcopy(model)
        kwargs = dict(compression=_compression(comp), delay=delay,
                      backward_passes_per_step=passes)
        schedule = None
        if density is None:  # dense, said explicitly
            kwargs.update(density=1.0)
        else:  # the simulation masks momentum always, as the paper
            kwargs.update(density=density, warmup=warmup, warmup_unit="step",
                          min_compress_size=0, momentum_masking=True)
            schedule = as_schedule(density, warmup, "step")
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=wd),
            named_parameters=[(name + "." + n, p) for n, p in model.named_parameters()],
            **kwargs)
        before = _train(model, opt, steps, rank, passes)
        in_flight = opt.in_flight
        opt.flush()
        sim = simulate_dga(start, steps, size, delay, lr, momentum, wd,
                           None if schedule is None else (lambda i, s=schedule: s(i, 0.0)),
                           passes)
        out[name] = {
            "max_diff_vs_simulation": max(float((flat_params(model) - flat_params(w))
                                                .abs().max()) for w in sim),
            "sim_workers_agree": float((flat_params(sim[0]) - flat_params(sim[-1]))
                                       .abs().max()),
            "identical_after_flush": ranks_identical(model, "dga.flush." + name),
            "identical_before_flush": before,
            "in_flight_before_flush": in_flight,
            "in_flight_after_flush": opt.in_flight,
            "moved": float((flat_params(model) - flat_params(start)).abs().max()),
            "paths": opt.compression_stats()["paths"],
        }
    return out


def flush_in_synchronize():
    """``synchronize(flush=True)`` then ``step()`` == ``step()`` then ``flush()``."""
    rank = hvd.rank()
    results = []
    for use_sync in (False, True):
        model = mlp(seed=8)
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
            named_parameters=[("fs%d.%s" % (use_sync, n), p) for n, p in model.named_parameters()],
            density=1.0, delay=3)
        _train(model, opt, 5, rank)
        opt.zero_grad()
        loss_of(model, 5, rank).backward()
        if use_sync:
            opt.synchronize(flush=True)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
            opt.flush()
        results.append((flat_params(model), opt.in_flight,
                        ranks_identical(model, "fs.check.%d" % use_sync)))
    (a, fa, ia), (b, fb, ib) = results
    return {"max_diff": float((a - b).abs().max()), "in_flight": [fa, fb], "identical": [ia, ib]}


def checkpoint_after_flush_resumes_exactly():
    rank = hvd.rank()

    def fresh(tag):
        model = mlp(seed=9)
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
            named_parameters=[(tag + "." + n, p) for n, p in model.named_parameters()],
            compression=hvd.Compression.dgc, density=0.01, min_compress_size=0, delay=2)
        return model, opt

    model, opt = fresh("ck")
    _train(model, opt, 6, rank)
    refused = expect_error(opt.state_dict, RuntimeError)
    opt.flush()
    saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
    _train(model, opt, 5, rank, start=6)
    opt.flush()
    uninterrupted = flat_params(model)

    model2, opt2 = fresh("ck")
    model2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    _train(model2, opt2, 5, rank, start=6)
    opt2.flush()
    return {"refused_in_flight": refused,
            "resumed_equal": torch.equal(uninterrupted, flat_params(model2))}


def _spread(model, name):
    """Largest difference of any weight between ranks."""
    everyone = hvd.allgather(flat_params(model).unsqueeze(0), name=name)
    return float((everyone.max(dim=0).values - everyone.min(dim=0).values).max())


PERIODS = {
    # name: (compression, density or None, momentum, weight decay, period, delay, warm-up)
    "dense_p3": ("none", None, 0.9, 1e-3, 3, 0, 0),
    "dense_p3_delay2": ("none", None, 0.9, 0.0, 3, 2, 0),
    "dense_p2_delay3": ("none", None, 0.0, 0.0, 2, 3, 0),
    "topk_p2_delay1": ("topk", 0.02, 0.9, 1e-3, 2, 1, 4),
}


def period_matches_simulation(steps=11, lr=0.05):
    """Temporally sparse updates (``period=p``) against ``simulate_dga`` with the same
    period: every step's weights, ranks' spread after each step, bytes only on exchanges.
    11 steps: the run ends between exchanges, so the flush takes own steps back."""
    rank, size = hvd.rank(), hvd.size()
    out = {}
    for name, (comp, density, momentum, wd, period, delay, warmup) in PERIODS.items():
        model = mlp(seed=6)
        start = copy.deepcopy(model)
        kwargs = dict(compression=_compression(comp), delay=delay, period=period)
        schedule = None
        if density is None:
            kwargs.update(density=1.0)
        else:
            kwargs.update(density=density, warmup=warmup, warmup_unit="step",
                          min_compress_size=0, momentum_masking=True)
            schedule = as_schedule(density, warmup, "step")
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=wd),
            named_parameters=[(name + "." + n, p) for n, p in model.named_parameters()],
            **kwargs)
        spread, in_flight = [], []
        for i in range(steps):
            opt.zero_grad()
            loss_of(model, i, rank).backward()
            opt.step()
            spread.append(_spread(model, f"per.{name}.{i}"))
            in_flight.append(opt.in_flight)
        refused = expect_error(opt.state_dict, RuntimeError)
        stats = opt.compression_stats()
        opt.flush()
        sim = simulate_dga(start, steps, size, delay, lr, momentum, wd,
                           None if schedule is None else (lambda i, s=schedule: s(i, 0.0)),
                           period=period)
        out[name] = {
            "max_diff_vs_simulation": max(float((flat_params(model) - flat_params(w))
                                                .abs().max()) for w in sim),
            "sim_workers_agree": float((flat_params(sim[0]) - flat_params(sim[-1]))
                                       .abs().max()),
            "identical_after_flush": ranks_identical(model, "per.flush." + name),
            "spread": spread, "in_flight": in_flight, "refused_state_dict": refused,
            "paths": stats["paths"], "period": period, "delay": delay,
            "tensors": len(list(model.parameters())),
            "moved": float((flat_params(model) - flat_params(start)).abs().max()),
        }
    return out


LAGGED = {
    # name: (density or None, momentum, period, delay, steps), as tf_dga.PERIODS
    "dense_p3": (None, 0.9, 3, 0, 8),
    "topk_p2_delay1": (0.05, 0.9, 2, 1, 9),
    "dense_p2_delay3": (None, 0.0, 2, 3, 9),
}


def period_against_reference(lr=0.05):
    """``period`` (with ``delay``) on gradients that do not depend on the weights,
    every step against tests/reference.py (tests/lagged.py): the reference the
    TensorFlow workers are held to as well (``simulate_dga`` above is this module's
    own, in torch)."""
    import numpy as np
    from tests.device import device
    from tests.lagged import SHAPES, fixed_grads, period_reference
    rank, size, dev = hvd.rank(), hvd.size(), device()
    out = {}
    for name, (density, momentum, period, delay, steps) in LAGGED.items():
        rng = np.random.RandomState(31)
        w0 = [rng.randn(*s).astype(np.float32) for s in SHAPES]
        params = [torch.nn.Parameter(torch.tensor(w, device=dev)) for w in w0]
        options = dict(period=period, delay=delay, min_compress_size=0)
        if density is None:
            options.update(density=1.0)
        else:
            options.update(density=density, warmup=0, compression=_compression("topk"),
                           momentum_masking=True, aggregation="allgather")
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(params, lr=lr, momentum=momentum),
            named_parameters=[(f"lag.{name}.{i}", p) for i, p in enumerate(params)],
            **options)
        expected, flushed = period_reference(w0, size, steps, density, momentum, period,
                                             delay, lr)
        diffs = []
        for i in range(steps):
            opt.zero_grad()
            sum((p * torch.tensor(c, device=dev)).sum()
                for p, c in zip(params, fixed_grads(i, rank))).backward()
            opt.step()
            diffs.append(max(float(np.abs(p.detach().cpu().numpy() - e).max())
                             for p, e in zip(params, expected[i][rank])))
        paths = opt.compression_stats()["paths"]
        opt.flush()
        out[name] = {
            "max_diff_each_step": max(diffs),
            "max_diff_after_flush": max(float(np.abs(p.detach().cpu().numpy() - e).max())
                                        for p, e in zip(params, flushed[rank])),
            "paths": paths, "steps": steps, "period": period,
            "moved": max(float(np.abs(p.detach().cpu().numpy() - w).max())
                         for p, w in zip(params, w0))}
    return out


def auto_delay_matches_simulation(steps=16, lr=0.05):
    """delay=AutoDelay(...): the D each step ran with, on every rank, and the weights
    against ``simulate_dga`` fed that same sequence of D (dense, momentum)."""
    rank, size = hvd.rank(), hvd.size()
    out = {}
    for name, (start_d, idle, period, extra) in AUTO.items():
        model = mlp(seed=7)
        start = copy.deepcopy(model)
        config = hvd.AutoDelay(max_delay=4, window=2, start=start_d, idle=idle)
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
            named_parameters=[("ad" + name + "." + n, p) for n, p in model.named_parameters()],
            density=1.0, delay=config, period=period)
        trace = []
        for i in range(steps):
            opt.zero_grad()
            loss_of(model, i, rank).backward()
            time.sleep(extra)
            trace.append(opt.compression_stats()["delay"])
            opt.step()
        stats = opt.compression_stats()
        opt.flush()
        sim = simulate_dga(start, steps, size, trace, lr, 0.9, period=period)
        out[name] = {
            "trace": trace, "traces": hvd.allgather_object(trace, name="ad.trace." + name),
            "decisions": stats["delay_decisions"],
            "max_diff_vs_simulation": max(float((flat_params(model) - flat_params(w))
                                                .abs().max()) for w in sim),
            "identical_after_flush": ranks_identical(model, "ad.flush." + name),
            "moved": float((flat_params(model) - flat_params(start)).abs().max()),
        }
    return out


def _wrapping():
    """``(model, its SGD, wrap)``: ``wrap(opt, **options)`` is a call that wraps ``opt`` in
    hvd_dgc's optimizer, for ``expect_error``."""
    model = mlp()
    named = list(model.named_parameters())

    def wrap(opt, **kw):
        return lambda: hvd.DistributedOptimizer(opt, named_parameters=named, **kw)

    return model, torch.optim.SGD(model.parameters(), lr=0.1), wrap


def bad_period():
    """Bad ``period=``, and bad ``delay="auto"`` settings."""
    model, sgd, wrap = _wrapping()
    return {
        "zero": expect_error(wrap(sgd, period=0), ValueError),
        "float": expect_error(wrap(sgd, period=2.0), ValueError),
        "bool": expect_error(wrap(sgd, period=True), ValueError),
        "adam": expect_error(wrap(torch.optim.Adam(model.parameters()), period=4,
                                  freeze_variance=False), ValueError),
        "rmsprop": expect_error(wrap(torch.optim.RMSprop(model.parameters()), period=4),
                                ValueError),
        "grad_scaler": expect_error(wrap(sgd, period=2, grad_scaler=torch.amp.GradScaler(
            "cpu")), ValueError),
        "powersgd": expect_error(wrap(sgd, period=2, compression=hvd.Compression.powersgd),
                                 ValueError),
        "delay_word": expect_error(wrap(sgd, delay="sometimes"), ValueError),
        "auto_adam": expect_error(wrap(torch.optim.Adam(model.parameters()), delay="auto",
                                       freeze_variance=False), ValueError),
        "auto_max": expect_error(wrap(sgd, delay=hvd.AutoDelay(max_delay=0)), ValueError),
        "auto_start": expect_error(wrap(sgd, delay=hvd.AutoDelay(max_delay=2, start=3)),
                                   ValueError),
    }


def bad_delay():
    model, sgd, wrap = _wrapping()
    named = list(model.named_parameters())
    out = {
        "negative": expect_error(wrap(sgd, delay=-1), ValueError),
        "float": expect_error(wrap(sgd, delay=1.5), ValueError),
        "bool": expect_error(wrap(sgd, delay=True), ValueError),
        "adam": expect_error(wrap(torch.optim.Adam(model.parameters()), delay=2,
                                  freeze_variance=False), ValueError),
        "adam_dense": expect_error(wrap(torch.optim.Adam(model.parameters()), delay=2,
                                        density=1.0), ValueError),
        # a quantiser takes Adam over too (1-bit Adam): linear from the freeze
        "adam_sign": expect_error(wrap(torch.optim.Adam(model.parameters()), delay=2,
                                       compression=hvd.Compression.sign), ValueError),
        "grad_scaler": expect_error(wrap(sgd, delay=2, grad_scaler=torch.amp.GradScaler(
            "cpu")), ValueError),
    }
    opt = hvd.DistributedOptimizer(sgd, named_parameters=[("bd." + n, p) for n, p in named],
                                   delay=1)
    loss_of(model, 0, hvd.rank()).backward()
    out["flush_before_step"] = expect_error(opt.flush, RuntimeError)
    opt.step()
    opt.flush()
    return out


def ends_apart(config, steps=12, lag=0.3):
    """A script that ends without ``flush()`` with its ranks steps apart: rank 1 computes
    its last steps slowly, so rank 0 ends first with collectives in flight that rank 1
    has still to submit (delayed averaging's last D steps, an overlapped round). Run as
    a job of its own: what is checked is that both ranks exit cleanly (hvd_dgc waits for
    them at exit; Horovod's shutdown would otherwise fail rank 1's)."""
    options = {"sign, delay=4": dict(compression=hvd.Compression.sign, delay=4,
                                     min_compress_size=64),
               "dgc, delay=4": dict(delay=4, density=0.1, warmup=0, min_compress_size=64),
               "outer, overlap": dict(outer=hvd.OuterLoop(steps=3, overlap=True))}[config]
    hvd.init()
    rank = hvd.rank()
    model = mlp(0)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(), **options)
    for i in range(steps):
        if rank == 1 and i >= steps - 4:
            time.sleep(lag)
        opt.zero_grad()
        loss_of(model, i, rank).backward()
        opt.step()
    return {"in_flight": int(opt.in_flight)}


def suite(names):
    from tests.torch.torch_dgc import suite as run_suite
    return run_suite(names, module=__import__(__name__, fromlist=["_"]))
