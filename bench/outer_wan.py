"""AdamW across the world: the outer loop (DiLoCo) against dense Horovod over an emulated
WAN (issue 34).

    sudo python bench/outer_wan.py                          # 100 Mbit/s, RTT 0-700 ms
    python bench/outer_wan.py --rtts 200 --configs horovod "H=32, overlap"

Two workers, one CPU thread each, in two network namespaces joined by the user-space
link of harness/wan.py (rate cap, one-way delay); the same training in every run
(bench/wan/train_worker.py: an MLP of 2.1M parameters, 8.4 MB of fp32 gradient, batch
128, AdamW, synthetic data): dense Horovod AdamW (an allreduce every step), and
hvd_dgc's outer loop, H inner AdamW steps a round, the weights' change sent whole or at
a density (error feedback), with or without its exchange behind the next round
(``OuterLoop(overlap=True)``). Each run times whole rounds (4, or 2 for H = 128) after
warm-up rounds (with overlap, once an exchange is in flight), on each rank, and the
slower rank's rate counts (with overlap a rank may run up to a round ahead of the
other); the final ``flush()`` is timed apart, as an evaluation would be. The bound: the
same ranks over the same link with Horovod initialised and no round's end in the timed
window. ``--hosts 2x2``: 2 emulated hosts x 2 ranks under Horovod's own ``horovodrun``
(harness/hosts.py), the link between the hosts.

Throughput only: what the link costs. The loss does not depend on the link (the same
arithmetic), so the accuracy of the same settings is measured over loopback by
bench/adam_lm.py. Writes, from this one run:

    bench/results/outer_wan.csv   every measurement
    bench/results/outer_wan.md    samples/s and % of the bound, bytes per round
    bench/results/outer_wan.png   % of the bound against RTT
    (--model lm: outer_wan_lm.*; --framework keras: outer_wan_lm_keras.*; --hosts 2x2:
    the name ends _2x2)
"""

import argparse
import csv
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from harness.launch import run_job  # noqa: E402
from harness.hosts import EmulatedHosts  # noqa: E402
from harness.wan import WanLink, available  # noqa: E402
from bench.wan_throughput import WORKER, local_rate  # noqa: E402

MODELS = {"mlp": ["--width", "1024", "--batch", "128", "--optimizer", "adamw"],
          # the LM (bench/adam_lm.py's model, batches and AdamW)
          "lm": ["--model", "lm", "--batch", "32", "--optimizer", "adamw"]}
#: an H no timed window reaches: the same ranks, Horovod and link, no exchange
NO_ROUND = 10 ** 6
#: config -> (method, H, density, overlap); H None: an exchange every step
CONFIGS = {
    "no exchange": ("outer", NO_ROUND, 1.0, False),
    "horovod": ("dense", None, 1.0, False),
    "H=8": ("outer", 8, 1.0, False),
    "H=32": ("outer", 32, 1.0, False),
    "H=128": ("outer", 128, 1.0, False),
    "H=8, overlap": ("outer", 8, 1.0, True),
    "H=32, overlap": ("outer", 32, 1.0, True),
    "H=32, density 0.01, overlap": ("outer", 32, 0.01, True),
    "H=128, overlap": ("outer", 128, 1.0, True),
    "H=128, density 0.01, overlap": ("outer", 128, 0.01, True),
}
FIELDS = ["rate_mbit", "rtt_ms", "config", "steps", "seconds", "samples_per_s",
          "bytes_per_round", "flush_seconds", "busy", "vs_bound"]
LABELS = {"horovod": "Horovod AdamW (dense, every step)",
          "no exchange": "no exchange (the bound)"}


def label(config):
    return LABELS.get(config, f"outer loop {config}")


#: Keras (``--framework keras``): bench/wan/tf_train_worker.py's LM, the outer loop on
#: hvd_dgc's Keras optimizer, dense Horovod through its DistributedGradientTape
TF_WORKER = [sys.executable, os.path.join(REPO, "bench", "wan", "tf_train_worker.py"),
             "--batch", "32", "--keras", "2"]  # (Keras 2: bench/adam_lm.py keras_worker's)


def worker_argv(config, dense_steps, model=MODELS["mlp"], keras=False):
    """The worker's command line for ``config``, and its timed steps."""
    method, h, density, overlap = CONFIGS[config]
    if h is None:  # every step waits for its exchange: a few steps tell its rate
        steps, warmup = dense_steps, 2
        extra = ["--outer-steps", "0"] if keras else []
    elif h == NO_ROUND:  # as many steps as H=32's window, none of them a round's end
        steps, warmup = 4 * 32, 32
        extra = ["--outer-steps", str(h)]
    else:  # whole rounds; with overlap a round's exchange must be in flight first
        steps, warmup = (4 if h <= 32 else 2) * h, (2 if overlap else 1) * h
        extra = ["--outer-steps", str(h), "--outer-density", str(density)] + (
            ["--overlap"] if overlap else [])
    argv = (TF_WORKER if keras else WORKER + ["--method", method, *model]) + [
        "--steps", str(steps), "--warmup-steps", str(warmup), *extra]
    return steps, argv


def run_on_link(link, argv, config, timeout):
    """Two ranks, one in each namespace of ``link``: each rank's JSON report (rank 0's
    only where the worker prints no other)."""
    results = run_job(link, argv, env={"OMP_NUM_THREADS": "1"}, timeout=timeout)
    if any(code != 0 for code, _, _ in results):
        raise RuntimeError(f"{config} over {link.description} failed: rcs "
                           f"{[code for code, _, _ in results]}\n{results[0][2][-2000:]}\n"
                           f"{results[1][2][-2000:]}")
    return [json.loads(out.strip().splitlines()[-1]) for _, out, _ in results
            if out.strip()]


def run_on_hosts(hosts, argv, config, timeout):
    """Horovod's own ``horovodrun -np 4 -H h1:2,h2:2 --gloo`` on emulated hosts (two
    ranks a host over its loopback, the link between hosts): each rank's JSON report."""
    done = hosts.horovodrun(["--gloo", "--start-timeout", "300",
                             # (the link's device: no interface discovery, minutes on 2
                             # busy cores)
                             "--network-interfaces", "wan0", *argv],
                            env={"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                                 "PYTHONPATH": REPO}, timeout=timeout, cwd=REPO)
    reports = {}
    for line in done.stdout.splitlines():  # ("[rank]<stdout>:{...}")
        if '{"method"' in line:
            r = json.loads(line[line.index('{"method"'):])
            reports[r.get("rank", 0)] = r
    if done.returncode != 0 or not reports:
        raise RuntimeError(f"{config} on {hosts.description} failed: rc "
                           f"{done.returncode}\n{done.stderr[-3000:]}")
    return [reports[k] for k in sorted(reports)]


def measure(run, where, config, dense_steps, timeout, model=MODELS["mlp"], keras=False):
    """``config`` launched by ``run`` (run_on_link or run_on_hosts) on ``where``."""
    method, h, _, _ = CONFIGS[config]
    steps, argv = worker_argv(config, dense_steps, model, keras)
    ranks = run(where, argv, config, timeout)
    r = dict(ranks[0])
    r["busy"] = None
    if method == "outer":  # with overlap a rank may run a round ahead: the slowest decides
        r["samples_per_s"] = min(x["samples_per_s"] for x in ranks)
        # the share of its timed window a rank was not standing still for the link (the
        # least busy rank's): what a machine with a core per rank would turn into rate
        # (None: TF's exchange without overlap waits inside its traced step, untimed)
        r["busy"] = None if any(x["waited_seconds"] is None for x in ranks) else \
            min(1 - x["waited_seconds"] / x["seconds"] for x in ranks)
        r["seconds"] = max(x["seconds"] for x in ranks)
    rounds = r.get("outer_rounds")
    r["bytes_per_round"] = (r["outer_bytes_sent"] / rounds if h != NO_ROUND else 0) \
        if rounds else 4 * r["params"]
    return steps, r


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rate", type=float, default=100.0, help="Mbit/s")
    ap.add_argument("--rtts", type=float, nargs="*", default=[0, 50, 200, 700], help="ms")
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--dense-steps", type=int, default=6)
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results"))
    ap.add_argument("--append", action="store_true",
                    help="keep the rows of --out's CSV that this run does not measure again")
    ap.add_argument("--model", choices=list(MODELS), default="mlp",
                    help="lm: bench/adam_lm.py's byte-level transformer (470k parameters, "
                         "batch 32 x 128 bytes, real batches); writes outer_wan_lm.*")
    ap.add_argument("--framework", choices=["torch", "keras"], default="torch",
                    help="keras: the LM in Keras (--model lm), writes outer_wan_lm_keras.*")
    ap.add_argument("--hosts", choices=["2x2"],
                    help="2x2: 2 emulated hosts x 2 ranks (harness/hosts.py: network "
                         "namespaces with real sshd, Horovod's own horovodrun; the ranks "
                         "of a host talk over its loopback, the link joins the hosts); "
                         "writes <name>_2x2.*")
    args = ap.parse_args()
    keras = args.framework == "keras"
    if args.hosts and keras:
        ap.error("--hosts runs the PyTorch worker only")
    if keras and args.model != "lm":
        ap.error("--framework keras runs the LM only: add --model lm")
    args.name = "outer_wan" if args.model == "mlp" else (
        "outer_wan_lm_keras" if keras else "outer_wan_lm") + (
        f"_{args.hosts}" if args.hosts else "")
    ok, why = available()
    if not ok:
        sys.exit(f"outer_wan: the WAN emulator is unavailable here ({why}); run as root")
    started = time.time()
    bound = float("nan") if keras or args.hosts else local_rate(
        MODELS[args.model], steps=120, warmup_steps=10)
    print("the 'no exchange' rows are the bound" if keras or args.hosts else
          f"two workers without Horovod: {bound:.1f} samples/s", flush=True)
    rows = []
    for rtt in args.rtts:
        where = EmulatedHosts(["h1:2", "h2:2"], rate_mbit=args.rate, rtt_ms=rtt) \
            if args.hosts else WanLink(rate_mbit=args.rate, rtt_ms=rtt)
        run = run_on_hosts if args.hosts else run_on_link
        with where as link:
            for config in args.configs:
                steps, r = measure(run, link, config, args.dense_steps, args.timeout,
                                   MODELS[args.model], keras)
                rows.append({"rate_mbit": args.rate, "rtt_ms": rtt, "config": config,
                             "steps": steps, "seconds": round(r["seconds"], 3),
                             "samples_per_s": round(r["samples_per_s"], 1),
                             "bytes_per_round": int(r["bytes_per_round"]),
                             "flush_seconds": round(r["flush_seconds"], 3),
                             "busy": "" if r["busy"] is None else round(r["busy"], 4)})
                print(f"{link.description:>28}  {label(config):<40} "
                      f"{r['samples_per_s']:8.1f} samples/s  {time.time() - started:5.0f} s "
                      f"so far", flush=True)
    path = os.path.join(args.out, f"{args.name}.csv")
    if args.append and os.path.exists(path):
        with open(path) as f:
            again = {(r["rtt_ms"], r["config"]) for r in rows}
            kept = [r for r in csv.DictReader(f)
                    if (float(r["rtt_ms"]), r["config"]) not in again]
        rows = [dict({"busy": ""}, **{k: (float(v) if k in ("rate_mbit", "rtt_ms",
                                                             "samples_per_s") else
                                          int(float(v)) if k == "bytes_per_round" else v)
                                      for k, v in r.items() if k != "vs_bound"})
                for r in kept] + rows
    write(rows, bound, args)


def _cell(r):
    """samples/s (% of the bound), and for the outer loop the share of the time it did
    not wait for the link ("busy")."""
    busy = r.get("busy")
    busy = "" if busy in ("", None) else f"; busy {100 * float(busy):.1f}%"
    return f"{float(r['samples_per_s']):.0f} ({100 * r['vs_bound']:.0f}%{busy})"


def write(rows, bound, args):
    """vs_bound: against the same link's "no exchange" row (else two workers without
    Horovod)."""
    bounds = {r["rtt_ms"]: r["samples_per_s"] for r in rows if r["config"] == "no exchange"}
    if bounds:  # (no exchange: the link does not matter; where one was measured, its)
        bound = sum(bounds.values()) / len(bounds)
    for r in rows:
        r["vs_bound"] = round(r["samples_per_s"] / bounds.get(r["rtt_ms"], bound), 4)
    rows.sort(key=lambda r: (r["rtt_ms"], list(CONFIGS).index(r["config"])))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.name}.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    rtts = sorted({r["rtt_ms"] for r in rows})
    configs = [c for c in CONFIGS if any(r["config"] == c for r in rows)]
    cell = {(r["config"], r["rtt_ms"]): r for r in rows}
    model = ("bench/wan/train_worker.py's MLP of 2.1M parameters with AdamW, batch 128 "
             "per worker" if args.model == "mlp" else
             "bench/adam_lm.py's byte-level transformer LM on the standard library's "
             "sources, 470k parameters, AdamW, batch 32 x 128 bytes per worker"
             + (", in Keras 3 (tf_train_worker.py; Horovod's DistributedGradientTape "
                "for the dense run)" if args.framework == "keras" else ""))
    workers = ("2 emulated hosts x 2 ranks (Horovod's own horovodrun over real sshd; "
               "the ranks of a host share its loopback, the link joins the hosts), 1 CPU "
               "thread a rank (4 ranks on this machine's 2 cores)" if args.hosts else
               "2 workers x 1 CPU thread")
    with open(os.path.join(args.out, f"{args.name}.md"), "w") as f:
        f.write("# The outer loop over an emulated WAN: AdamW, "
                f"{'2 hosts x 2 ranks' if args.hosts else '2 workers'}\n\n"
                f"`python bench/outer_wan.py --model {args.model} --framework "
                f"{args.framework}{' --hosts ' + args.hosts if args.hosts else ''}` (one "
                f"run; {args.rate:g} Mbit/s, {workers}, {model}). Cells: samples/s (% of "
                "the bound: the same ranks over the link, Horovod initialised, an H that "
                f"no timed window reaches, {bound:.0f} samples/s where it was measured at "
                "one RTT only; busy: the share of the timed window the least busy rank did "
                "not stand still waiting for an exchange at a round's end, from its "
                "`waited_seconds`). Plot: "
                f"[{args.name}.png]({args.name}.png)."
                + (" Rows kept from earlier runs (`--append`): a column's rows may come "
                   "from different runs, each against its own run's bound where it "
                   "measured one." if args.append else "") + "\n\n")
        f.write("| run | bytes sent per exchange (a round; Horovod: a step) | " + " | ".join(
            f"RTT {t:g} ms" for t in rtts) + " |\n|---|---|" + "---|" * len(rtts) + "\n")
        for c in configs:
            some = next(cell[(c, t)] for t in rtts if (c, t) in cell)
            f.write(f"| {label(c)} | {some['bytes_per_round'] / 1e6:.2f} MB | " + " | ".join(
                _cell(cell[(c, t)]) if (c, t) in cell else "" for t in rtts) + " |\n")
    plot(rows, configs, args)
    print(f"wrote {args.out}/{args.name}.csv, .md and .png")


def plot(rows, configs, args):
    """% of the bound against RTT, a line a run (the bound itself left out)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no matplotlib: no plot)")
        return
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for c in configs:
        if c == "no exchange":
            continue
        points = sorted((r["rtt_ms"], 100 * r["vs_bound"]) for r in rows if r["config"] == c)
        ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label=label(c))
    ax.axhline(90, color="grey", lw=0.8, ls="--")
    ax.set_xlabel(f"round-trip time (ms), {args.rate:g} Mbit/s")
    ax.set_ylabel("% of the no-exchange rate")
    ax.set_ylim(0, 120)
    ax.set_title(f"AdamW {args.model.upper()} over an emulated WAN"
                 + (", 2 hosts x 2 ranks" if args.hosts else ", 2 workers"))
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, f"{args.name}.png"), dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
