"""Accuracy of the one-line switch: examples/pytorch_mnist.py (a CNN; digits when MNIST
cannot be had) under Horovod dense and under hvd_dgc with the switch alone, 2 ranks,
several seeds, SGD with momentum and AdamW. Prints per-seed final test accuracy,
mean and spread, the gap to dense and the bytes ratio, all from one run.

    python bench/one_line_accuracy.py                      # the issue-14 table
    python bench/one_line_accuracy.py --seeds 1 2 --optimizers sgd \\
        --config dgc_0.1%=--dgc,--density,0.001            # any extra configuration

A configuration is ``name=flags`` with the example's flags comma-separated; ``dense``
(no --dgc: Horovod itself) is always run and is the reference.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIGS = ["dgc_defaults=--dgc"]
LR = {"sgd": "0.01", "adamw": "0.001"}


def run_once(flags, optimizer, seed, epochs, batch_size):
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    cmd = [horovodrun, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
           os.path.join(REPO, "examples", "pytorch_mnist.py"), "--no-progress",
           "--epochs", str(epochs), "--batch-size", str(batch_size), "--seed", str(seed),
           "--optimizer", optimizer, "--lr", LR[optimizer], *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    out = "\n".join(line.split(":", 1)[1] for line in proc.stdout.splitlines()
                    if line.startswith("[0]<stdout>:"))
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    accuracy = float(re.findall(r"test accuracy ([\d.]+)", out)[-1])
    sent = int(re.search(r"whole run: sent ([\d,]+) B", out).group(1).replace(",", ""))
    return accuracy, sent


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--optimizers", nargs="+", default=["sgd", "adamw"], choices=list(LR))
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--config", action="append", default=None,
                        help="name=flags (comma-separated example flags); repeatable")
    args = parser.parse_args()
    configs = [("dense", [])] + [(c.split("=", 1)[0], [f for f in c.split("=", 1)[1].split(",")
                                                      if f])
                                 for c in (args.config or DEFAULT_CONFIGS)]
    print(f"examples/pytorch_mnist.py, 2 ranks (Gloo), {args.epochs} epochs, batch "
          f"{args.batch_size} per rank, seeds {args.seeds}", flush=True)
    rows = []
    for optimizer in args.optimizers:
        results = {}
        for name, flags in configs:
            start = time.time()
            runs = [run_once(flags, optimizer, seed, args.epochs, args.batch_size)
                    for seed in args.seeds]
            results[name] = runs
            accs = [a for a, _ in runs]
            print(f"  {optimizer:5s} {name:16s} " + " ".join(f"{a:.4f}" for a in accs)
                  + f"  ({time.time() - start:.0f} s)", flush=True)
        dense_accs = [a for a, _ in results["dense"]]
        dense_bytes = results["dense"][0][1]
        for name, runs in results.items():
            accs = [a for a, _ in runs]
            gaps = [a - d for a, d in zip(accs, dense_accs)]  # paired by seed
            rows.append((optimizer, name, statistics.mean(accs), statistics.pstdev(accs),
                         statistics.mean(gaps) * 100, statistics.pstdev(gaps) * 100,
                         dense_bytes / statistics.mean(b for _, b in runs)))
    print("\n| optimizer | run | test accuracy (mean ± sd) | vs dense, points (mean ± sd, "
          "paired by seed) | bytes ratio vs dense |")
    print("|---|---|---|---|---|")
    for opt, name, mean, sd, gap, gap_sd, ratio in rows:
        print(f"| {opt} | {name} | {mean:.4f} ± {sd:.4f} | {gap:+.2f} ± {gap_sd:.2f} | "
              f"{ratio:.1f}x |")


if __name__ == "__main__":
    main()
