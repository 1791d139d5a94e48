"""Accuracy of DGC's record values in 8 bits against fp32 values and against Horovod:
digits (scikit-learn's), an MLP (64-256-256-10), SGD with momentum, 2 ranks under
``horovodrun --gloo``, the same data, seeds and batches for every configuration, one
launch. Prints each seed's test accuracy, the means and the gaps paired by seed.

    python bench/value_bits.py                     # seeds 1-5, density 0.001, 30 epochs
    python bench/value_bits.py --np 4 --seeds 1 2 3

DGC runs at ``--density`` after a 3-epoch warm-up, with the cost model's assumed 1 Gbit/s
link, so the large weights go sparse (on loopback the measured link would send them
dense and test nothing).
"""

import argparse
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from harness.hvdrun import run  # noqa: E402
from harness.value_bits import CONFIGS  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--density", type=float, default=0.001)
    args = parser.parse_args()
    start = time.time()
    out = run("harness.value_bits:digits", np=args.np, controller="gloo", timeout=3600,
              kwargs={"seeds": tuple(args.seeds), "epochs": args.epochs,
                      "density": args.density})[0]
    print(f"digits MLP, {args.np} ranks (Gloo), DGC {args.density:g} after 3 epochs, "
          f"{args.epochs} epochs, seeds {args.seeds}; {time.time() - start:.0f} s\n")
    print("| run | " + " | ".join(f"seed {s}" for s in args.seeds)
          + " | mean % | vs Horovod (points, paired) | bytes ratio |")
    print("|---|" + "---|" * (len(args.seeds) + 3))
    base = out["horovod"]["accuracy"]
    for config in CONFIGS:
        acc = out[config]["accuracy"]
        gaps = [100 * (a - b) for a, b in zip(acc, base)]
        spread = statistics.stdev(gaps) if len(gaps) > 1 else 0.0
        print(f"| {config} | " + " | ".join(f"{100 * a:.2f}" for a in acc)
              + f" | {100 * statistics.mean(acc):.2f} | {statistics.mean(gaps):+.2f} "
              f"± {spread:.2f} | {statistics.mean(out[config]['ratio']):.0f}x |")


if __name__ == "__main__":
    main()
