"""Accuracy of region reduce against allgather DGC on digits at N = 4 (issue 15), over
more seeds than the test affords: per seed, paired gap, mean and its standard error.

    python bench/region_accuracy.py                     # seeds 0-7, Horovod's defaults
    python bench/region_accuracy.py --seeds 0 1 2 3 --deterministic   # the test's setting

The workload is the test's (tests/torch/torch_aggregation.py ``digits``): an MLP on
scikit-learn's digits, 4 ranks (Gloo), DGC 1% after a 3-epoch warm-up, 30 epochs, both
aggregations trained on the same data, seeds and batches in one launch. With Horovod's
fusion on (its default) a fused buffer's layout, and so the ring's order of sums,
depends on timing, and runs of the same code differ; ``--deterministic`` turns fusion
off, as the test does, so a run repeats bit for bit.
"""

import argparse
import math
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


# One launch runs both aggregations for every seed: the test worker's function, by name
# (not imported: benchmarks do not import the tests), after each rank's hvd.init().
WORKER = "tests.torch.torch_aggregation:digits"
INIT = {"HVD_DGC_RANK_SETUP": "hvd_dgc.torch:init"}  # harness/hvdrun_worker.py calls it first


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(8)))
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--deterministic", action="store_true",
                        help="HOROVOD_FUSION_THRESHOLD=0 (runs repeat bit for bit)")
    args = parser.parse_args()
    from harness.hvdrun import run
    env = {"HOROVOD_FUSION_THRESHOLD": "0", "HOROVOD_CYCLE_TIME": "1"} \
        if args.deterministic else {}
    start = time.time()
    results = run(WORKER, np=4, controller="gloo",
                  kwargs={"seeds": tuple(args.seeds), "epochs": args.epochs}, timeout=3600,
                  env={**env, **INIT})
    out = results[0]
    gather, region = out["allgather"]["accuracy"], out["region"]["accuracy"]
    gaps = [100 * (a - r) for a, r in zip(gather, region)]
    print(f"digits MLP, 4 ranks (Gloo), DGC 1%, {args.epochs} epochs, seeds {args.seeds}, "
          f"fusion {'off' if args.deterministic else 'on (Horovod default)'}; "
          f"{time.time() - start:.0f} s")
    print("| seed | allgather % | region % | gap (points) |\n|---|---|---|---|")
    for seed, a, r, g in zip(args.seeds, gather, region, gaps):
        print(f"| {seed} | {100 * a:.2f} | {100 * r:.2f} | {g:+.2f} |")
    mean = statistics.mean(gaps)
    se = statistics.stdev(gaps) / math.sqrt(len(gaps)) if len(gaps) > 1 else float("nan")
    print(f"\nallgather {100 * statistics.mean(gather):.2f}% "
          f"(spread {100 * (max(gather) - min(gather)):.2f}), region "
          f"{100 * statistics.mean(region):.2f}% (spread {100 * (max(region) - min(region)):.2f})")
    print(f"gap allgather - region: mean {mean:+.2f} points, standard error {se:.2f}, "
          f"per seed {min(gaps):+.2f} to {max(gaps):+.2f}; "
          f"target within 0.5: {'met' if mean <= 0.5 else 'NOT met'} on the mean")
    print(f"region returned {out['region']['stats']['returned_elements']} elements to "
          f"owners' memories (last seed)")


if __name__ == "__main__":
    main()
