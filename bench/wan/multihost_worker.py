"""One rank of the multi-host throughput benchmark (bench/multihost_throughput.py).

Launched by Horovod's own horovodrun across emulated hosts (harness/hosts.py),
2 hosts x 2 ranks. The same training for every method; each rank prints one line

    MHRESULT {"rank": .., "seconds": .., "wan_tx_bytes": .., ...}

and writes the same JSON to SYNC_DIR/rank<R>.json (horovodrun prefixes and may
interleave the ranks' lines; the file is the fallback).

Workloads (synthetic data, momentum SGD, one CPU thread per rank):
    mlp   the MLP of bench/wan/train_worker.py / bench/wan_throughput.py
          (1024-2048-2048-10, 6.3M parameters, batch 128): the communication
          stress case, a large gradient for little compute
    cnn   a ResNet-18 for 32x32 inputs (CIFAR layout: 3x3 stem, no max-pool,
          BasicBlock [2, 2, 2, 2], widths 64-512, 11.2M parameters), batch 16

Methods:
    local        no Horovod at all, plain torch SGD: the no-communication rate of
                 the same ranks placed on the same hosts
    dense        horovod.torch.DistributedOptimizer (fp32 allreduce)
    dense_hier   the same; the launcher sets HOROVOD_HIERARCHICAL_ALLREDUCE=1
    dgc_flat     hvd_dgc, DGC at --density, aggregation="flat"
    dgc_hier     hvd_dgc, DGC at --density, aggregation="hierarchical"
    dgc_hier_dga hvd_dgc, aggregation="hierarchical", delay=--delay (flush at the end,
                 timed apart)
    dgc          hvd_dgc at --density and nothing else: the import switched, each tensor's
                 way (dense, flat or hierarchical) chosen by the cost model on the link
                 it measured

Timing: --warmup-steps untimed steps (the dgc method: at least hvd_dgc's
overlap.DECIDED_BY_STEP), then a barrier through files in SYNC_DIR
(no network, so the no-communication ranks start together too), then --steps
timed steps. The first rank of each host reads its host's wan0 counters
(/proc/net/dev in the host's network namespace: every byte that crosses the
emulated link, IP headers and Horovod's control traffic included) at the start
barrier and at a second file barrier after the timed steps. Then (Horovod
methods, after DGA's flush) every rank sleeps --idle-seconds: the link's bytes
and the rank's CPU time in that window are Horovod's idle background loop.

No broadcast_parameters: every rank builds the model after torch.manual_seed(0),
so the weights start identical without a broadcast across the slow link.
"""

import argparse
import json
import os
import resource
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from harness.wan import device_counters  # (bench/multihost_throughput.py: repo on PYTHONPATH)

METHODS = ["local", "dense", "dense_hier", "dgc_flat", "dgc_hier", "dgc_hier_dga", "dgc"]


# -- models ------------------------------------------------------------------------
def mlp(width=2048):
    return nn.Sequential(nn.Linear(1024, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 10))


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 for 32x32 inputs (He et al. 2016, CIFAR layout): 11,173,962 parameters."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        layers, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x):
        out = self.layers(F.relu(self.bn1(self.conv1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1))


def build(workload, batch, width, seed):
    gen = torch.Generator().manual_seed(seed)
    if workload == "mlp":
        model = mlp(width)
        x = torch.randn(batch, 1024, generator=gen)
    else:
        model = ResNet18()
        x = torch.randn(batch, 3, 32, 32, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)
    return model, x, y


# -- measurement helpers -------------------------------------------------------------
def wan0_bytes():
    """(tx, rx) bytes of this network namespace's wan0, or (None, None)."""
    counters = device_counters()
    return (counters["tx_bytes"], counters["rx_bytes"]) if counters else (None, None)


def tcp_retransmits():
    """TCP segments retransmitted in this network namespace so far (/proc/net/snmp), or None."""
    try:
        with open("/proc/net/snmp") as f:
            tcp = [line.split() for line in f if line.startswith("Tcp:")]
        return int(tcp[1][tcp[0].index("RetransSegs")])
    except (OSError, ValueError, IndexError):
        return None


def file_barrier(sync_dir, tag, rank, size, timeout=600.0):
    """Every rank has reached ``tag``: one file each in a directory all hosts share
    (the emulated hosts are namespaces of one machine). No network traffic."""
    open(os.path.join(sync_dir, f"{tag}.{rank}"), "w").close()
    deadline = time.monotonic() + timeout
    while True:
        if all(os.path.exists(os.path.join(sync_dir, f"{tag}.{r}")) for r in range(size)):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: barrier {tag!r} not reached by all {size} ranks "
                               f"in {timeout:g} s")
        time.sleep(0.002)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", required=True, choices=["mlp", "cnn"])
    ap.add_argument("--method", required=True, choices=METHODS)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup-steps", type=int, default=2)
    ap.add_argument("--batch", type=int, default=None, help="default: 128 (mlp), 16 (cnn)")
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--density", type=float, default=0.001)
    ap.add_argument("--delay", type=int, default=2)
    ap.add_argument("--sync-dir", required=True)
    ap.add_argument("--idle-seconds", type=float, default=1.0,
                    help="after the timed steps: seconds of sleep to measure Horovod's idle "
                         "traffic on the link (0: skip)")
    args = ap.parse_args()
    batch = args.batch or (128 if args.workload == "mlp" else 16)
    torch.set_num_threads(1)
    torch.manual_seed(0)

    if args.method == "local":
        env = os.environ
        rank, size = int(env.get("HOROVOD_RANK", 0)), int(env.get("HOROVOD_SIZE", 1))
        local_rank = int(env.get("HOROVOD_LOCAL_RANK", 0))
        local_size = int(env.get("HOROVOD_LOCAL_SIZE", 1))
        cross_rank = int(env.get("HOROVOD_CROSS_RANK", 0))
        hvd = None
    else:
        if args.method.startswith("dense"):
            import horovod.torch as hvd
        else:
            import hvd_dgc.torch as hvd
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        local_rank, local_size, cross_rank = hvd.local_rank(), hvd.local_size(), hvd.cross_rank()

    model, x, y = build(args.workload, batch, args.width, seed=rank)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if hvd is not None:
        # No broadcast_parameters: every rank built the model after manual_seed(0), so the
        # weights are identical already (a broadcast would cost seconds on the slow link
        # per launch, outside the timed steps but inside the benchmark's wall time).
        if args.method.startswith("dense"):
            opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                           compression=hvd.Compression.none)
        else:
            options = {}
            if args.method != "dgc":
                options["aggregation"] = "flat" if args.method == "dgc_flat" else "hierarchical"
            if args.method == "dgc_hier_dga":
                options["delay"] = args.delay
            # density given, no warm-up: the steady state of DGC at that density
            opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                           density=args.density, **options)
    dgc = hasattr(opt, "compression_stats")

    def step():
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    # the import switched: the timed steps run on the paths a long job runs on, after
    # hvd_dgc's profile of the backward pass and its trial of two plans (overlap.py)
    warmup = args.warmup_steps
    if args.method == "dgc":
        from hvd_dgc.overlap import DECIDED_BY_STEP
        warmup = max(warmup, DECIDED_BY_STEP)
    for _ in range(warmup):
        step()
    stats0 = opt.compression_stats() if dgc else None
    file_barrier(args.sync_dir, "start", rank, size)
    tx0, rx0 = wan0_bytes()
    re0 = tcp_retransmits()
    cpu0 = time.process_time()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu0
    file_barrier(args.sync_dir, "end", rank, size)
    tx1, rx1 = wan0_bytes()
    re1 = tcp_retransmits()
    stats1 = opt.compression_stats() if dgc else None
    flush = 0.0
    if args.method == "dgc_hier_dga":  # once per epoch/evaluation, not per step: timed apart
        t = time.perf_counter()
        opt.flush()
        flush = time.perf_counter() - t
    idle_tx = idle_cpu = None
    if hvd is not None and args.idle_seconds > 0:
        # Horovod's background loop negotiates with the other ranks every cycle, tensors
        # or not: what crosses the link while every rank sleeps (upper bound of that
        # chatter, whose rate falls when the ranks compute)
        file_barrier(args.sync_dir, "idle", rank, size)
        a, _ = wan0_bytes()
        c = time.process_time()
        time.sleep(args.idle_seconds)
        idle_cpu = (time.process_time() - c) / args.idle_seconds  # Horovod's threads only
        b, _ = wan0_bytes()
        if a is not None:
            idle_tx = (b - a) / args.idle_seconds
    report = {
        "rank": rank, "size": size, "local_rank": local_rank, "local_size": local_size,
        "cross_rank": cross_rank, "workload": args.workload, "method": args.method,
        "batch": batch, "params": params, "steps": args.steps, "seconds": elapsed,
        "cpu_seconds": cpu, "loss": float(loss.detach()), "flush_seconds": flush,
        "hierarchical_allreduce_env": os.environ.get("HOROVOD_HIERARCHICAL_ALLREDUCE"),
        "idle_cpu_per_s": idle_cpu,
        "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    if local_rank == 0 and tx0 is not None:
        report.update(wan_tx_bytes=tx1 - tx0, wan_rx_bytes=rx1 - rx0,
                      idle_tx_bytes_per_s=idle_tx,
                      tcp_retrans_segs=None if re0 is None else re1 - re0)
    if dgc:
        report.update(dgc_bytes_sent=stats1["bytes_sent"] - stats0["bytes_sent"],
                      dgc_steps=stats1["steps"] - stats0["steps"],
                      dgc_paths=stats1["paths"], dgc_density=stats1["density"])
        # the last timed step, by path: records of compressed tensors vs dense small ones
        last = stats1["last_step"]["tensors"].values()
        report.update(last_sparse_bytes=sum(t["bytes"] for t in last if t["path"] != "dense"),
                      last_dense_numel=sum(t["numel"] for t in last if t["path"] == "dense"))
    line = json.dumps(report)
    with open(os.path.join(args.sync_dir, f"rank{rank}.json"), "w") as f:
        f.write(line)
    print("MHRESULT " + line, flush=True)
    if hvd is not None:
        hvd.shutdown()


if __name__ == "__main__":
    sys.exit(main())
