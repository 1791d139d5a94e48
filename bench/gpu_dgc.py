"""DGC's local work on a GPU, side by side in one run (issue 19).

1. Select + pack of ResNet-50's gradients (the tensors DGC sparsifies: >= 1024 elements,
   density 0.001): DGC's GPU selection of all of them at once (gpu_select.py, what the
   optimizer runs: one CUDA graph replayed), the same kernel by kernel (``dgc_eager``),
   the same selection one tensor at a time, an exact ``torch.topk`` per
   tensor, and a device-to-device copy of the same gradients (per tensor, and as one flat
   copy: the memory-bandwidth floor).
2. The whole local DGC work of one step (memory update, select, pack, momentum masking,
   and the sum of 2 ranks' records back into dense updates; small tensors on the dense
   path) as a fraction of a ResNet-50 training step on this GPU.
3. The same ResNet-50 step through hvd_dgc's DistributedOptimizer at np=1 (hooks, one
   launch, Horovod's NCCL allgather of one rank) against the bare optimizer and stock
   Horovod's DistributedOptimizer, round-robin, with and without the non-finite check and
   with the selection kernel by kernel; the GPU operations (kernels, copies, fills:
   the profiler's CUDA activity) and host synchronisations (``set_sync_debug_mode``) of
   a whole step of each.

GPU times are CUDA-event medians over ``--reps`` repetitions after warm-up; "host" is the
time the Python thread spends issuing the work (where it exceeds the GPU time, launches,
not the GPU, set the pace). Run: python bench/gpu_dgc.py [--out bench/results/gpu_dgc.md]
"""

import argparse
import collections
import contextlib
import gzip
import os
import shutil
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness.shapes import numel, resnet50_shapes  # noqa: E402
from hvd_dgc.schedule import num_selected  # noqa: E402
from bench.dgc_compression import FlatStep  # noqa: E402
from hvd_dgc.torch.compression import DGCCompressor  # noqa: E402
from hvd_dgc.torch.memory import block_abs_max  # noqa: E402

DENSITY = 0.001
MIN_COMPRESS = 1024


def timed(fn, reps, warm=3):
    """(median GPU ms, median host ms) of ``fn()``."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    gpu, host = [], []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        fn()
        end.record()
        host.append((time.perf_counter() - t0) * 1e3)
        end.synchronize()
        gpu.append(start.elapsed_time(end))
    return statistics.median(gpu), statistics.median(host)


def gradients(dev, seed=0):
    gen = torch.Generator(device=dev).manual_seed(seed)
    return [(name, torch.randn(numel(shape), generator=gen, device=dev) * 1e-3)
            for name, shape in resnet50_shapes()]


def select_and_pack(args, dev):
    grads = [g for _, g in gradients(dev) if g.numel() >= MIN_COMPRESS]
    ks = [num_selected(g.numel(), DENSITY) for g in grads]
    comp = DGCCompressor()
    copies = [torch.empty_like(g) for g in grads]
    flat_src = torch.cat(grads)
    flat_dst = torch.empty_like(flat_src)

    def copy_each():
        for g, c in zip(grads, copies):
            c.copy_(g)

    def copy_flat():
        flat_dst.copy_(flat_src)

    def exact():
        for g, k in zip(grads, ks):
            idx = torch.topk(g.abs(), k, sorted=False).indices
            comp.pack(g.index_select(0, idx), idx)

    flat = FlatStep(comp, grads, DENSITY, MIN_COMPRESS)  # a launch's flat memory
    torch._foreach_copy_(flat.views, grads)
    block = flat.block
    maxima = block_abs_max(flat.g[:block.aligned_end]) if dev == "cpu" else None

    def dgc():
        picked = comp.pick(flat.g, maxima, block.offsets, block.numels, flat.ks, flat.order,
                           0, 0)
        values = picked.values if picked.values is not None else flat.g[picked.positions]
        comp.pack(values, picked.positions)

    def dgc_eager():
        with graphs_off():
            dgc()

    def dgc_each():
        for g, k in zip(grads, ks):
            sel = comp.sparsify(g, k)
            comp.pack(sel.values, sel.indices)

    n_total = sum(g.numel() for g in grads)
    print(f"\n[1] select + pack: {len(grads)} ResNet-50 tensors >= {MIN_COMPRESS} elements, "
          f"{n_total / 1e6:.2f} M elements, k = {sum(ks)} at density {DENSITY}")
    res = {name: timed(fn, args.reps) for name, fn in
           [("copy_flat", copy_flat), ("copy_each", copy_each), ("topk_exact", exact),
            ("dgc_each", dgc_each), ("dgc_eager", dgc_eager), ("dgc", dgc)]}
    for name, (gpu, host) in res.items():
        print(f"  {name:12s} GPU {gpu:8.3f} ms   host {host:8.3f} ms")
    dgc_gpu, exact_gpu = res["dgc"][0], res["topk_exact"][0]
    print(f"  DGC (all at once) vs exact top-k: {exact_gpu / dgc_gpu:.2f}x faster (GPU time), "
          f"vs DGC one tensor at a time: {res['dgc_each'][0] / dgc_gpu:.2f}x; "
          f"DGC = {dgc_gpu / res['copy_each'][0]:.2f} per-tensor copies "
          f"= {dgc_gpu / res['copy_flat'][0]:.1f} flat copies")
    return res


def local_work(args, dev, world=2):
    """One step's local DGC work for every ResNet-50 tensor, as the exchange does it for one
    launch of them all (bench/dgc_compression.py FlatStep: flat buffers, one update, one
    selection)."""
    grads = [g for _, g in gradients(dev, 2)]
    comp = DGCCompressor()
    step = FlatStep(comp, grads, DENSITY, MIN_COMPRESS)
    block, n = step.block, step.sparse
    out = torch.zeros(block.total, device=dev)

    def accumulate():
        torch._foreach_copy_(step.views, [grads[i] for i in step.order])
        step.memory.accumulate(block, step.g, step.runs, with_block_max=dev == "cpu")

    def select():
        return comp.pick(block.v, block.block_max, block.offsets[:n], block.numels[:n],
                         step.ks, step.order[:n], 0, 0)

    def take(picked):
        return picked.values if picked.values is not None else \
            step.memory.take(block, picked.positions, True)

    def unpack(records):  # every rank's records (positions in the flat buffer), summed
        values, positions = comp.unpack(torch.cat([records] * world))
        out.zero_()
        out.index_put_((positions.long(),), values * (1.0 / world), accumulate=True)

    accumulate()
    picked = select()
    values = take(picked)
    records = comp.pack(values, picked.positions)
    phases = {
        "memory update": timed(accumulate, args.reps),
        "select (all at once)": timed(select, args.reps),
        "select, kernel by kernel": timed(lambda: _off(select), args.reps),
        "take (values out, cleared)": timed(lambda: take(picked), args.reps),
        "pack": timed(lambda: comp.pack(values, picked.positions), args.reps),
        "unpack + sum of 2 ranks": timed(lambda: unpack(records), args.reps),
    }
    return timed(lambda: step(grads), args.reps), phases


class graphs_off:
    """The selection kernel by kernel, as before CUDA graphs (HVD_DGC_CUDA_GRAPHS=0)."""

    def __enter__(self):
        os.environ["HVD_DGC_CUDA_GRAPHS"] = "0"

    def __exit__(self, *exc):
        os.environ.pop("HVD_DGC_CUDA_GRAPHS", None)


def _off(fn):
    with graphs_off():
        return fn()


def resnet_step(args, dev, amp):
    import torchvision
    model = torchvision.models.resnet50().to(dev).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batch = args.batch_amp if amp else args.batch
    x = torch.randn(batch, 3, 224, 224, device=dev).to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device=dev)

    def fwd_bwd():
        opt.zero_grad(set_to_none=False)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
    return timed(fwd_bwd, max(5, args.reps // 2)), batch, model, opt, (x, y)


def _kernels(fn):
    """GPU operations (kernels, copies, fills) that ``fn()`` puts on the device, by the
    profiler's CUDA activity."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name = {}
    for e in events:
        n, t = by_name.get(e.name, (0, 0.0))
        by_name[e.name] = (n + 1, t + e.device_time_total / 1e3)
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:12]
    print("    GPU time by operation (one step): " + "; ".join(
        f"{name[:60]} x{n} {ms:.3f} ms" for name, (n, ms) in top))
    return len(events)


def _syncs(fn):
    """Host synchronisations ``fn()`` makes (torch.cuda.set_sync_debug_mode's warnings)."""
    import warnings
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    where = collections.Counter(f"{os.path.basename(w.filename)}:{w.lineno}" for w in caught
                                if "synchroniz" in str(w.message))
    if where:
        print(f"    host synchronisations at: {dict(where)}")
    return sum(where.values())


def _counted(count, step, row):
    try:
        return count(lambda: step(row))
    except Exception as e:  # a count that fails leaves the timings standing
        print(f"  ({count.__name__} failed: {type(e).__name__}: {e})")
        return -1


def optimizer_overhead(args, dev, amp):
    """A ResNet-50 step through hvd_dgc's optimizer at np=1 vs the bare SGD step, with
    the default non-finite check (one read-back a step) and without; GPU operations and
    host synchronisations per step of each (the DGC step's minus the bare one's is what
    DGC adds)."""
    import horovod.torch as hvd_stock
    import hvd_dgc.torch as hvd
    hvd_stock.init()
    import torchvision
    batch = args.batch_amp if amp else args.batch
    x = torch.randn(batch, 3, 224, 224, device=dev).to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device=dev)
    rows = {}  # name -> (model, optimizer): a model each, so no row's hooks run in another's

    def model():
        torch.manual_seed(0)
        return torchvision.models.resnet50().to(dev).to(memory_format=torch.channels_last)

    def full_step(row):
        net, o, *eager = row
        if eager:
            with graphs_off():
                return full_step((net, o))
        o.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        o.step()
    net = model()
    rows["bare SGD"] = (net, torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9))
    net = model()  # what a Horovod user runs today (at np=1 it registers no hooks)
    rows["stock Horovod"] = (net, hvd_stock.DistributedOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9),
        named_parameters=[(f"stock.{n}", p) for n, p in net.named_parameters()]))
    for check in (True, False):  # warmup=0: the final density from the first step
        net = model()
        rows[f"hvd_dgc, skip_nonfinite={check}"] = (net, hvd.DistributedOptimizer(
            torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9),
            named_parameters=[(f"{check}.{n}", p) for n, p in net.named_parameters()],
            density=DENSITY, warmup=0, skip_nonfinite=check))
    net = model()
    rows["hvd_dgc, no CUDA graph"] = (net, hvd.DistributedOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9),
        named_parameters=[(f"eager.{n}", p) for n, p in net.named_parameters()],
        density=DENSITY, warmup=0), "eager")
    for o in rows.values():  # first steps: layouts, blocks, allocator
        for _ in range(3):
            full_step(o)
    reps = max(5, args.reps // 2)
    times = {name: [] for name in rows}
    for _ in range(3):  # round-robin rounds: a slow moment slows every row alike
        for name, o in rows.items():
            times[name].append(timed(lambda: full_step(o), reps, warm=1))
    out = {}
    phases = {name: host_phases(o, x, y, amp, reps) for name, o in rows.items()
              if name != "bare SGD"}
    for name, o in rows.items():
        gpu = statistics.median(t[0] for t in times[name])
        host = statistics.median(t[1] for t in times[name])
        print(f"  [{name}, {'bf16' if amp else 'fp32'}]")
        out[name] = {"gpu": gpu, "host": host, "kernels": _counted(_kernels, full_step, o),
                     "syncs": _counted(_syncs, full_step, o)}
        if name in phases:
            print("    host ms: " + ", ".join(f"{k} {v:.2f}" for k, v in phases[name].items()))
        if args.trace and not amp and name in ("stock Horovod", "hvd_dgc, skip_nonfinite=False"):
            _trace(lambda: full_step(o), os.path.join(
                args.trace, "".join(c if c.isalnum() else "_" for c in name) + ".json.gz"))
    stats = rows["hvd_dgc, skip_nonfinite=True"][1].compression_stats()
    return out, batch, stats


def host_phases(row, x, y, amp, reps):
    """Median host ms of a step's parts through a Horovod-style optimizer: issuing the
    forward and backward pass, ``synchronize()`` (the wait for the collectives, so for the
    backward pass), the optimizer's step after it, and the GPU's drain after that."""
    net, o, *eager = row
    parts = collections.defaultdict(list)
    for _ in range(reps):
        with graphs_off() if eager else contextlib.nullcontext():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            o.zero_grad()
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
                loss = torch.nn.functional.cross_entropy(net(x), y)
            loss.backward()
            t1 = time.perf_counter()
            o.synchronize()
            t2 = time.perf_counter()
            with o.skip_synchronize():
                o.step()
            t3 = time.perf_counter()
            torch.cuda.synchronize()
            t4 = time.perf_counter()
        for k, a, b in (("forward+backward issued", t0, t1), ("synchronize", t1, t2),
                        ("step after it", t2, t3), ("GPU drain", t3, t4)):
            parts[k].append((b - a) * 1e3)
    return {k: statistics.median(v) for k, v in parts.items()}


def _trace(fn, path):
    """One step's CPU and GPU timeline (Python stacks included), for chrome://tracing."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 with_stack=True) as prof:
        fn()
        torch.cuda.synchronize()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    raw = path[:-len(".gz")]
    prof.export_chrome_trace(raw)
    with open(raw, "rb") as src, gzip.open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(raw)
    print(f"    trace: {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=64, help="ResNet-50 batch, fp32")
    ap.add_argument("--batch-amp", type=int, default=128, help="ResNet-50 batch, bf16 autocast")
    ap.add_argument("--skip-optimizer", action="store_true", help="skip part 3 (needs Horovod)")
    ap.add_argument("--only-step", action="store_true", help="part 3 alone")
    ap.add_argument("--out", help="write the tables as markdown here")
    ap.add_argument("--trace", help="write one fp32 step's profiler trace of each "
                                    "Horovod-style row into this folder")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu_dgc.py needs a CUDA GPU")
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    print(f"GPU: {props.name}, torch {torch.__version__}")
    sel, work, phases, steps = {}, (0.0, 0.0), {}, {}
    if not args.only_step:
        sel = select_and_pack(args, dev)
        work, phases = local_work(args, dev)
        print("\n[2] whole local DGC work of one ResNet-50 step (161 tensors; 2 ranks' "
              f"records summed back): GPU {work[0]:.3f} ms, host {work[1]:.3f} ms")
        for name, (gpu, host) in phases.items():
            print(f"  phase {name:24s} GPU {gpu:8.3f} ms   host {host:8.3f} ms")
    work_gpu, work_host = work
    for amp in (False, True) if not args.only_step else ():
        (fb_gpu, _), batch, *_ = resnet_step(args, dev, amp)
        tag = f"{'bf16 autocast' if amp else 'fp32'}, batch {batch}"
        steps[tag] = fb_gpu
        print(f"  ResNet-50 forward+backward ({tag}): {fb_gpu:.2f} ms -> local DGC work = "
              f"{100 * work_gpu / fb_gpu:.1f}% of it (GPU), {100 * work_host / fb_gpu:.1f}% "
              f"(host)")
    overhead = {}
    if not args.skip_optimizer:
        for amp in (False, True):
            rows, batch, stats = optimizer_overhead(args, dev, amp)
            tag = f"{'bf16 autocast' if amp else 'fp32'}, batch {batch}"
            overhead[tag] = rows
            bare = rows["bare SGD"]
            print(f"\n[3] ResNet-50 training step at np=1 ({tag}); bytes sent / dense: 1/"
                  f"{stats['compression_ratio']:.0f}")
            for name, r in rows.items():
                print(f"  {name:32s} GPU {r['gpu']:8.2f} ms  host {r['host']:8.2f} ms  "
                      f"{r['gpu'] / bare['gpu']:.3f}x  (+{r['gpu'] - bare['gpu']:.2f} ms)  "
                      f"GPU ops {r['kernels']} (+{r['kernels'] - bare['kernels']})  "
                      f"syncs {r['syncs']}")
    if args.out and not args.only_step:
        write_markdown(args.out, props.name, sel, work, phases, steps, overhead)


def write_markdown(path, gpu_name, sel, work, phases, steps, overhead):
    lines = [f"# DGC's local work on a GPU ({gpu_name}, torch {torch.__version__})", "",
             "Measured by `python bench/gpu_dgc.py --out bench/results/gpu_dgc.md`: CUDA-event "
             "medians, one run, side by side. `dgc`: the selection of all tensors at once "
             "(gpu_select.py, what the optimizer runs); `dgc_each`: the same, one tensor at a "
             "time; `topk_exact`: `torch.topk` per tensor; copies: of the same gradients.", "",
             "| select + pack of ResNet-50's sparse tensors | GPU ms | host ms |",
             "| --- | --- | --- |"]
    lines += [f"| {k} | {g:.3f} | {h:.3f} |" for k, (g, h) in sel.items()]
    lines += ["", f"DGC vs exact top-k: **{sel['topk_exact'][0] / sel['dgc'][0]:.2f}x**; DGC = "
              f"**{sel['dgc'][0] / sel['copy_each'][0]:.2f}** per-tensor copies = "
              f"{sel['dgc'][0] / sel['copy_flat'][0]:.1f} flat copies.", ""]
    lines += ["| local DGC work, one step | GPU ms | host ms |", "| --- | --- | --- |",
              f"| whole step | {work[0]:.3f} | {work[1]:.3f} |"]
    lines += [f"| {k} | {g:.3f} | {h:.3f} |" for k, (g, h) in phases.items()]
    lines += ["", "| ResNet-50 forward+backward | ms | local DGC work, GPU | host |",
              "| --- | --- | --- | --- |"]
    lines += [f"| {k} | {v:.2f} | {100 * work[0] / v:.1f}% | {100 * work[1] / v:.1f}% |"
              for k, v in steps.items()]
    for tag, rows in overhead.items():
        bare = rows["bare SGD"]
        lines += ["", f"| ResNet-50 step at np=1, {tag} | GPU ms | host ms | x bare | "
                  "added ms | GPU ops a step (added) | host syncs a step |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {name} | {r['gpu']:.2f} | {r['host']:.2f} | {r['gpu'] / bare['gpu']:.3f} "
                  f"| {r['gpu'] - bare['gpu']:.2f} | {r['kernels']} "
                  f"({r['kernels'] - bare['kernels']:+d}) | {r['syncs']} |"
                  for name, r in rows.items()]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
