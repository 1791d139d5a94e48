"""Delayed gradient averaging vs synchronous DGC under network latency (issue 4).

    python bench/dga_latency.py [--rtt-ms 0 100 200] [--delays 0 4] [--compute-ms 200]

Runs 2 ranks under ``horovodrun --gloo`` on this machine (1 thread each) and
prints steps/second for each (round trip, delay), side by side in one run.

HOW LATENCY IS MADE (read this before quoting a number): the collectives run
for real over Horovod/Gloo on loopback, and this benchmark adds the latency
on top: every collective hvd_dgc launches is treated as complete no earlier
than one round trip after its launch (for 2 ranks a ring allreduce and an
allgather both cost about one round trip of messages). Waiting for a handle
sleeps until then, so the sleep overlaps whatever compute ran since the
launch, exactly as a slow link would. No packet is delayed; for that, use the
WAN emulator (harness/wan.py) with the throughput benchmark.

The model is an MLP whose forward+backward is calibrated to ``--compute-ms``
on this machine, so at 200 ms the compute per step is about the round trip:
synchronous training waits one round trip per step, DGA with delay D >= 1
hides it once D * compute exceeds the round trip.
"""

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class LatencyInjector:
    """While entered, horovod.torch's asynchronous collectives complete no earlier than one
    round trip after their launch, whichever module launches them (hvd_dgc's paths,
    region reduce, delayed averaging and the seam all call ``horovod.torch``'s functions
    through the module): waiting on a handle sleeps until then, and ``poll`` says not
    ready before."""

    LAUNCHES = ("allreduce_async", "allreduce_async_", "grouped_allreduce_async",
                "grouped_allreduce_async_", "allgather_async", "grouped_allgather_async",
                "alltoall_async", "broadcast_async", "broadcast_async_")

    def __init__(self, rtt_s):
        self._rtt, self._ready, self._saved = rtt_s, {}, {}

    def __enter__(self):
        import horovod.torch as hvd
        self._saved = {name: getattr(hvd, name) for name in
                       self.LAUNCHES + ("synchronize", "poll") if hasattr(hvd, name)}
        for name in self.LAUNCHES:
            if name in self._saved:
                setattr(hvd, name, self._delayed(self._saved[name]))
        hvd.synchronize, hvd.poll = self._synchronize, self._poll
        return self

    def __exit__(self, *exc):
        import horovod.torch as hvd
        for name, real in self._saved.items():
            setattr(hvd, name, real)

    def _delayed(self, launch):
        def wrapper(*args, **kwargs):
            handle = launch(*args, **kwargs)
            self._ready[handle] = time.perf_counter() + self._rtt
            return handle
        return wrapper

    def _synchronize(self, handle):
        out = self._saved["synchronize"](handle)
        ready = self._ready.pop(handle, None)
        if ready is not None:
            time.sleep(max(0.0, ready - time.perf_counter()))
        return out

    def _poll(self, handle):
        return time.perf_counter() >= self._ready.get(handle, 0.0) and \
            self._saved["poll"](handle)


def _model(width, depth, seed=0):
    import torch.nn as nn
    import torch
    torch.manual_seed(seed)
    layers = [nn.Linear(256, width), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def _calibrate(model, compute_ms):
    """Batch size whose forward+backward takes about ``compute_ms`` here."""
    import torch
    batch = 16
    while True:
        x, y = torch.randn(batch, 256), torch.randint(0, 10, (batch,))
        times = []
        for _ in range(3):
            t = time.perf_counter()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            times.append(time.perf_counter() - t)
        ms = 1000 * min(times)
        if ms >= compute_ms or batch >= 8192:
            return max(1, int(batch * compute_ms / ms))
        batch *= 2


def worker(args):
    import torch
    torch.set_num_threads(1)
    import hvd_dgc.torch as hvd
    hvd.init()
    model = _model(args.width, args.depth)
    batch = int(hvd.broadcast(torch.tensor([_calibrate(model, args.compute_ms)]), 0,
                              name="calibrated.batch").item())
    x, y = torch.randn(batch, 256), torch.randint(0, 10, (batch,))
    # compute alone: the no-communication rate
    t = time.perf_counter()
    for _ in range(args.steps):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
    compute_s = (time.perf_counter() - t) / args.steps
    rows = []
    for rtt_ms in args.rtt_ms:
        with LatencyInjector(rtt_ms / 1000.0):
            for delay in args.delays:
                model = _model(args.width, args.depth)
                opt = hvd.DistributedOptimizer(
                    torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                    named_parameters=model.named_parameters(), density=args.density,
                    delay=delay)
                for step in range(args.warmup + args.steps):
                    if step == args.warmup:
                        hvd.allreduce(torch.zeros(1), name="bench.barrier")
                        t = time.perf_counter()
                    opt.zero_grad()
                    torch.nn.functional.cross_entropy(model(x), y).backward()
                    opt.step()
                opt.flush()
                elapsed = time.perf_counter() - t
                rows.append({"rtt_ms": rtt_ms, "delay": delay,
                             "steps_per_s": args.steps / elapsed,
                             "density": opt.compression_stats()["density"]})
    if hvd.rank() == 0:
        params = sum(p.numel() for p in model.parameters())
        print("RESULT " + json.dumps({"rows": rows, "compute_ms": 1000 * compute_s,
                                      "batch": batch, "params": params}), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rtt-ms", type=float, nargs="+", default=[0, 100, 200])
    ap.add_argument("--delays", type=int, nargs="+", default=[0, 4])
    ap.add_argument("--compute-ms", type=float, default=200)
    ap.add_argument("--density", type=float, default=0.001)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    cmd = [horovodrun, "-np", str(args.np), "-H", f"localhost:{args.np}", "--gloo",
           sys.executable, os.path.abspath(__file__), "--worker"] + sys.argv[1:]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    lines = [l for l in proc.stdout.splitlines() if "RESULT " in l]
    if proc.returncode != 0 or not lines:
        sys.exit(f"horovodrun failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                 f"{proc.stderr[-4000:]}")
    res = json.loads(lines[-1].split("RESULT ", 1)[1])
    print(f"{args.np} ranks x 1 thread, MLP {res['params'] / 1e6:.1f}M params, batch "
          f"{res['batch']}, compute {res['compute_ms']:.0f} ms/step (no communication: "
          f"{1000 / res['compute_ms']:.2f} steps/s); DGC density {args.density}.")
    print("Latency is injected (one round trip per collective, see the module doc); "
          "collectives are real.")
    print("With compute C and round trip R per step the best delay can do is (C+R)/C: "
          "2x needs C <= R.\n")
    by = {(r["rtt_ms"], r["delay"]): r["steps_per_s"] for r in res["rows"]}
    head = "| RTT (ms) | " + " | ".join(f"delay={d} steps/s" for d in args.delays)
    if 0 in args.delays:
        head += " | " + " | ".join(f"delay={d} / delay=0 | RTT hidden by delay={d}"
                                   for d in args.delays if d)
    print(head + " |")
    print("|" + "---|" * (head.count("|")))
    for rtt in args.rtt_ms:
        cells = [f"{by[(rtt, d)]:.2f}" for d in args.delays]
        if 0 in args.delays:
            for d in (d for d in args.delays if d):
                saved_s = 1 / by[(rtt, 0)] - 1 / by[(rtt, d)]  # per step
                hidden = f"{100 * saved_s / (rtt / 1000):.0f}%" if rtt else "-"
                cells += [f"{by[(rtt, d)] / by[(rtt, 0)]:.2f}x", hidden]
        print(f"| {rtt:g} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
