"""Sparse aggregation, measured: allgather (today's sparse path) vs region reduce
(hvd_dgc/torch/region.py) on N = 2, 4, 8 real Horovod ranks of this host, one run, side
by side; the simulator's prediction (harness/aggregation_sim.py, the same formulas
as the cost model) next to each measured number.

Bytes: ResNet-50's tensors of >= 1024 elements at density 0.001, each rank's top-k of a
random vector (the indices spread as a real gradient's do at worst evenly); what each
worker receives from the others, counted from the collectives' outputs, mean over
workers, per step. Dense ring allreduce is the formula 2(N-1)/N n 4 bytes (not run: 100
MB per rank times 8 ranks on this 2-core machine). Time: a small MLP's tensors (three
256x1024 weights), median seconds per step of each method including dense allreduce;
N ranks share 2 cores here, so times above N = 2 measure the scheduler as much as the
collectives: the bytes are the result, the times are reported as measured.

    python bench/sparse_aggregation.py [--worlds 2 4 8] [--out bench/results/sparse_aggregation.md]
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

DENSITY = 0.001
MIN_COMPRESS_SIZE = 1024
TIMED_SHAPES = [(256, 1024)] * 3


def _sparse_shapes():
    from harness.shapes import numel, resnet50_shapes
    return [(name, shape) for name, shape in resnet50_shapes() if numel(shape) >= MIN_COMPRESS_SIZE]


def _top_k(numel, k, seed):
    import torch
    v = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    indices = v.abs().topk(k).indices.sort().values
    return indices, v[indices]


def worker(out_path, steps, timed_steps):
    """Under horovodrun: every method on the same records; rank 0 writes the results."""
    import torch
    import horovod.torch as hvd
    from harness.shapes import numel
    from hvd_dgc.torch.region import pack_records, region_reduce
    hvd.init()
    torch.set_num_threads(1)
    rank, world = hvd.rank(), hvd.size()
    received = {"allgather": 0, "region": 0}
    for step in range(steps):
        for t, (name, shape) in enumerate(_sparse_shapes()):
            n = numel(shape)
            k = max(1, math.ceil(n * DENSITY))
            indices, values = _top_k(n, k, seed=(step * 1000 + t) * 100 + rank)
            gathered = hvd.allgather(pack_records(indices, values), name=f"ag.{name}")
            received["allgather"] += gathered.shape[0] - k
            received["region"] += region_reduce(indices, values, n, k, name=f"rr.{name}").received
    per_step = {m: r * 8 / steps for m, r in received.items()}  # 8-byte records

    times = {"dense": [], "allgather": [], "region": []}
    tensors = [torch.randn(a * b, generator=torch.Generator().manual_seed(i * 10 + rank))
               for i, (a, b) in enumerate(TIMED_SHAPES)]
    for step in range(timed_steps + 1):  # the first step pays Horovod's set-up: dropped
        picks = []
        for v in tensors:
            k = max(1, math.ceil(v.numel() * DENSITY))
            idx = v.abs().topk(k).indices.sort().values
            picks.append((idx, v[idx], v.numel(), k))
        for method in times:
            hvd.barrier()
            start = time.perf_counter()
            for i, (idx, val, n, k) in enumerate(picks):
                tag = f"t.{method}.{i}"
                if method == "dense":
                    hvd.allreduce(tensors[i], name=tag)
                elif method == "allgather":
                    hvd.allgather(pack_records(idx, val), name=tag)
                else:
                    region_reduce(idx, val, n, k, name=tag)
            if step:
                times[method].append(time.perf_counter() - start)
    everyone = hvd.allgather_object(per_step, name="bytes")
    if rank == 0:
        mean = {m: statistics.mean(e[m] for e in everyone) for m in per_step}
        spread = {m: (min(e[m] for e in everyone), max(e[m] for e in everyone))
                  for m in per_step}
        with open(out_path, "w") as f:
            json.dump({"world": world, "bytes": mean, "bytes_range": spread,
                       "seconds": {m: statistics.median(t) for m, t in times.items()}}, f)


def measure(world, steps, timed_steps):
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        env = dict(os.environ, OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="3",
                   PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        cmd = [horovodrun, "-np", str(world), "-H", f"localhost:{world}", "--gloo",
               sys.executable, os.path.abspath(__file__), "--worker", out,
               "--steps", str(steps), "--timed-steps", str(timed_steps)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"N={world} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        with open(out) as f:
            return json.load(f)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--timed-steps", type=int, default=5)
    parser.add_argument("--out", default=None, help="also write the report (markdown) here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.steps, args.timed_steps)

    from harness.shapes import numel
    from harness.aggregation_sim import simulate
    shapes = _sparse_shapes()
    predicted = {row["world"]: row for row in simulate([s for _, s in shapes], DENSITY,
                                                        worlds=args.worlds,
                                                        min_compress_size=MIN_COMPRESS_SIZE)}
    n_total = sum(numel(s) for _, s in shapes)
    lines = [f"ResNet-50's {len(shapes)} tensors of >= {MIN_COMPRESS_SIZE} elements "
             f"({n_total:,} weights) at density {DENSITY}: bytes each worker receives per "
             f"step, measured on N Horovod ranks (Gloo, one host) vs the simulator.", "",
             "| N | dense ring (formula) | allgather measured | allgather predicted | error "
             "| region measured (min-max over workers) | region predicted | error "
             "| region / allgather |",
             "|---|---|---|---|---|---|---|---|---|"]
    timing = ["", f"Median seconds per step, three {TIMED_SHAPES[0][0]}x{TIMED_SHAPES[0][1]} "
              f"tensors at density {DENSITY} (N ranks on 2 cores):", "",
              "| N | dense allreduce | allgather | region reduce |", "|---|---|---|---|"]
    worst = 0.0
    for world in args.worlds:
        got = measure(world, args.steps, args.timed_steps)
        pred = predicted[world]
        ag, rr = got["bytes"]["allgather"], got["bytes"]["region"]
        ag_err = ag / pred["allgather_bytes"] - 1
        rr_err = rr / pred["region_bytes"] - 1
        worst = max(worst, abs(ag_err), abs(rr_err))
        lo, hi = got["bytes_range"]["region"]
        lines.append(f"| {world} | {pred['dense_bytes'] / 1e6:.2f} MB | {ag / 1e3:.1f} kB | "
                     f"{pred['allgather_bytes'] / 1e3:.1f} kB | {ag_err:+.1%} | {rr / 1e3:.1f} kB "
                     f"({lo / 1e3:.1f}-{hi / 1e3:.1f}) | {pred['region_bytes'] / 1e3:.1f} kB | "
                     f"{rr_err:+.1%} | {rr / ag:.2f} |")
        s = got["seconds"]
        timing.append(f"| {world} | {s['dense'] * 1e3:.1f} ms | {s['allgather'] * 1e3:.1f} ms | "
                      f"{s['region'] * 1e3:.1f} ms |")
        print(lines[-1], flush=True)
    report = "\n".join(lines + timing + ["", f"Largest simulator error on bytes: {worst:.1%} "
                                               f"(target: within 10%)."])
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write("# Sparse aggregation: allgather vs region reduce, measured\n\n"
                    "`python bench/sparse_aggregation.py --out " + args.out + "`\n\n"
                    + report + "\n")


if __name__ == "__main__":
    main()
