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


def shapes_of(model):
    return resnet50_shapes() if model == "resnet50" else lm_shapes()


def step_bytes(model, mode, steps=6, density=0.001):
    """This rank's bytes on its last step (DGC at ``density`` from the first step, the
    cost model's assumed 1 Gbit/s link): sent, received, dense fp32's, by path."""
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
    for _ in range(steps):
        for _, p in named:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    last = opt.compression_stats()["last_step"]
    received, paths = 0.0, {}
    for t in last["tensors"].values():
        paths[t["path"]] = paths.get(t["path"], 0) + 1
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
    return {"sent": last["bytes_sent"], "received": received, "paths": paths,
            "dense_sent": dense, "dense_received": dense_bytes(dense // 4, world, 4)}
