"""One rank of the WAN throughput benchmark (bench/wan_throughput.py).

The same training for every method: an MLP whose gradient is large for its
compute (on one CPU thread), momentum SGD, synthetic data. Prints one JSON line
on rank 0: steps/s and samples/s over the timed steps, after warm-up steps.

    --method local   no Horovod at all: the no-communication rate of one worker
             floor   the local step plus one Horovod allreduce of one number: the least
                     a synchronous step can wait under Horovod's controller
             dense   Horovod's DistributedOptimizer (fp32 allreduce)
             fp16    Horovod's DistributedOptimizer, Compression.fp16
             dgc     hvd_dgc, DGC at --density (no warm-up: steady-state speed)
             dga     hvd_dgc, DGC + delayed averaging (--delay)
             dts     hvd_dgc, DGC + delayed averaging + temporally sparse updates
                     (--delay, --period: an exchange every period-th step)
             outer   hvd_dgc's outer loop (DiLoCo): --outer-steps inner steps a round,
                     the weights' change sent whole or at --outer-density, --overlap
    --optimizer adamw: AdamW instead of momentum SGD (the inner optimizer for outer).
    hvd_dgc's methods take --fusion-threshold (bytes; 0: one launch per tensor).
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))))  # (the repository: harness/stdlib_lm.py for --model lm)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", required=True, choices=["local", "floor", "dense", "fp16", "dgc",
                                                          "dga", "dts", "outer"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup-steps", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--density", type=float, default=0.001)
    ap.add_argument("--delay", default="4", help="an int, or auto (delay=\"auto\")")
    ap.add_argument("--period", type=int, default=4)
    ap.add_argument("--fusion-threshold", type=int, default=None)
    ap.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    ap.add_argument("--outer-steps", type=int, default=32)
    ap.add_argument("--outer-density", type=float, default=1.0)
    ap.add_argument("--overlap", action="store_true")
    ap.add_argument("--value-bits", type=int, default=32, help="OuterLoop(value_bits=)")
    ap.add_argument("--model", choices=["mlp", "lm"], default="mlp",
                    help="lm: harness/stdlib_lm.py's byte-level transformer on the "
                         "standard library's sources (bench/adam_lm.py's; AdamW lr 2e-3)")
    ap.add_argument("--cost-alpha", type=float, default=None,
                    help="hvd_dgc CostModel alpha (s); 0: a bucket's dense tensors keep "
                         "their own allreduce (CostModel.folds)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    # The batch is fixed and synthetic: a run that trains long enough on it memorises it,
    # its gradients and Adam's moments fall into the denormal range, and there an x86
    # core is up to 20x slower (measured: the outer loop at H=128, density 0.01, went
    # from 42 to 2.5 steps/s). Real training does not sit there; the GPU flushes them.
    torch.set_flush_denormal(True)
    torch.manual_seed(0)
    if args.model == "lm":
        from harness.stdlib_lm import byte_lm
        model = byte_lm(128)
    else:
        model = nn.Sequential(nn.Linear(1024, args.width), nn.ReLU(),
                              nn.Linear(args.width, args.width), nn.ReLU(),
                              nn.Linear(args.width, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9) \
        if args.optimizer == "sgd" else torch.optim.AdamW(
            model.parameters(), **(dict(lr=2e-3, weight_decay=0.01) if args.model == "lm"
                                   else dict(lr=1e-3)))
    rank, size = 0, 1
    floor = None
    if args.method == "floor":
        import horovod.torch as hvd
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        floor = lambda: hvd.allreduce(torch.zeros(1), name="floor")  # noqa: E731
    elif args.method != "local":
        if args.method in ("dense", "fp16"):
            import horovod.torch as hvd
            compression = hvd.Compression.fp16 if args.method == "fp16" else hvd.Compression.none
            options = {}
        elif args.method == "outer":
            import hvd_dgc.torch as hvd
            compression = hvd.Compression.dgc  # (the outer loop's records, or whole)
            options = dict(outer=hvd.OuterLoop(steps=args.outer_steps, overlap=args.overlap,
                                               value_bits=args.value_bits),
                           density=args.outer_density)
        else:
            import hvd_dgc.torch as hvd
            compression = hvd.Compression.dgc
            delay = args.delay if args.delay == "auto" else int(args.delay)
            options = dict(density=args.density,
                           delay=delay if args.method in ("dga", "dts") else 0,
                           period=args.period if args.method == "dts" else 1,
                           fusion_threshold=args.fusion_threshold)
            if args.cost_alpha is not None:
                options["cost_model"] = hvd.CostModel(alpha=args.cost_alpha)
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=compression, **options)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, 1024, generator=gen)
    y = torch.randint(0, 10, (args.batch,), generator=gen)
    if args.model == "lm":  # real batches, each step its own
        from harness.stdlib_lm import Batches, loss_of
        data = Batches(128, 0, rank)

        def loss_fn():
            return loss_of(model, *data.next(args.batch))
    else:
        def loss_fn():
            return nn.functional.cross_entropy(model(x), y)

    def step():
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        opt.step()
        if floor is not None:
            floor()
        return loss

    for _ in range(args.warmup_steps):
        step()
    waited = getattr(opt, "compression_stats", dict)().get("waited_seconds")
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    elapsed = time.perf_counter() - start
    if waited is not None:  # (outer: the timed steps' wait for exchanges at round ends)
        waited = opt.compression_stats()["waited_seconds"] - waited
    flush = 0.0
    if args.method in ("dga", "dts", "outer"):  # once per evaluation, not per step: apart
        start = time.perf_counter()
        opt.flush()
        flush = time.perf_counter() - start
    if rank == 0 or args.method == "outer":  # (outer: each rank's own rate; they drift)
        params = sum(p.numel() for p in model.parameters())
        stats = getattr(opt, "compression_stats", dict)()  # (stock Horovod: none)
        print(json.dumps({"method": args.method, "rank": rank, "steps": args.steps,
                          "seconds": elapsed,
                          "steps_per_s": args.steps / elapsed,
                          "samples_per_s": args.steps * args.batch * size / elapsed,
                          "workers": size, "params": params, "loss": float(loss.detach()),
                          "flush_seconds": flush, "delay": stats.get("delay"),
                          "launches": stats.get("last_step", {}).get("launches"),
                          "delay_decisions": stats.get("delay_decisions"),
                          "outer_rounds": stats.get("rounds"), "waited_seconds": waited,
                          "outer_bytes_sent": stats.get("bytes_sent")}),
              flush=True)


if __name__ == "__main__":
    main()
