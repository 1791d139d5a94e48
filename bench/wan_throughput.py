"""Training throughput over an emulated slow network: dense Horovod vs hvd_dgc (issue 6).

    sudo python bench/wan_throughput.py                      # the full grid, ~1 hour
    python bench/wan_throughput.py --rates 100 --rtts 0 50   # a part of it

Two workers, one CPU thread each, in two network namespaces joined by the
user-space link of harness/wan.py (rate cap, one-way delay). The same
training for every method (bench/wan/train_worker.py: an MLP with 6.3M
parameters, 25 MB of fp32 gradient, batch 128): Horovod dense fp32, Horovod
fp16, hvd_dgc DGC 0.1%, DGC + delayed averaging (D=4), DGC + DGA + temporally
sparse updates (``--methods ... dts``: an exchange every ``--dts-period``-th step,
each applied ``--dts-delay`` steps later; 8 and 8 by default), the same period
with ``delay="auto"`` (``auto``: timed after its first two decision windows), and
the no-communication bound (one worker alone, x2). Writes, from this one run:

    bench/results/wan_throughput.csv    every measurement
    bench/results/wan_throughput.md     ratios table (what the README shows)
    bench/results/wan_vs_bandwidth.png  samples/s vs bandwidth, at the lowest RTT
    bench/results/wan_vs_rtt.png        samples/s vs RTT, at 100 Mbit/s (or the middle rate)
"""

import argparse
import csv
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from harness.wan import WanLink, available  # noqa: E402
from harness.launch import run_job  # noqa: E402

METHODS = ["dense", "fp16", "dgc", "dga"]
LABELS = {"dense": "Horovod fp32", "fp16": "Horovod fp16", "dgc": "hvd_dgc DGC 0.1%",
          "dga": "hvd_dgc DGC + DGA (D=4)", "dts": "hvd_dgc DGC + DGA + period",
          "auto": "hvd_dgc DGC + delay auto + period", "local": "no communication (bound)"}
DGA_DELAY = 4  # train_worker.py's --delay default, the "dga" method's D
#: delay="auto" decides at the end of its second window of 20 steps (hvd_dgc/autodelay.py)
AUTO_SETTLE = 40
WORKER = [sys.executable, os.path.join(REPO, "bench", "wan", "train_worker.py")]
MODEL = ["--width", "2048", "--batch", "128"]  # the same training for every method
GRAD_BYTES = 4 * 6.3e6  # that MLP's fp32 gradient


def steps_for(method, rate_mbit, rtt_ms, args):
    """Enough timed steps for ~args.seconds of measurement (at least 2), from a rough
    estimate of the step time, so slow dense runs at 10 Mbit/s stay bounded."""
    compute = 0.35
    if method in ("dense", "fp16"):
        width = 2 if method == "fp16" else 4
        estimate = compute + GRAD_BYTES / 4 * width * 8 / (rate_mbit * 1e6) + 2 * rtt_ms / 1e3
    elif method in ("dts", "auto"):  # latency hidden once the pipeline is full: periods
        return max(2 * args.dts_period, min(args.max_steps, int(args.seconds / compute)))
    else:
        estimate = compute + 3 * rtt_ms / 1e3  # one Horovod operation: 3 round trips
    if method == "dga":  # time whole delays, or the pipeline's filling is what is timed
        return max(2 * DGA_DELAY, min(args.max_steps, int(args.seconds / estimate)))
    return max(2, min(args.max_steps, int(args.seconds / estimate)))


def measure(link, method, steps, args):
    warmup = args.warmup_steps
    if method == "dga":  # until the first average is applied: the pipeline is full
        warmup = max(warmup, DGA_DELAY + 1)
    if method == "dts":
        warmup = max(warmup, args.dts_period + args.dts_delay)
    if method == "auto":  # until auto's first decision has taken effect, and a period more
        warmup = max(warmup, AUTO_SETTLE + 2 * args.dts_period)
    argv = WORKER + ["--method", "dts" if method == "auto" else method, "--steps", str(steps),
                     "--warmup-steps", str(warmup), *MODEL]
    if method in ("dts", "auto"):
        argv += ["--period", str(args.dts_period),
                 "--delay", "auto" if method == "auto" else str(args.dts_delay)]
    results = run_job(link, argv, timeout=args.timeout)
    code, out, err = results[0]
    if code != 0 or results[1][0] != 0:
        raise RuntimeError(f"{method} over {link.description} failed: rank 0 rc={code}, "
                           f"rank 1 rc={results[1][0]}\n{err[-2000:]}\n{results[1][2][-2000:]}")
    return json.loads(out.strip().splitlines()[-1])


def local_rate(model=MODEL, steps=10, warmup_steps=2):
    """Two workers training at the same time on this machine, never talking: what
    the two ranks could do with a free network (they share its cores, as the ranks
    of the measured runs do). ``model``: bench/wan/train_worker.py's model arguments."""
    import subprocess
    argv = WORKER + ["--method", "local", "--steps", str(steps), "--warmup-steps",
                     str(warmup_steps), *model]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    return sum(json.loads(p.communicate()[0].strip().splitlines()[-1])["samples_per_s"]
               for p in procs)


def write_outputs(rows, bound, args):
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "wan_throughput.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    by = {(r["rate_mbit"], r["rtt_ms"], r["method"]): r["samples_per_s"] for r in rows}
    rates = sorted({r["rate_mbit"] for r in rows})
    rtts = sorted({r["rtt_ms"] for r in rows})
    lines = [f"No-communication bound (2 workers x 1 thread at once, no Horovod): "
             f"**{bound:.0f} samples/s**.", ""]
    present = [m for m in LABELS if any(r["method"] == m for r in rows)]
    if set(METHODS) <= set(present):  # the full grid: the ratios the README quotes
        lines += ["| link | Horovod fp32 | Horovod fp16 | DGC | DGC+DGA | DGC / fp32 | "
                  "DGC / bound | DGA / DGC |", "|---|---|---|---|---|---|---|---|"]
        for rate in rates:
            for rtt in rtts:
                get = lambda m: by.get((rate, rtt, m))  # noqa: E731
                if get("dense") is None:
                    continue
                lines.append(
                    f"| {rate:g} Mbit/s, RTT {rtt:g} ms | {get('dense'):.1f} | "
                    f"{get('fp16'):.1f} | {get('dgc'):.1f} | {get('dga'):.1f} | "
                    f"{get('dgc') / get('dense'):.1f}x | {get('dgc') / bound:.0%} | "
                    f"{get('dga') / get('dgc'):.2f}x |")
        lines.append("")
    # every method measured, as samples/s and as a fraction of the bound
    lines += ["| link | " + " | ".join(LABELS[m] for m in present) + " |",
              "|---|" + "---|" * len(present)]
    for rate in rates:
        for rtt in rtts:
            cells = [by.get((rate, rtt, m)) for m in present]
            if all(c is None for c in cells):
                continue
            lines.append(f"| {rate:g} Mbit/s, RTT {rtt:g} ms | " + " | ".join(
                "-" if c is None else f"{c:.1f} ({c / bound:.0%})" for c in cells) + " |")
    lines += ["", "samples/s over both workers; each cell one measurement from the same run."]
    with open(os.path.join(args.out, "wan_throughput.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    for name, xs, key, fixed, xlabel in (
            ("wan_vs_bandwidth.png", rates, lambda x, m: (x, rtts[0], m), f"RTT {rtts[0]:g} ms",
             "bandwidth (Mbit/s)"),
            ("wan_vs_rtt.png", rtts, lambda x, m: (_mid(rates), x, m),
             f"{_mid(rates):g} Mbit/s", "round-trip time (ms)")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for m in present:
            ys = [by.get(key(x, m)) for x in xs]
            ax.plot(xs, ys, marker="o", label=LABELS[m])
        ax.axhline(bound, color="gray", linestyle="--", label=LABELS["local"])
        if name == "wan_vs_bandwidth.png":
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("samples/s (2 workers)")
        ax.set_title(f"6.3M-parameter MLP, 2 workers, {fixed}")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, name), dpi=110)
        plt.close(fig)


def _mid(values):
    return 100 if 100 in values else values[len(values) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rates", type=float, nargs="*", default=[10, 100, 1000])
    ap.add_argument("--rtts", type=float, nargs="*", default=[0, 50, 200, 700])
    ap.add_argument("--methods", nargs="*", default=METHODS + ["dts", "auto"],
                    choices=METHODS + ["dts", "auto"])
    ap.add_argument("--seconds", type=float, default=8.0, help="target timed seconds per run")
    ap.add_argument("--max-steps", type=int, default=30)
    ap.add_argument("--warmup-steps", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--dts-period", type=int, default=8)
    ap.add_argument("--dts-delay", type=int, default=8)
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results"))
    args = ap.parse_args()
    LABELS["dts"] = f"hvd_dgc DGC + DGA (D={args.dts_delay}) + period {args.dts_period}"
    LABELS["auto"] = f"hvd_dgc DGC + delay auto + period {args.dts_period}"
    ok, why = available()
    if not ok:
        sys.exit(f"wan_throughput: {why}")
    started = time.time()
    bound = local_rate()
    print(f"no-communication bound: {bound:.1f} samples/s (2 workers, no Horovod)", flush=True)
    rows = []
    for rate in args.rates:
        for rtt in args.rtts:
            with WanLink(rate_mbit=rate, rtt_ms=rtt) as link:
                for method in args.methods:
                    steps = steps_for(method, rate, rtt, args)
                    r = measure(link, method, steps, args)
                    rows.append({"rate_mbit": rate, "rtt_ms": rtt, "method": method,
                                 "steps": steps, "seconds": round(r["seconds"], 3),
                                 "samples_per_s": round(r["samples_per_s"], 2),
                                 "steps_per_s": round(r["steps_per_s"], 4),
                                 "vs_bound": round(r["samples_per_s"] / bound, 4),
                                 "flush_seconds": round(r["flush_seconds"], 3),
                                 "delay": r.get("delay")})
                    print(f"{link.description:>28}  {LABELS[method]:<26} "
                          f"{r['samples_per_s']:8.1f} samples/s  ({steps} steps, "
                          f"{time.time() - started:5.0f} s so far)", flush=True)
    write_outputs(rows, bound, args)


if __name__ == "__main__":
    main()
