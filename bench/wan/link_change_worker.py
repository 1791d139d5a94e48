"""One rank of bench/link_change.py: the same training through phases between which the
driver changes the emulated link's rate.

After each phase but the last, rank 0 writes DIR/ready.<i> and waits for DIR/changed.<i>
(rank 1 waits in the next step's collective meanwhile). Each phase's rate is timed over
its steps after the first ``--settle`` (where the change is read and acted on). Prints,
on rank 0, one JSON line: each phase's samples/s, the paths taken in it, and the steps at
which the link watch re-decided.

    --method dense   Horovod's DistributedOptimizer (fp32 allreduce)
             watch   hvd_dgc at --density, the link measured and watched (the default)
             once    hvd_dgc at --density, the link measured at wrap time only
                     (link_watch=False)
"""

import argparse
import json
import os
import time

import torch
import torch.nn as nn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", required=True, choices=["dense", "watch", "once"])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--phases", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40, help="per phase")
    ap.add_argument("--settle", type=int, default=20, help="untimed steps of a phase")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--density", type=float, default=0.0625)
    ap.add_argument("--window", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # (a fixed batch: train_worker.py says why)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, args.width), nn.ReLU(),
                          nn.Linear(args.width, args.width), nn.ReLU(),
                          nn.Linear(args.width, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if args.method == "dense":
        import horovod.torch as hvd
        options = {}
    else:
        import hvd_dgc.torch as hvd
        options = dict(density=args.density,
                       link_watch=hvd.LinkWatch(window=args.window)
                       if args.method == "watch" else False)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), **options)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, 1024, generator=gen)
    y = torch.randint(0, 10, (args.batch,), generator=gen)
    stats = getattr(opt, "compression_stats", dict)

    def step():
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    phases = []
    for phase in range(args.phases):
        for _ in range(args.settle):
            step()
        before = dict(stats().get("paths", {}))
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        seconds = time.perf_counter() - start
        after = stats().get("paths", {})
        phases.append({"samples_per_s": args.steps * args.batch * size / seconds,
                       "paths": {k: v - before.get(k, 0) for k, v in after.items()
                                 if v - before.get(k, 0)}})
        if phase + 1 < args.phases and rank == 0:
            open(os.path.join(args.dir, f"ready.{phase}"), "w").close()
            while not os.path.exists(os.path.join(args.dir, f"changed.{phase}")):
                time.sleep(0.02)
    if rank == 0:
        s = stats()
        print(json.dumps({"method": args.method, "phases": phases,
                          "relinked_at": s.get("relinked_at"),
                          "link_probes": s.get("link_probes")}), flush=True)


if __name__ == "__main__":
    main()
