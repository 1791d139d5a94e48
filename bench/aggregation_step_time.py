"""Step time through hvd_dgc's torch optimizer: aggregation="allgather" vs "region" vs
dense averaging, on N = 2, 4, 8 real Horovod ranks of this host, side by side in one run.

Each rank trains the same small MLP (three 1024x256 weights and two 1024 biases,
compressed at density 0.01 from the first step, warm-up off) for --steps steps per
method, the methods interleaved step by step so the machine's noise falls on all alike; the median step
time (forward, backward, exchange, update) and the bytes this rank put on the wire
per step (compression_stats) are reported, with region / allgather ratios. N ranks
share this machine's cores, so above N = cores the times measure the scheduler as
much as the collectives; bench/sparse_aggregation.py measures the bytes each worker
receives, on ResNet-50's shapes.

    python bench/aggregation_step_time.py [--worlds 2 4 8] [--steps 40]
        [--out bench/results/aggregation_step_time.md]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

METHODS = ("dense", "allgather", "region")
DENSITY = 0.01


def worker(out_path, steps):
    import torch
    import hvd_dgc.torch as hvd
    hvd.init()
    torch.set_num_threads(1)
    rank, world = hvd.rank(), hvd.size()
    runs = {}
    for method in METHODS:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(),
                                    torch.nn.Linear(1024, 256), torch.nn.ReLU(),
                                    torch.nn.Linear(256, 1024))
        kw = {"density": 1.0} if method == "dense" else \
            {"density": DENSITY, "warmup": 0, "aggregation": method}
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                       named_parameters=[(f"{method}.{n}", p) for n, p in
                                                         model.named_parameters()], **kw)
        runs[method] = (model, opt, [])
    gen = torch.Generator().manual_seed(rank)
    for step in range(steps + 3):  # the first 3 pay Horovod's set-up: dropped
        x, y = torch.randn(32, 256, generator=gen), torch.randn(32, 1024, generator=gen)
        for method, (model, opt, times) in runs.items():
            hvd.barrier()
            start = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            if step >= 3:
                times.append(time.perf_counter() - start)
    mine = {m: {"seconds": statistics.median(t), "bytes": o.compression_stats()["bytes_sent"]
                / o.compression_stats()["steps"], "paths": o.compression_stats()["paths"]}
            for m, (_, o, t) in runs.items()}
    everyone = hvd.allgather_object(mine, name="result")
    if rank == 0:
        out = {m: {"seconds": statistics.median(e[m]["seconds"] for e in everyone),
                   "bytes": statistics.mean(e[m]["bytes"] for e in everyone),
                   "paths": everyone[0][m]["paths"]} for m in METHODS}
        with open(out_path, "w") as f:
            json.dump({"world": world, "methods": out}, f)


def measure(world, steps):
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        cmd = [horovodrun, "-np", str(world), "-H", f"localhost:{world}", "--gloo",
               sys.executable, os.path.abspath(__file__), "--worker", out, "--steps", str(steps)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"N={world} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        with open(out) as f:
            return json.load(f)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results",
                                                  "aggregation_step_time.md"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.steps)
    rows = [measure(w, args.steps) for w in args.worlds]
    lines = [f"Step time through hvd_dgc's torch optimizer, {args.steps} steps per method "
             f"interleaved, MLP 256-1024-256-1024 (its tensors of >= 1024 elements at density {DENSITY}), "
             f"batch 32, gloo, one host with {os.cpu_count()} cores; median over steps, "
             f"median over ranks. `python bench/aggregation_step_time.py`", "",
             "| N | dense ms | allgather ms | region ms | region / allgather time "
             "| allgather B sent/step | region B sent/step | region paths |",
             "|---:|---:|---:|---:|---:|---:|---:|:---|"]
    for row in rows:
        m = row["methods"]
        lines.append(
            f"| {row['world']} | {m['dense']['seconds'] * 1e3:.1f} | "
            f"{m['allgather']['seconds'] * 1e3:.1f} | {m['region']['seconds'] * 1e3:.1f} | "
            f"{m['region']['seconds'] / m['allgather']['seconds']:.2f} | "
            f"{m['allgather']['bytes']:.0f} | {m['region']['bytes']:.0f} | "
            f"{m['region']['paths']} |")
    lines += ["", "Bytes sent is this rank's own contribution (region: its records to the "
              "owners plus its kept sums); what each worker receives, the quantity that grows "
              "with N for allgather, is measured in bench/results/sparse_aggregation.md."]
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
