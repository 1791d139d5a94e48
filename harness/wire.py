"""bench/wire.py's worker: one rank's bytes of a step, as hvd_dgc counts them, on a model's
parameter shapes with synthetic gradients (the wire's size depends on the shapes, the
density and the plan, not on the values)."""

import torch

from harness.shapes import lm_shapes, resnet50_shapes

#: bench/wire.py's modes: the options a user passes (all else default)
MODES = {
    "sgd_dgc": {},                                   # DGC, its defaults: 8-bit values
    "sgd_dgc_fp16": {"value_bits": 16},              # Compression.dgc(value_bits=16)
    "sgd_dgc_fp32": {"value_bits": 32},              # Compression.dgc(value_bits=32)
    "sgd_dgc_horovod_fp16": {"fp16": True},          # compression=hvd.Compression.fp16
}


#: Horovod's background loop negotiates every cycle, busy or idle (HOROVOD_CYCLE_TIME, 1 ms
#: by default here): fewer cycles, less of its traffic between the link counters' readings
QUIET = {"HOROVOD_CYCLE_TIME": "100"}


def payload(counters):
    """TCP payload sent and received: IP bytes less 52 a packet (IPv4 and TCP headers with
    timestamps)."""
    return (counters["tx_bytes"] - 52 * counters["tx_packets"],
            counters["rx_bytes"] - 52 * counters["rx_packets"])


def shapes_of(model):
    return resnet50_shapes() if model == "resnet50" else lm_shapes()


def _barrier(hvd, name):
    hvd.allreduce(torch.zeros(1), name=name)


def step_bytes(model, mode, steps=6, density=0.001):
    """This rank's bytes on its last step (DGC at ``density`` from the first step, the
    cost model's assumed 1 Gbit/s link): sent, received, dense fp32's, by path; on
    emulated hosts (harness/hosts.py) also what crossed this host's link in that step
    (``link``, from the first rank of each host; harness/wan.py ``device_counters``): the
    counters' change from a barrier before the step to one after it, less their change
    over one more barrier (``link["barrier"]``: what a barrier and Horovod's idle cycles
    send)."""
    from harness.wan import device_counters
    import hvd_dgc.torch as hvd
    from hvd_dgc.aggregation import allgather_bytes, dense_bytes, region_bytes
    from hvd_dgc.schedule import num_selected

    hvd.init()
    world = hvd.size()
    fp16 = MODES[mode].get("fp16", False)
    bits = MODES[mode].get("value_bits")
    named = [(name, torch.nn.Parameter(torch.zeros(shape))) for name, shape in shapes_of(model)]
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD([p for _, p in named], lr=0.1, momentum=0.9), named_parameters=named,
        density=density, warmup=0, cost_model=hvd.CostModel(),
        compression=hvd.Compression.fp16 if fp16 else hvd.Compression.dgc(value_bits=bits)
        if bits else hvd.Compression.none)
    gen = torch.Generator().manual_seed(hvd.rank())
    counters = []
    for step in range(steps):
        for _, p in named:
            p.grad = torch.randn(p.shape, generator=gen)
        if step == steps - 1:
            _barrier(hvd, "wire.before")
            counters.append(device_counters())
        opt.step()
    for name in ("wire.after", "wire.again"):
        _barrier(hvd, name)
        counters.append(device_counters())
    link = None
    if hvd.local_rank() == 0 and all(counters):
        before, after, again = counters
        link = {k: (after[k] - before[k]) - (again[k] - after[k]) for k in before}
        link["barrier"] = {k: again[k] - after[k] for k in before}
    last = opt.compression_stats()["last_step"]
    received, paths, folded = 0.0, {}, True
    for t in last["tensors"].values():
        paths[t["path"]] = paths.get(t["path"], 0) + 1
        folded &= t["path"] != "dense" or t["bytes"] not in (2 * t["numel"], 4 * t["numel"])
        if t["path"] == "dense" and t["bytes"] not in (2 * t["numel"], 4 * t["numel"]):
            received += allgather_bytes(1, world, t["bytes"])  # in 8 bits: folded
        elif t["path"] == "dense":  # (folded or not: priced as the ring's)
            received += dense_bytes(t["numel"], world, t["bytes"] / t["numel"])
        elif t["path"] == "sparse":  # every rank's bytes, the same size
            received += allgather_bytes(1, world, t["bytes"])
        elif t["path"] == "region":
            received += region_bytes(num_selected(t["numel"], density), world, 8 - 2 * fp16)
        else:
            raise ValueError(f"bench/wire.py does not price the {t['path']} path")
    dense = sum(4 * p.numel() for _, p in named)
    return {"sent": last["bytes_sent"], "received": received, "paths": paths, "link": link,
            "folded": folded,
            "dense_sent": dense, "dense_received": dense_bytes(dense // 4, world, 4)}
