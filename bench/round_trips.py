"""Round trips per synchronous step over an emulated link, before and after hvd_dgc's
buckets (issue 17), beside Horovod's floor, in one run.

    python bench/round_trips.py                    # RTT 0 and 100 ms, 1000 Mbit/s
    python bench/round_trips.py --rtt 200 --steps 8
    python bench/round_trips.py --probe             # single collectives, no training

A step's latency on a slow link is the number of round trips it waits for times the
RTT. Each setting runs at RTT 0 and at the given RTT over the same link emulator
(harness/wan.py; bandwidth high enough that the records' bytes do not count),
and round trips per step = (step time at RTT - step time at 0) / RTT: the round trips
on the step's critical path, as the link sees them, whatever Horovod does inside.

Settings (bench/wan/train_worker.py's MLP, DGC 0.1%, synchronous: delay 0):
  floor       the local step, then one Horovod allreduce of one number: the least a
              synchronous step waits under Horovod's controller
  dense       Horovod's DistributedOptimizer (its own tensor fusion)
  per-tensor  hvd_dgc, fusion_threshold=0: one launch per tensor, from its hook
  buckets-unfolded  hvd_dgc, default fusion_threshold (Horovod's 64 MiB): one launch
              per bucket, here the whole step's tensors: an allreduce of its dense
              tensors and an allgather of its records (CostModel(alpha=5e-6) keeps
              them apart)
  buckets     the same, the dense tensors inside the allgather (CostModel.folds):
              one Horovod operation per step

``--framework tf``: the same with Keras (bench/wan/tf_train_worker.py's MLP, SGD momentum,
DGC 0.1%, the optimizer's apply_gradients in a tf.function): floor, dense (Horovod's
DistributedGradientTape), and hvd_dgc with ``fusion_threshold=0`` (``per-tensor``: the
dense tensors folded, each tensor its own allgather), ``CostModel(alpha=0)``
(``buckets-unfolded``: nothing folds, and with no latency every tensor leaves alone) and
its defaults (``buckets``: the step's tensors in one grouped allgather). ``--fit``
trains the same model with ``model.fit`` (dense: Horovod's Keras optimizer, Keras 2
only; no floor row: the loop's is the link's); ``--keras 2|3`` picks tf_keras or
Keras 3.

``--probe`` times single Horovod collectives the same way (bench/wan/collective_probe.py):
what one operation costs under Horovod's controller, and what makes it cost more.
"""

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from harness.wan import WanLink, available  # noqa: E402
from harness.launch import run_job  # noqa: E402
from bench.wan_throughput import WORKER  # noqa: E402

SETTINGS = {
    "floor": ["--method", "floor"],
    "dense": ["--method", "dense"],
    "per-tensor": ["--method", "dgc", "--fusion-threshold", "0"],
    # 5 us of latency: too little to fold; buckets close after a few tensors' bytes
    # (fusion.BUCKET_LATENCIES; with none at all every tensor would leave alone)
    "buckets-unfolded": ["--method", "dgc", "--cost-alpha", "5e-6"],
    "buckets": ["--method", "dgc"],
}


TF_WORKER = [sys.executable, os.path.join(REPO, "bench", "wan", "tf_train_worker.py")]
TF_SETTINGS = {
    "floor": ["--method", "floor"],
    "dense": ["--method", "dense"],
    "per-tensor": ["--method", "dgc", "--fusion-threshold", "0"],
    "buckets-unfolded": ["--method", "dgc", "--cost-alpha", "0"],
    "buckets": ["--method", "dgc"],
}


def step_seconds(link, setting, args):
    worker, settings = (TF_WORKER, TF_SETTINGS) if args.framework == "tf" else \
        (WORKER, SETTINGS)
    argv = worker + settings[setting] + ["--steps", str(args.steps), "--warmup-steps", "3",
                                         "--width", str(args.width), "--batch", "32"]
    if args.framework == "tf":
        argv += (["--fit"] if args.fit else []) + (["--keras", args.keras] if args.keras
                                                    else [])
    results = run_job(link, argv, timeout=900)
    if any(code != 0 for code, _, _ in results):
        raise RuntimeError(f"{setting} over {link.description} failed:\n"
                           f"{results[0][2][-2000:]}\n{results[1][2][-2000:]}")
    out = json.loads(results[0][1].strip().splitlines()[-1])
    return out["seconds"] / out["steps"], out.get("launches")


PROBES = ["allreduce", "allgather_fixed", "allgather_vary", "two_ops_fixed"]


def probe(args):
    times = {}
    for rtt in (0.0, args.rtt):
        with WanLink(rate_mbit=args.rate, rtt_ms=rtt) as link:
            argv = [sys.executable, os.path.join(REPO, "bench", "wan", "collective_probe.py"),
                    *PROBES]
            results = run_job(link, argv, timeout=600)
            if any(code != 0 for code, _, _ in results):
                raise RuntimeError(f"probe over {link.description} failed:\n"
                                   f"{results[0][2][-2000:]}")
            times[rtt] = json.loads(results[0][1].strip().splitlines()[-1])
    print(f"2 ranks, {args.rate:g} Mbit/s, one collective at a time, 8 timed each\n")
    print(f"| operation | at RTT 0 (ms) | at RTT {args.rtt:g} (ms) | round trips |\n"
          "|---|---|---|---|")
    for kind in PROBES:
        t0, t1 = times[0.0][kind], times[args.rtt][kind]
        print(f"| {kind} | {1e3 * t0:.1f} | {1e3 * t1:.0f} | "
              f"{(t1 - t0) / (args.rtt / 1e3):.1f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=1000, help="Mbit/s")
    ap.add_argument("--rtt", type=float, default=100, help="ms")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--framework", choices=["torch", "tf"], default="torch")
    ap.add_argument("--settings", nargs="+", default=None,
                    choices=sorted(set(SETTINGS) | set(TF_SETTINGS)),
                    help="default: every setting of the framework")
    ap.add_argument("--probe", action="store_true", help="single collectives, no training")
    ap.add_argument("--fit", action="store_true", help="tf: train with Keras' model.fit")
    ap.add_argument("--keras", choices=["2", "3"], default=None, help="tf: Keras version")
    args = ap.parse_args()
    if (args.fit or args.keras) and args.framework != "tf":
        sys.exit("round_trips: --fit and --keras are for --framework tf")
    ok, why = available()
    if not ok:
        sys.exit(f"round_trips: {why}")
    if args.probe:
        return probe(args)
    known = TF_SETTINGS if args.framework == "tf" else SETTINGS
    if args.fit:
        known = {k: v for k, v in known.items() if k != "floor"}
        if args.keras != "2":
            known.pop("dense")  # Horovod 0.28.1's Keras optimizer: Keras 2 only
    args.settings = args.settings or list(known)
    unknown = [s for s in args.settings if s not in known]
    if unknown:
        sys.exit(f"round_trips: {unknown} are not settings of --framework {args.framework}: "
                 f"choose among {list(known)}")
    times = {}
    for rtt in (0.0, args.rtt):
        with WanLink(rate_mbit=args.rate, rtt_ms=rtt) as link:
            for setting in args.settings:
                times[setting, rtt] = step_seconds(link, setting, args)
    how = "" if args.framework != "tf" else \
        (" model.fit" if args.fit else " tf.function loop") + \
        (f", Keras {args.keras}" if args.keras else "")
    print(f"{args.framework}{how}: 2 workers, {args.rate:g} Mbit/s, RTT 0 and {args.rtt:g} ms; "
          f"MLP width "
          f"{args.width}, {args.steps} timed steps each, synchronous\n")
    print("| setting | hvd_dgc launches per step | step at RTT 0 (ms) | step at RTT "
          f"{args.rtt:g} (ms) | round trips per step |\n|---|---|---|---|---|")
    for setting in args.settings:
        (t0, launches), (t1, _) = times[setting, 0.0], times[setting, args.rtt]
        trips = (t1 - t0) / (args.rtt / 1e3)
        print(f"| {setting} | {launches if launches is not None else '-'} | {1e3 * t0:.0f} | "
              f"{1e3 * t1:.0f} | {trips:.1f} |")


if __name__ == "__main__":
    main()
