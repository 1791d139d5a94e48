"""TensorFlow delayed gradient averaging over an emulated slow link (needs root).

    python bench/tf_dga_wan.py [--rate 100] [--rtts 0 50 200] [--delays 0 2 4]

2 ranks of bench/wan/tf_train_worker.py (Keras SGD momentum, DGC 0.1%, a 6.3M
parameter MLP, one thread each) across the emulator of harness/wan.py, one rank per
network namespace; for each round-trip time, samples/s for every delay, side
by side in one run, and the speed-up of each delay over synchronous DGC.
"""

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from harness.wan import WanLink, available  # noqa: E402
from harness.launch import run_job  # noqa: E402


def measure(link, delay, args):
    argv = [sys.executable, os.path.join(REPO, "bench", "wan", "tf_train_worker.py"),
            "--delay", str(delay), "--steps", str(args.steps)]
    results = run_job(link, argv, timeout=args.timeout)
    if any(code != 0 for code, _, _ in results):
        raise RuntimeError(f"delay={delay} over {link.description} failed:\n"
                           + "\n".join(err[-2000:] for _, _, err in results))
    return json.loads(results[0][1].strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rate", type=float, default=100)
    ap.add_argument("--rtts", type=float, nargs="*", default=[0, 50, 200])
    ap.add_argument("--delays", type=int, nargs="*", default=[0, 2, 4])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--timeout", type=int, default=600)
    args = ap.parse_args()
    ok, why = available()
    if not ok:
        sys.exit(f"tf_dga_wan: {why}")
    print(f"{'link':>28}  {'delay':>5}  {'samples/s':>9}  {'vs delay 0':>10}  flush s")
    for rtt in args.rtts:
        with WanLink(rate_mbit=args.rate, rtt_ms=rtt) as link:
            base = None
            for delay in args.delays:
                r = measure(link, delay, args)
                base = base or r["samples_per_s"]
                print(f"{link.description:>28}  {delay:>5}  {r['samples_per_s']:9.1f}  "
                      f"{r['samples_per_s'] / base:9.2f}x  {r['flush_seconds']:.3f}",
                      flush=True)


if __name__ == "__main__":
    main()
