"""Bytes on the wire a step, per rank, in real runs: hvd_dgc's modes on ResNet-50's and
the stdlib byte LM's parameter shapes, 2 and 4 ranks (``horovodrun --gloo`` on this host).

    python bench/wire.py                 # the table
    python bench/wire.py --csv           # n_workers,mode,bytes_received_per_rank,...
    python bench/wire.py --np 2 --models resnet50

Synthetic gradients (the records' size depends on the shapes, the density and the
planner's paths, not on the values), DGC at its final density 0.001 from the first step
(``warmup=0``), the cost model's assumed 1 Gbit/s link so the planner compresses. A rank's
bytes sent are hvd_dgc's own count (``compression_stats()["last_step"]``); received are
priced from each tensor's path: the allgather's every rank's records, the ring allreduce's
2 (N-1)/N of the tensor, region reduce's hvd_dgc/aggregation.py ``region_bytes``. A
small dense tensor that rides in its launch's allgather (its values alone) is priced as
the ring's: equal at N = 2, half of what it receives from N = 4 on.
"""

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from harness.hvdrun import run  # noqa: E402
from harness.wire import MODES  # noqa: E402

COLUMNS = ["model", "n_workers", "mode", "bytes_received_per_rank", "dense_bytes_per_rank",
           "bytes_sent_per_rank", "dense_sent_per_rank", "fewer_than_dense_sent", "paths"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--np", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--models", nargs="+", default=["resnet50", "stdlib_lm"],
                        choices=["resnet50", "stdlib_lm"])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--csv", action="store_true")
    args = parser.parse_args()
    rows = []
    for model in args.models:
        for np_ in args.np:
            for mode in args.modes:
                r = run("harness.wire:step_bytes", np=np_, timeout=900,
                        kwargs={"model": model, "mode": mode})[0]
                rows.append((model, np_, mode, round(r["received"]), round(r["dense_received"]),
                             r["sent"], r["dense_sent"], r["dense_sent"] / r["sent"],
                             " ".join(f"{k}:{v}" for k, v in sorted(r["paths"].items()))))
    if args.csv:
        print(",".join(COLUMNS))
        for row in rows:
            print(",".join(f"{v:.1f}" if isinstance(v, float) else str(v) for v in row))
        return
    print("| model | N | mode | received a step | dense ring's | sent a step | fewer than "
          "dense fp32 | paths |")
    print("|---|---|---|---|---|---|---|---|")
    for m, n, mode, rec, drec, sent, dsent, ratio, paths in rows:
        print(f"| {m} | {n} | {mode} | {rec:,} | {drec:,} | {sent:,} | {ratio:.0f}x | {paths} |")


if __name__ == "__main__":
    main()
