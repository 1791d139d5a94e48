"""Temporally sparse updates at one link: samples/s for several (period, delay, Horovod
cycle time) settings, beside the no-communication bound, in one run (issue 17).

    python bench/period_sweep.py                              # 100 Mbit/s, RTT 200 ms
    python bench/period_sweep.py --rtt 50 --settings 4:4:1 8:8:1

A setting is ``period:delay:cycle_ms`` (cycle: HOROVOD_CYCLE_TIME; delay may be
``auto``: delay="auto", its D at the end and its decisions printed). The training is
bench/wan_throughput.py's (bench/wan/train_worker.py, DGC 0.1%), over its emulated link.
"""

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from harness.wan import WanLink, available  # noqa: E402
from harness.launch import run_job  # noqa: E402
from bench.wan_throughput import MODEL, WORKER, local_rate  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=100)
    ap.add_argument("--rtt", type=float, default=200)
    ap.add_argument("--settings", nargs="+", default=["4:4:1", "8:8:1", "8:8:5", "16:16:5"])
    ap.add_argument("--steps", type=int, default=48)
    args = ap.parse_args()
    ok, why = available()
    if not ok:
        sys.exit(f"period_sweep: {why}")
    bound = local_rate()
    print(f"no-communication bound: {bound:.0f} samples/s; link {args.rate:g} Mbit/s, "
          f"RTT {args.rtt:g} ms; {args.steps} timed steps after period + delay\n")
    print("| period, delay, HOROVOD_CYCLE_TIME | samples/s | of the bound | D at the end "
          "(decisions: step, D) |\n|---|---|---|---|")
    with WanLink(rate_mbit=args.rate, rtt_ms=args.rtt) as link:
        for setting in args.settings:
            period, delay, cycle = setting.split(":")
            argv = WORKER + ["--method", "dts", "--period", period, "--delay", delay,
                             "--steps", str(args.steps), "--warmup-steps",
                             str(int(period) + (8 if delay == "auto" else int(delay))), *MODEL]
            results = run_job(link, argv, env={"HOROVOD_CYCLE_TIME": cycle}, timeout=900)
            if any(code != 0 for code, _, _ in results):
                raise RuntimeError(f"{setting} failed:\n{results[0][2][-2000:]}")
            out = json.loads(results[0][1].strip().splitlines()[-1])
            rate = out["samples_per_s"]
            chosen = "" if delay != "auto" else f"{out['delay']} {out['delay_decisions']}"
            print(f"| {period}, {delay}, {cycle} ms | {rate:.0f} | {rate / bound:.0%} | "
                  f"{chosen} |", flush=True)


if __name__ == "__main__":
    main()
