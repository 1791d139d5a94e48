"""Bodies of the Adam take-over tests (hvd_dgc/adam.py), run on every rank under horovodrun.

The reference run is tests/reference.py's NumPy maths on every rank's gradients, which
each rank can compute (the batches are drawn from (step, rank)).
"""

import copy

import numpy as np
import torch

import hvd_dgc.torch as hvd
from hvd_dgc.adam import VARIANCE_FLOOR
from hvd_dgc.torch.adam import SCALE_KEY
from tests import reference as ref
from tests.device import device
from tests.torch.torch_dgc import _run, flat_params, loss_of, ranks_identical, train, \
    wide_mlp


def _grads(model, x, step, rank):
    """The gradient of rank ``rank``'s batch at parameters ``x`` (NumPy, per tensor)."""
    with torch.no_grad():
        for p, value in zip(model.parameters(), x):
            p.copy_(torch.from_numpy(value).view(p.shape).to(p.device))
    model.zero_grad()
    loss_of(model, step, rank, features=64, classes=10).backward()
    return [p.grad.detach().cpu().numpy().reshape(-1).copy() for p in model.parameters()]


def _reference(steps, world, freeze, lr, betas, eps, wd, decoupled, seed=5, clip=None):
    """Parameters after each step: exact Adam on the averages to the freeze, then every
    rank's DGC memory (dense: everything sent) on the scaled gradient; ``clip``: each
    rank's gradient clipped first (DGC's local clipping, per tensor)."""
    shadow = wide_mlp(seed)  # on the test device, as the batches loss_of draws
    x = [p.detach().cpu().numpy().reshape(-1).copy() for p in shadow.parameters()]
    m = [np.zeros_like(a) for a in x]
    v = [np.zeros_like(a) for a in x]
    out, precondition, u, res = [], None, None, None
    for step in range(steps):
        t = step + 1
        grads = [[ref.local_gradient(g, clip, world) for g in _grads(shadow, x, step, r)]
                 for r in range(world)]
        if step < freeze:
            avg = [ref.average([g[i] for g in grads]) for i in range(len(x))]
            for i in range(len(x)):
                x[i], m[i], v[i] = ref.adam(x[i], m[i], v[i], avg[i], t, lr, betas, eps, wd,
                                            decoupled)
            if t == freeze:
                precondition = [ref.frozen_precondition(v[i], t, betas, eps, VARIANCE_FLOOR)
                                for i in range(len(x))]
                u = [[precondition[i] * m[i] for i in range(len(x))] for _ in range(world)]
                res = [[np.zeros_like(a) for a in x] for _ in range(world)]
        else:
            l2 = 0.0 if decoupled else wd
            for i in range(len(x)):
                sent = []
                for r in range(world):
                    g = ref.frozen_adam_gradient(grads[r][i], precondition[i], betas[0], l2, x[i])
                    u[r][i], res[r][i] = ref.accumulate(u[r][i], res[r][i], g, betas[0])
                    sent.append(res[r][i])
                    u[r][i], res[r][i] = ref.sent_all(u[r][i], res[r][i])
                x[i] = ref.frozen_adam_apply(x[i], ref.average(sent), t, lr, betas[0],
                                             wd if decoupled else 0.0)
        out.append(np.concatenate(x))
    return out


def reference_equivalence():
    """Adam and AdamW taken over, at density 1 (the dense path, and allgather sending every
    coordinate), equal the NumPy reference step by step, on both ranks alike."""
    rank, world = hvd.rank(), hvd.size()
    steps, freeze, lr, betas, eps, wd = 9, 4, 0.01, (0.9, 0.99), 1e-8, 0.05
    results = {}
    for cls, decoupled in ((torch.optim.AdamW, True), (torch.optim.Adam, False)):
        variants = (("dense", dict(min_compress_size=10 ** 9)),
                    ("allgather", dict(density=1.0, aggregation="allgather")),
                    ("clipped", dict(min_compress_size=10 ** 9, clip_norm=0.02)))
        unclipped = None
        for variant, options in variants:
            expected = _reference(steps, world, freeze, lr, betas, eps, wd, decoupled,
                                  clip=options.get("clip_norm"))
            unclipped = expected if unclipped is None else unclipped
            model = wide_mlp(5)
            opt = hvd.DistributedOptimizer(
                cls(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=wd),
                named_parameters=[(f"{cls.__name__}.{variant}.{n}", p)
                                  for n, p in model.named_parameters()],
                compression=hvd.Compression.dgc, freeze_variance=freeze, **options)
            diffs, scale = [], 0.0
            for step in range(steps):
                train(model, opt, 1, rank, start=step, features=64, classes=10)
                ours = flat_params(model).cpu().numpy()
                diffs.append(float(np.abs(ours - expected[step]).max()))
                scale = max(scale, float(np.abs(expected[step]).max()))
            stats = opt.compression_stats()
            results[f"{cls.__name__}.{variant}"] = {
                "diffs": diffs, "scale": scale,
                "moved": float(np.abs(expected[-1] - expected[freeze - 1]).max()),
                "identical": ranks_identical(model, f"adam.{cls.__name__}.{variant}"),
                "phase": stats["adam_phase"], "paths": stats["paths"],
                # the clip bites: its reference is not the unclipped one
                "clipped": float(np.abs(expected[-1] - unclipped[-1]).max()) > 1e-3}
    return results


def lagging_reference():
    """AdamW taken over with delay=2, dense: the reference step by step on each rank (the
    ranks differ until the flush), synchronous before the freeze, and the same
    parameters everywhere after ``flush()``."""
    rank, world = hvd.rank(), hvd.size()
    steps, freeze, lr, betas, eps, wd, delay = 10, 4, 0.01, (0.9, 0.99), 1e-8, 0.05, 2
    shadow = wide_mlp(5)  # on the test device, as the batches loss_of draws
    per_rank, flushed = ref.delayed_frozen_adam(
        [p.detach().cpu().numpy().reshape(-1) for p in shadow.parameters()],
        lambda x, step, r: _grads(shadow, x, step, r), steps, world, freeze, lr, betas, eps,
        wd, delay, VARIANCE_FLOOR)
    per_rank = [[np.concatenate(w) for w in weights] for weights in per_rank]
    flushed = np.concatenate(flushed)
    model = wide_mlp(5)
    opt = hvd.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=wd),
        named_parameters=[("lagref." + n, p) for n, p in model.named_parameters()],
        compression=hvd.Compression.dgc, freeze_variance=freeze, min_compress_size=10 ** 9,
        delay=delay)
    diffs, identical, in_flight = [], [], []
    for step in range(steps):
        train(model, opt, 1, rank, start=step, features=64, classes=10)
        diffs.append(float(np.abs(flat_params(model).cpu().numpy() - per_rank[rank][step]).max()))
        identical.append(ranks_identical(model, f"lagref.{step}"))
        in_flight.append(opt.in_flight)
    opt.flush()
    return {"diffs": diffs, "identical": identical, "in_flight": in_flight,
            "flushed_diff": float(np.abs(flat_params(model).cpu().numpy() - flushed).max()),
            "flushed_identical": ranks_identical(model, "lagref.flushed"),
            "apart": float(np.abs(per_rank[0][-1] - per_rank[1][-1]).max())}


def sign_reference():
    """AdamW taken over with ``compression=Compression.sign`` (1-bit Adam): exact Adam on
    dense averages to the freeze, then each rank's memory sends the scaled sign of what
    it holds and keeps the rest; synchronous with the variance refreshed every 2nd step
    (its residual rescaled at each refresh), with delay=2, and with period=2 (0/1
    Adam's local steps: the memory's sign every 2nd step). The reference step by step
    on each rank, its flush, and which path each tensor took."""
    rank, world = hvd.rank(), hvd.size()
    steps, freeze, lr, betas, eps, wd = 11, 4, 0.01, (0.9, 0.99), 1e-8, 0.05
    shadow = wide_mlp(5)  # on the test device, as the batches loss_of draws
    start = [p.detach().cpu().numpy().reshape(-1).copy() for p in shadow.parameters()]
    large = 1024  # min_compress_size: the three weights go sign, the biases dense
    compress = [ref.sign_sent if a.size >= large else None for a in start]
    out = {}
    for name, delay, refresh, period in (("delay=0", 0, 2, 1), ("delay=2", 2, False, 1),
                                         ("period=2", 0, False, 2)):
        refreshed = {6, 8, 10} if refresh else ()
        per_rank, flushed = ref.delayed_frozen_adam(
            start, lambda x, step, r: _grads(shadow, x, step, r), steps, world, freeze, lr,
            betas, eps, wd, delay, VARIANCE_FLOOR, refresh=refreshed, compress=compress,
            period=period)
        _, dense = ref.delayed_frozen_adam(
            start, lambda x, step, r: _grads(shadow, x, step, r), steps, world, freeze, lr,
            betas, eps, wd, delay, VARIANCE_FLOOR, refresh=refreshed, period=period)
        model = wide_mlp(5)
        opt = hvd.DistributedOptimizer(
            torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=wd),
            named_parameters=[(f"sign{name}." + n, p) for n, p in model.named_parameters()],
            compression=hvd.Compression.sign, min_compress_size=large, freeze_variance=freeze,
            refresh_variance=refresh, delay=delay, period=period)
        diffs, off, phases = [], [], []
        for step in range(steps):
            train(model, opt, 1, rank, start=step, features=64, classes=10)
            diff = np.abs(flat_params(model).cpu().numpy() - np.concatenate(per_rank[rank][step]))
            diffs.append(float(diff.max()))
            off.append(int((diff > 3e-5).sum()))
            phases.append(opt.compression_stats()["adam_phase"])
        opt.flush()
        stats = opt.compression_stats()
        diff = np.abs(flat_params(model).cpu().numpy() - np.concatenate(flushed))
        out[name] = {
            "diffs": diffs, "off": off, "phases": phases, "paths": stats["paths"],
            "refreshes": stats.get("adam_refreshes"), "numel": int(diff.size),
            "flushed_diff": float(np.median(diff)), "flushed_off": int((diff > 3e-5).sum()),
            "identical": ranks_identical(model, f"sign{name}.flushed"),
            # the coordinates in which the dense reference ends elsewhere: what a run
            # that ignored the compressor would be off in
            "dense_off": int((np.abs(np.concatenate(flushed) - np.concatenate(dense))
                              > 3e-5).sum())}
    return out


def refresh_reference():
    """AdamW with its variance refreshed every 2nd step after a freeze at step 4 (at the
    ends of steps 6, 8, 10), dense, synchronous and with delay=2: the reference step by
    step on each rank, the refreshes counted with their bytes; and a sparse run with
    refresh_variance='auto' (freeze 5: refreshes at 10 and 20) keeps the ranks
    identical while the loss falls."""
    rank, world = hvd.rank(), hvd.size()
    steps, freeze, lr, betas, eps, wd = 11, 4, 0.01, (0.9, 0.99), 1e-8, 0.05
    shadow = wide_mlp(5)  # on the test device, as the batches loss_of draws
    start = [p.detach().cpu().numpy().reshape(-1).copy() for p in shadow.parameters()]
    numel = sum(a.size for a in start)
    out = {}
    for delay in (0, 2):
        per_rank, flushed = ref.delayed_frozen_adam(
            start, lambda x, step, r: _grads(shadow, x, step, r), steps, world, freeze, lr,
            betas, eps, wd, delay, VARIANCE_FLOOR, refresh={6, 8, 10})
        unrefreshed, _ = ref.delayed_frozen_adam(
            start, lambda x, step, r: _grads(shadow, x, step, r), steps, world, freeze, lr,
            betas, eps, wd, delay, VARIANCE_FLOOR)
        model = wide_mlp(5)
        opt = hvd.DistributedOptimizer(
            torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=wd),
            named_parameters=[(f"refresh{delay}." + n, p) for n, p in model.named_parameters()],
            compression=hvd.Compression.dgc, freeze_variance=freeze, refresh_variance=2,
            min_compress_size=10 ** 9, delay=delay)
        diffs, refreshes, sent = [], [], []
        for step in range(steps):
            before = opt.compression_stats()["bytes_sent"]
            train(model, opt, 1, rank, start=step, features=64, classes=10)
            ours = flat_params(model).cpu().numpy()
            diffs.append(float(np.abs(ours - np.concatenate(per_rank[rank][step])).max()))
            stats = opt.compression_stats()
            refreshes.append(stats["adam_refreshes"])
            sent.append((stats["bytes_sent"] - before) / (4 * numel))
        opt.flush()
        out[f"delay={delay}"] = {
            "diffs": diffs, "refreshes": refreshes, "dense_steps_sent": sent,
            "flushed_diff": float(np.abs(flat_params(model).cpu().numpy()
                                         - np.concatenate(flushed)).max()),
            "identical": ranks_identical(model, f"refresh{delay}.flushed"),
            "refreshed": float(np.abs(np.concatenate(per_rank[rank][-1])
                                      - np.concatenate(unrefreshed[rank][-1])).max())}
    model = wide_mlp(6)
    opt = hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3),
                                   named_parameters=[("refresh.sparse." + n, p)
                                                     for n, p in model.named_parameters()],
                                   density=0.01, freeze_variance=5, refresh_variance="auto")
    with torch.no_grad():
        first = float(sum(loss_of(model, s, rank, features=64, classes=10) for s in range(4)))
    for step in range(24):
        train(model, opt, 1, rank, start=step % 4, features=64, classes=10)
    with torch.no_grad():
        last = float(sum(loss_of(model, s, rank, features=64, classes=10) for s in range(4)))
    stats = opt.compression_stats()
    out["sparse"] = {"identical": ranks_identical(model, "refresh.sparse"), "first": first,
                     "last": last, "refreshes": stats["adam_refreshes"],
                     "refresh": stats["adam_refresh"]}
    return out


def declined_on_a_fast_link():
    """AdamW with no option on a link where the cost model sends every tensor dense (a
    fast one, given as a CostModel): not taken over, exact Adam throughout, the weights
    Horovod's own AdamW's past the default freeze (step 20); on the assumed 1 Gbit/s it
    is taken over. The rank-0 line says which."""
    import contextlib
    import io
    from horovod import torch as stock
    from tests.torch.torch_dgc import step_all
    rank = hvd.rank()
    # DGC's selection and the sign's encoding cost more than the dense allreduce
    fast = hvd.CostModel(bandwidth=1e11, select_element_seconds=1e-7,
                         encode_element_seconds=1e-7)
    ref, ours = wide_mlp(3), wide_mlp(3)
    opt_ref = stock.DistributedOptimizer(torch.optim.AdamW(ref.parameters(), lr=3e-3),
                                         named_parameters=ref.named_parameters())
    line = io.StringIO()
    with contextlib.redirect_stdout(line):
        opt = hvd.DistributedOptimizer(torch.optim.AdamW(ours.parameters(), lr=3e-3),
                                       named_parameters=[("fast." + n, p) for n, p in
                                                         ours.named_parameters()],
                                       cost_model=fast)
    # a link on which only the 2,560-weight classifier would go sparse (one message
    # fewer; selecting a large tensor's records costs more than its allreduce): 3% of
    # the gradient, under ADAM_SPARSE_SHARE, so not taken over and every tensor dense
    few, few_line = wide_mlp(3), io.StringIO()
    with contextlib.redirect_stdout(few_line):
        opt_few = hvd.DistributedOptimizer(
            torch.optim.AdamW(few.parameters(), lr=3e-3),
            named_parameters=[("few." + n, p) for n, p in few.named_parameters()],
            compression=hvd.Compression.dgc,  # (DGC's top-k: the share rule is its own)
            cost_model=hvd.CostModel(bandwidth=1e11, select_element_seconds=1e-8))
    for step in range(30):
        step_all(((ref, opt_ref), (ours, opt), (few, opt_few)), step, rank, features=64,
                 classes=10)
    other, slow_line = wide_mlp(3), io.StringIO()
    with contextlib.redirect_stdout(slow_line):
        slow = hvd.DistributedOptimizer(torch.optim.AdamW(other.parameters(), lr=3e-3),
                                        named_parameters=[("slow." + n, p) for n, p in
                                                          other.named_parameters()])
    stats = opt.compression_stats()
    out = {"phase": stats["adam_phase"], "freeze": stats["adam_freeze"],
           "diff": float((flat_params(ref) - flat_params(ours)).abs().max()),
           "paths": stats["paths"], "line": line.getvalue(),
           "period": opt._delayed.period, "compressor": type(opt._resolved.compressor).__name__,
           "slow_phase": slow.compression_stats()["adam_phase"],
           "slow_declined": slow._takeover.declined, "slow_period": slow._delayed.period,
           "slow_compressor": type(slow._resolved.compressor).__name__,
           "slow_line": slow_line.getvalue(),
           "few": {"diff": float((flat_params(ref) - flat_params(few)).abs().max()),
                   "phase": opt_few.compression_stats()["adam_phase"],
                   "paths": opt_few.compression_stats()["paths"],
                   "share": opt_few._planner.adam.share, "line": few_line.getvalue()}}
    # the first stage (0.5, steps 4 to 9) goes dense on a link where selecting a record
    # costs 1 us, the final 0.01 sparse: exact Adam, Horovod's, until the freeze moves
    # to step 10, where the sparse stage starts
    ref, later = wide_mlp(4), wide_mlp(4)
    opt_ref = stock.DistributedOptimizer(torch.optim.AdamW(ref.parameters(), lr=3e-3),
                                         named_parameters=[("ref4." + n, p) for n, p in
                                                           ref.named_parameters()])
    line = io.StringIO()
    with contextlib.redirect_stdout(line):
        opt = hvd.DistributedOptimizer(
            torch.optim.AdamW(later.parameters(), lr=3e-3),
            named_parameters=[("later." + n, p) for n, p in later.named_parameters()],
            cost_model=hvd.CostModel(select_record_seconds=1e-6), freeze_variance=4,
            density=0.01, warmup=6, warmup_unit="step", warmup_densities=(0.5,))
    diffs, phases = [], []
    for step in range(14):
        step_all(((ref, opt_ref), (later, opt)), step, rank, features=64, classes=10)
        diffs.append(float((flat_params(ref) - flat_params(later)).abs().max()))
        phases.append(opt.compression_stats()["adam_phase"])
    out["later"] = {"diffs": diffs, "phases": phases, "line": line.getvalue(),
                    "freeze": opt.compression_stats()["adam_freeze"],
                    "paths": opt.compression_stats()["paths"],
                    "identical": ranks_identical(later, "later")}
    return out


def zero_one_default():
    """AdamW with no option (``compression=Compression.none``, as Horovod's examples):
    0/1 Adam, the same run bit for bit as ``compression=Compression.sign, period=4``
    (exact Adam to step 20, then the scaled sign every 4th step, local steps between),
    the ranks apart between exchanges and equal after ``flush()``; ``period=1`` given
    exchanges every step (1-bit Adam), ``density`` given sends DGC's top-k."""
    import contextlib
    import io
    from tests.torch.torch_dgc import step_all
    rank = hvd.rank()
    models = [wide_mlp(6) for _ in range(4)]
    options = [dict(compression=hvd.Compression.none),
               dict(compression=hvd.Compression.sign, period=4),
               dict(compression=hvd.Compression.none, period=1),
               dict(compression=hvd.Compression.none, density=0.01)]
    line, opts = io.StringIO(), []
    for i, (model, opt_options) in enumerate(zip(models, options)):
        with contextlib.redirect_stdout(line if i == 0 else io.StringIO()):
            opts.append(hvd.DistributedOptimizer(
                torch.optim.AdamW(model.parameters(), lr=3e-3),
                named_parameters=[(f"zo{i}." + n, p) for n, p in model.named_parameters()],
                **opt_options))
    diffs, apart = [], []
    for step in range(30):
        step_all(list(zip(models, opts)), step, rank, features=64, classes=10)
        diffs.append(float((flat_params(models[0]) - flat_params(models[1])).abs().max()))
        everyone = hvd.allgather(flat_params(models[0]).unsqueeze(0), name=f"zo.{step}")
        apart.append(float((everyone - everyone[0]).abs().max()))  # the ranks' spread
    opts[0].flush()
    opts[1].flush()
    return {"diffs": diffs, "apart": apart, "line": line.getvalue(),
            "flushed_diff": float((flat_params(models[0]) - flat_params(models[1]))
                                  .abs().max()),
            "identical": ranks_identical(models[0], "zo.flushed"),
            "periods": [o._delayed.period for o in opts],
            "compressors": [type(o._resolved.compressor).__name__ for o in opts],
            "paths": opts[0].compression_stats()["paths"],
            "phase": opts[0].compression_stats()["adam_phase"]}


def taken_back_at_their_size():
    """The ranks' spread after every step where each step's size moves: AdamW (the sign,
    ``period=4``, frozen at step 3, where Adam's ``lr / (1 - beta1^t)`` still moves every
    step, with a decoupled decay of 0.1), and SGD with momentum (dense, ``period=4``)
    under a LambdaLR that changes the rate every step; and a rate of 0 at an exchange
    (nothing can be taken back: said once). Own steps are taken back at the size they
    were applied with (hvd_dgc/lagging.py ``take_back``)."""
    import warnings
    rank = hvd.rank()
    out = {}
    for name in ("adamw", "sgd_schedule", "zero_rate"):
        model = wide_mlp(13)
        named = [(f"tb.{name}." + n, p) for n, p in model.named_parameters()]
        if name == "adamw":
            opt = hvd.DistributedOptimizer(
                torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1),
                named_parameters=named, compression=hvd.Compression.sign, period=4,
                freeze_variance=3)
        else:
            opt = hvd.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                named_parameters=named, compression=hvd.Compression.dgc, density=1.0,
                period=4)
        rule = (lambda s: 1.0 / (1 + s)) if name == "sgd_schedule" else \
            (lambda s: 0.0 if s == 7 else 1.0)
        schedule = None if name == "adamw" else torch.optim.lr_scheduler.LambdaLR(opt, rule)
        spread = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(16):
                train(model, opt, 1, rank, start=step, features=64, classes=10)
                if schedule is not None:
                    schedule.step()
                everyone = hvd.allgather(flat_params(model).unsqueeze(0),
                                         name=f"tb.{name}.{step}")
                spread.append(float((everyone - everyone[0]).abs().max()))
        out[name] = {"spread": spread, "said": [str(w.message) for w in caught
                                                if "learning rate is 0" in str(w.message)]}
    return out


def zero_one_checkpoint():
    """The default (0/1 Adam) saved between exchanges, without flush(), as a Horovod
    script saves: at step 22 this rank's own steps 20-21 since the freeze are in flight;
    ``state_dict()`` takes them back (the last exchange's weights, which the ranks agree
    on to rounding), and a fresh model and optimizer loaded
    from the files take the next 10 steps bit for bit as the run that saved. Rank 0
    saving alone (Horovod's examples) leaves the ranks as consistent after the next
    exchange as a run that never saved."""
    from tests.torch.torch_dgc import step_all
    rank = hvd.rank()

    def make(tag):
        model = wide_mlp(11)
        return model, hvd.DistributedOptimizer(
            torch.optim.AdamW(model.parameters(), lr=3e-3),
            named_parameters=[(f"zock{tag}." + n, p) for n, p in model.named_parameters()])

    def spread(model, name):
        everyone = hvd.allgather(flat_params(model).unsqueeze(0), name=name)
        return float((everyone - everyone[0]).abs().max())

    model, opt = make("a")
    for step in range(22):
        step_all([(model, opt)], step, rank, features=64, classes=10)
    before = (opt.in_flight, spread(model, "zock.before"))
    saved = copy.deepcopy(opt.state_dict())
    weights = copy.deepcopy(model.state_dict())
    after = (opt.in_flight, spread(model, "zock.after"))
    for step in range(22, 32):
        step_all([(model, opt)], step, rank, features=64, classes=10)
    resumed, opt2 = make("b")
    resumed.load_state_dict(weights)
    opt2.load_state_dict(copy.deepcopy(saved))
    for step in range(22, 32):
        step_all([(resumed, opt2)], step, rank, features=64, classes=10)
    out = {"before": before, "after": after, "period": opt._delayed.period,
           "resumed": float((flat_params(model) - flat_params(resumed)).abs().max())}
    # rank 0 alone saves at step 22; and a run that never saves
    for tag in ("alone", "never"):
        model, opt = make(tag)
        for step in range(24):
            step_all([(model, opt)], step, rank, features=64, classes=10)
            if step == 21 and rank == 0 and tag == "alone":
                opt.state_dict()
        out[tag] = spread(model, f"zock.{tag}")  # after the exchange of step 23
        opt.flush()
        out[tag + "_flushed"] = ranks_identical(model, f"zock.{tag}.flushed")
    return out


def period_run():
    """AdamW taken over with period=3 at density 0.01: every step exchanges before the
    freeze, every third after; ranks identical after ``flush()``; the loss falls."""
    rank = hvd.rank()
    model = wide_mlp(8)
    opt = hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3),
                                   named_parameters=[("adamp." + n, p)
                                                     for n, p in model.named_parameters()],
                                   density=0.01, freeze_variance=6, period=3)
    with torch.no_grad():
        first = float(sum(loss_of(model, s, rank, features=64, classes=10) for s in range(4)))
    launches = []
    for step in range(24):
        before = opt.compression_stats()["launches"]
        train(model, opt, 1, rank, start=step % 4, features=64, classes=10)
        launches.append(opt.compression_stats()["launches"] - before)
    opt.flush()
    with torch.no_grad():
        last = float(sum(loss_of(model, s, rank, features=64, classes=10) for s in range(4)))
    return {"identical": ranks_identical(model, "adamp"), "first": first, "last": last,
            "exchanged": [n > 0 for n in launches]}


def sparse_run():
    """AdamW at density 0.01 after a freeze at step 10: dense to the freeze, sparse after,
    ranks identical, the loss falls."""
    rank = hvd.rank()
    model = wide_mlp(6)
    opt = hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3),
                                   named_parameters=[("adamw." + n, p)
                                                     for n, p in model.named_parameters()],
                                   density=0.01, freeze_variance=10)
    with torch.no_grad():
        first = float(sum(loss_of(model, s, rank, features=64, classes=10) for s in range(4)))
    phases = []
    for step in range(30):
        train(model, opt, 1, rank, start=step % 4, features=64, classes=10)
        phases.append(opt.compression_stats()["adam_phase"])
    with torch.no_grad():
        last = float(sum(loss_of(model, s, rank, features=64, classes=10) for s in range(4)))
    stats = opt.compression_stats()
    return {"identical": ranks_identical(model, "adamw.sparse"), "first": first, "last": last,
            "paths": stats["paths"], "phases": phases, "ratio": stats["compression_ratio"]}


def late_tensor():
    """A tensor with no gradient until after the freeze (Adam never stepped it: v = 0)
    gets the typical v of the others, not a scale of (1 - beta1)/eps, and trains."""
    torch.manual_seed(9)
    body, late = torch.nn.Linear(64, 10).to(device()), torch.nn.Linear(64, 10).to(device())
    params = list(body.parameters()) + list(late.parameters())
    before = late.weight.detach().clone()
    opt = hvd.DistributedOptimizer(torch.optim.AdamW(params, lr=3e-3),
                                   named_parameters=[("late.b.w", params[0]),
                                                     ("late.b.b", params[1]),
                                                     ("late.l.w", params[2]),
                                                     ("late.l.b", params[3])],
                                   density=0.1, freeze_variance=3)
    for step in range(8):
        x, y = torch.randn(16, 64).to(device()), torch.randint(0, 10, (16,)).to(device())
        out = body(x) + (late(x) if step >= 5 else 0.0)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(out, y).backward()
        opt.step()
    scales = [opt.state[p][SCALE_KEY] for p in params]
    late_scale = scales[2]
    return {"uniform": bool((late_scale == late_scale.reshape(-1)[0]).all()),
            "late": float(late_scale.max()), "others": float(max(s.max() for s in scales[:2])),
            "finite": all(bool(torch.isfinite(p).all()) for p in params),
            "moved": float((late.weight.detach() - before).abs().max()),
            "identical": ranks_identical(torch.nn.ModuleList([body, late]), "late")}


def checkpoint():
    """state_dict after the freeze carries the frozen scale and the memory: a run resumed
    from it continues exactly as the uninterrupted one."""
    rank = hvd.rank()

    def make(tag):
        model = wide_mlp(7)
        opt = hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3),
                                       named_parameters=[(f"ck{tag}." + n, p) for n, p in
                                                         model.named_parameters()],
                                       density=0.01, freeze_variance=5)
        return model, opt

    model, opt = make("a")
    train(model, opt, 12, rank, features=64, classes=10)
    saved = copy.deepcopy(opt.state_dict())  # (its tensors are the live state)
    weights = {k: t.clone() for k, t in model.state_dict().items()}
    train(model, opt, 6, rank, start=12, features=64, classes=10)
    resumed, opt2 = make("b")
    resumed.load_state_dict(weights)
    opt2.load_state_dict(saved)
    train(resumed, opt2, 6, rank, start=12, features=64, classes=10)
    scales = [k for s in saved["state"].values() for k in s if k == SCALE_KEY]
    return {"equal": torch.equal(flat_params(model), flat_params(resumed)),
            "scales": len(scales), "params": len(list(model.parameters())),
            "step": opt2.compression_stats()["step"]}


def suite(names):
    hvd.init()
    return _run(names, __import__(__name__, fromlist=["_"]))
