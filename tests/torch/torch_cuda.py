"""Bodies of the CUDA tests (tests/torch/test_cuda.py), run on every rank under horovodrun with
``HVD_DGC_TEST_DEVICE=cuda``: host synchronisations per step, and DGC's fixed-size GPU
selection against an exact top-k."""

import collections
import itertools
import os
import traceback
import warnings

import torch
import torch.nn as nn

import hvd_dgc.torch as hvd
from hvd_dgc.schedule import num_selected
from hvd_dgc.torch.compression import DGCCompressor
from hvd_dgc.torch import gpu_select
from hvd_dgc.torch.gpu_select import select_many
from hvd_dgc.torch.memory import aligned_size
from tests.device import device
from tests.torch.torch_dgc import _run, batch, loss_of


def model(seed=0):
    """Two tensors above min_compress_size per layer kind, and small ones that go dense."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 10)).to(device())


def _count_syncs(fn):
    """Run ``fn`` with torch's CUDA sync debugging on; return (result, [where]): each
    synchronisation named by the innermost hvd_dgc frame that led to it (else by the
    frame the warning names)."""
    torch.cuda.synchronize()
    seen = []

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        ours = [f for f in traceback.extract_stack() if "/hvd_dgc/" in f.filename]
        where = ours[-1] if ours else None
        seen.append(f"{where.filename.split('hvd_dgc/')[-1]}:{where.lineno}" if where
                    else f"{filename}:{lineno}")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return out, seen


def syncs_per_step(steps=4, warm=2):
    """Host synchronisations per training step, by configuration (after ``warm`` steps, which
    allocate the memory)."""
    rank = hvd.rank()
    configs = {
        "dgc": dict(density=0.01),
        "dgc_no_guard": dict(density=0.01, skip_nonfinite=False),
        "dgc_fp16_values": dict(density=0.01, compression=hvd.Compression.dgc(fp16_values=True)),
        "topk": dict(density=0.01, compression=hvd.Compression.topk),
        "randomk": dict(density=0.01, compression=hvd.Compression.randomk),
        "dense": dict(density=1.0),
        "dense_no_guard": dict(density=1.0, skip_nonfinite=False),
        "dga_delay2_no_guard": dict(density=0.01, delay=2, skip_nonfinite=False),
        "dga_delay2": dict(density=0.01, delay=2),
        "powersgd": dict(compression=hvd.Compression.powersgd(rank=2, start_iter=0)),
        "sign": dict(compression=hvd.Compression.sign),
        "terngrad": dict(compression=hvd.Compression.terngrad),
        "qsgd": dict(compression=hvd.Compression.qsgd),
        "bf16": dict(compression=hvd.Compression.bf16),
    }
    out = {}
    for tag, kw in configs.items():
        m = model(1)
        hvd.broadcast_parameters(m.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
            named_parameters=[(f"sync.{tag}.{n}", p) for n, p in m.named_parameters()], **kw)

        # On the device before counting: a copy from pageable host memory synchronises.
        data = [batch(i, rank, features=64, classes=10) for i in range(warm + steps)]

        def step(i):
            opt.zero_grad()
            x, y = data[i]
            nn.functional.cross_entropy(m(x), y).backward()
            opt.step()

        for i in range(warm):
            step(i)
        per_step, ours, where = [], [], collections.Counter()
        for i in range(warm, warm + steps):
            _, seen = _count_syncs(lambda: step(i))
            per_step.append(len(seen))
            ours.append(sum(w.startswith("torch/") for w in seen))
            where.update(seen)
        if hasattr(opt, "flush"):
            opt.flush()
        out[tag] = {"per_step": per_step, "ours": ours, "where": dict(where),
                    "finite": bool(torch.isfinite(torch.cat([p.detach().reshape(-1)
                                                              for p in m.parameters()])).all())}
    return out


def fixed_selection():
    """DGC's GPU form: exactly k records, the real ones distinct and equal to v there, the
    padding valued 0, and the set equal to an exact top-k whenever enough pass the
    threshold; no host synchronisation."""
    comp = DGCCompressor()
    gen = torch.Generator(device=device()).manual_seed(11 + hvd.rank())
    out = []
    for n in (3000, 100_000, 2_359_296):
        for density in (0.001, 0.01, 0.25):
            k = num_selected(n, density)
            for trial in range(3):
                v = torch.randn(n, generator=gen, device=device())
                if trial == 2:  # mostly zeros, as an embedding's gradient: few candidates
                    v = v * (torch.rand(n, generator=gen, device=device()) < 0.3 * k / n)
                comp.sparsify(v, k, rank=0)  # builds the plan (once per size and k)
                comp.sparsify(v, k, rank=0)  # captures it as a CUDA graph
                sel, seen = _count_syncs(lambda: comp.sparsify(v, k, rank=0))
                out.append(_describe_selection(v, k, sel.indices, sel.values, trial, seen))
    # Trial 3: four tensors selected together, as the optimizer does in one launch.
    sizes = (2_359_296, 1_048_576, 4608, 3000)
    for _ in range(3):
        flats = [torch.randn(n, generator=gen, device=device()) for n in sizes]
        ks = [num_selected(n, 0.001) for n in sizes]
        draws = [0.25 * i for i in range(len(sizes))]
        select_many(flats, ks, draws)  # eager: warms the kernels
        select_many(flats, ks, draws)  # captured as a CUDA graph
        sel, seen = _count_syncs(lambda: select_many(flats, ks, draws))
        for v, k, (idx, val) in zip(flats, ks, sel.split()):
            out.append(_describe_selection(v, k, idx, val, 3, seen))
    return out


def graphed_selection():
    """The selection replayed from a CUDA graph gives the eager selection's records bit for
    bit: on the values the tensors hold at each replay (the graph reads their addresses),
    with each step's own sampling shift; an earlier step's records stay as they were."""
    gen = torch.Generator(device=device()).manual_seed(5 + hvd.rank())
    sizes = (2_359_296, 1_048_576, 4608, 3000, 150_000)
    flats = [torch.randn(n, generator=gen, device=device()) for n in sizes]
    ks = [num_selected(n, 0.001) for n in sizes]

    def eager(draws):
        os.environ["HVD_DGC_CUDA_GRAPHS"] = "0"
        try:
            return select_many(flats, ks, draws)
        finally:
            del os.environ["HVD_DGC_CUDA_GRAPHS"]
    out = {"steps": []}
    select_many(flats, ks, [0.0] * len(sizes))  # eager: warms the kernels
    _, out["capture_syncs"] = _count_syncs(lambda: select_many(flats, ks, [0.1] * len(sizes)))
    kept = None
    for step in range(4):
        for f in flats:  # new values in place, as the memory's buffers change every step
            f.copy_(torch.randn(f.numel(), generator=gen, device=device()))
        draws = [((step + 1) * 0.37 + 0.11 * i) % 1.0 for i in range(len(sizes))]
        want = eager(draws)
        got, seen = _count_syncs(lambda: select_many(flats, ks, draws))
        if kept is None:
            kept = (got, got.indices.clone(), got.values.clone())
        out["steps"].append({"indices": bool(torch.equal(got.indices, want.indices)),
                             "values": bool(torch.equal(got.values, want.values)),
                             "syncs": len(seen)})
    out["earlier_unchanged"] = bool(torch.equal(kept[0].indices, kept[1])
                                    and torch.equal(kept[0].values, kept[2]))
    # The same tensors lying in one buffer at the memory's aligned offsets, selected as a
    # launch is (select_span: from the third call on, one lookup and the replay): the
    # eager records, with positions in the buffer for indices.
    offsets = tuple(itertools.accumulate((aligned_size(n) for n in sizes[:-1]), initial=0))
    buffer = torch.zeros(offsets[-1] + aligned_size(sizes[-1]), device=device())
    views = [buffer[o:o + n] for o, n in zip(offsets, sizes)]
    starts = torch.tensor(offsets, device=device()).repeat_interleave(
        torch.tensor(ks, device=device()))
    out["span"], kept = [], None
    for step in range(5):
        for f in views:
            f.copy_(torch.randn(f.numel(), generator=gen, device=device()))
        draws = [((step + 1) * 0.29 + 0.13 * i) % 1.0 for i in range(len(sizes))]
        os.environ["HVD_DGC_CUDA_GRAPHS"] = "0"
        try:
            want = select_many(views, ks, draws)
        finally:
            del os.environ["HVD_DGC_CUDA_GRAPHS"]
        got, seen = _count_syncs(lambda: gpu_select.select_span(
            buffer, offsets, sizes, tuple(ks), draws))
        if kept is None:
            kept = (got, got.indices.clone(), got.values.clone())
        out["span"].append({"indices": bool(torch.equal(got.indices, want.indices + starts)),
                            "values": bool(torch.equal(got.values, want.values)),
                            "syncs": len(seen),
                            "fast": sum(key[:3] == (buffer.data_ptr(), buffer.dtype, offsets)
                                        for key in gpu_select._SPANS)})
    out["span_earlier_unchanged"] = bool(torch.equal(kept[0].indices, kept[1])
                                         and torch.equal(kept[0].values, kept[2]))
    out["graphs"] = sum(isinstance(g, gpu_select._Graphed) for g in gpu_select._GRAPHS.values())
    return out


def _describe_selection(v, k, indices, values, trial, seen):
    real = values != 0
    idx_real = indices[real]
    exact = set(torch.topk(v.abs(), k).indices.tolist())
    return {
        "n": v.numel(), "k": k, "trial": trial, "records": indices.numel(),
        "real": int(real.sum()), "distinct": idx_real.unique().numel(),
        "values_match": bool(torch.equal(values[real], v[idx_real])),
        "pads_repeat_sent": bool(set(indices[~real].tolist()) <= set(idx_real.tolist())
                                 or not bool(real.any())),
        "in_exact": len(exact & set(idx_real.tolist())),
        "nonzero": int((v != 0).sum()), "syncs": len(seen)}


def loss_scale_and_guard():
    """GradScaler + DGC on CUDA: the scale is read as a tensor (no sync per tensor); an
    overflow on one rank makes every rank skip the step, the memory stays finite."""
    rank = hvd.rank()
    m = model(3)
    hvd.broadcast_parameters(m.state_dict(), root_rank=0)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 10, growth_interval=10 ** 6)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=[("gs." + n, p) for n, p in
                                                     m.named_parameters()],
                                   density=0.01, grad_scaler=scaler)
    syncs, changed = [], []
    for i in range(6):
        before = torch.cat([p.detach().reshape(-1) for p in m.parameters()]).clone()

        def step():
            opt.zero_grad()
            loss = loss_of(m, i, rank, features=64, classes=10)
            if i == 3 and rank == hvd.size() - 1:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            opt.synchronize()
            scaler.unscale_(opt)
            with opt.skip_synchronize():
                scaler.step(opt)
            scaler.update()
        _, seen = _count_syncs(step)
        syncs.append(seen)
        after = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
        changed.append(float((after - before).abs().max()))
    memory_finite = all(bool(torch.isfinite(s["v"]).all())
                        for s in opt.dgc_memory().values())
    return {"syncs": syncs, "changed": changed, "memory_finite": memory_finite,
            "overflow_steps": opt.compression_stats()["overflow_steps"]}


def trial_syncs(steps=24, warm=2):
    """The backward pass profiled and the two plans tried (hvd_dgc/overlap.py) on CUDA
    tensors, set up as tests/workers/link_probe._overlap sets it up on CPUs so that the
    plans differ there (the link priced as 1 Gbit/s, 2 ns of DGC's work an element, rank
    1's backward 30 ms longer): host synchronisations per step through the profile and
    its agreement; which paths the planner launches at synchronize; whether the plans
    differ, the trial's verdict and each step's plan; and whether the ranks' weights are
    bit-identical. At np=1 nothing is profiled (no link)."""
    from tests.core.link_probe import overlap_model, priced_as_one_gbit
    from tests.torch.torch_dgc import ranks_identical
    m = overlap_model(device())
    with priced_as_one_gbit():
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
            named_parameters=[(f"trial.{n}", p) for n, p in m.named_parameters()],
            density=0.01, warmup=0, cost_model="measure", link_watch=False)
    gen = torch.Generator().manual_seed(hvd.rank())
    data = [(torch.randn(32, 256, generator=gen).to(device()),
             torch.randint(0, 4, (32,), generator=gen).to(device())) for _ in range(steps)]

    def step(i):
        opt.zero_grad()
        nn.functional.cross_entropy(m(data[i][0]), data[i][1]).backward()
        opt.step()

    for i in range(warm):
        step(i)
    ours, where, timeline = [], collections.Counter(), []
    for i in range(warm, steps):
        _, seen = _count_syncs(lambda: step(i))
        ours.append(sum(w.startswith("torch/") for w in seen))
        where.update(seen)
        timeline.append(opt._planner.on_timeline)
    from hvd_dgc.overlap import timeline_differs
    stats, planner = opt.compression_stats(), opt._planner
    return {"profiled": opt._profiler is not None, "ours": ours, "where": dict(where),
            "at_end": sorted(map(str, planner.timeline.at_end if planner.timeline else ())),
            "flat": sorted(map(str, planner.flat)),
            "differs": timeline_differs(planner, 0.01),
            "timeline": timeline, "trial": stats.get("timeline"),
            "identical": ranks_identical(m, "trial_syncs"),
            "finite": bool(torch.isfinite(torch.cat([p.detach().reshape(-1)
                                                     for p in m.parameters()])).all())}


def suite(names):
    hvd.init()
    torch.cuda.set_device(device())
    return _run(names, __import__(__name__, fromlist=["_"]))

