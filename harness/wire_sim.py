"""bench/wire.py's simulation: one rank's bytes of an exchange at any number of ranks, no
rank run. The planner decides as in a run (each tensor's path at the final density,
PyTorch's buckets, which dense tensors ride in a bucket's allgather); the bytes are the
wire formats' own sizes (hvd_dgc/packing.py, which the encoders write:
tests/core/test_wire_code.py). bench/wire.py checks it against real runs at 2 and 4 ranks.

Modes (a user's defaults, or one option): SGD with DGC at its final density 0.001, and
with ``aggregation="region"`` (region reduce, whatever the cost model says); AdamW
with no option (0/1 Adam: the scaled sign every ``period`` steps once the variance is
frozen); the outer loop (``outer=OuterLoop()``: the change averaged whole every
``steps`` steps). Per step: an exchange's bytes over the steps it covers. Left out: the
warm-up's denser steps, Adam's exact steps before its freeze and its variance
refreshes, the link measurement's few bytes.
"""

from harness.shapes import lm_shapes, numel, resnet50_shapes

#: the simulated modes: (hvd_dgc options, the wrapped optimizer as DGCConfig.resolve
#: takes it)
MODES = {
    "sgd_dgc": ({"density": 0.001, "warmup": 0}, (True, "SGD", False)),
    "sgd_dgc_region": ({"density": 0.001, "warmup": 0, "aggregation": "region"},
                       (True, "SGD", False)),
    "adamw_default": ({}, (False, "AdamW", True)),
    "outer_default": ({"outer": "default"}, (True, "SGD", False)),
}


def tensors_of(model):
    from hvd_dgc.plan import TensorInfo
    shapes = resnet50_shapes() if model == "resnet50" else lm_shapes()
    return [TensorInfo(i, name, numel(shape), tuple(shape))
            for i, (name, shape) in enumerate(shapes)]


def planner_for(mode, tensors, world):
    """The PyTorch optimizer's planner for ``mode`` on ``world`` ranks of one host, the
    cost model's assumed link (1 Gbit/s, 50 us)."""
    from horovod.torch.mpi_ops import Adasum, Average, Sum
    from hvd_dgc.config import DGCConfig
    from hvd_dgc.resolve import HorovodArguments
    from hvd_dgc.costmodel import CostModel
    from hvd_dgc.plan import Planner
    from hvd_dgc.torch.optimizer import TORCH
    options, optimizer = MODES[mode]
    options = {k: v for k, v in options.items() if k != "outer"}
    resolved = DGCConfig(cost_model=CostModel(), **options).resolve(
        TORCH, None, HorovodArguments(Average, 1.0, 1, None, (Average, Sum, Adasum)),
        optimizer)
    return Planner(resolved, tensors, world)


def _dgc(planner, tensors, world):
    """SGD DGC at the final density: ``(sent, received, paths)`` a step."""
    from hvd_dgc.aggregation import dense_bytes
    from hvd_dgc.packing import REGION_COUNT_BYTES, SCALE_BYTES, folds_values, \
        gather_value_bits, index_bytes, region_value_bits
    from hvd_dgc.paths import PathKind
    from hvd_dgc.fusion import fusion_threshold
    from hvd_dgc.torch.memory import aligned_size
    density = planner.resolved.final_density()
    path = {t.key: planner.path(t, density) for t in tensors}
    order = list(reversed(tensors))
    buckets = planner.buckets(density, order, fusion_threshold(planner.config.fusion_threshold))
    launches = list(dict.fromkeys(buckets.values())) + [
        (t.key,) for t in order if t.key not in buckets]
    by_key = {t.key: t for t in tensors}
    bits = gather_value_bits(planner.compressor)
    value = bits / 8
    scale = SCALE_BYTES if bits == 8 else 0
    dense_value = planner.prices.dense_value_bytes
    sent = received = 0.0
    paths = {}
    for launch in launches:
        members = [by_key[k] for k in launch]
        gathered = [t for t in members if path[t.key] == PathKind.ALLGATHER]
        dense = [t for t in members if path[t.key] == PathKind.DENSE]
        folded = bool(gathered and dense) and planner.prices.folds(sum(t.numel for t in dense)) \
            and folds_values(bits, planner.resolved.dense_fp16)
        block = 0.0
        if gathered:
            ks = [planner.k(t, density) for t in gathered]
            block += index_bytes(sum(aligned_size(t.numel) for t in gathered), sum(ks)) + \
                sum(ks) * value + scale * len(gathered)
        if folded:
            block += sum(t.numel for t in dense) * value + scale * len(dense)
        sent += block
        received += (world - 1) * block
        for t in members:
            kind = path[t.key].value
            paths[kind] = paths.get(kind, 0) + 1
            if t in dense and not folded:
                ring = dense_bytes(t.numel, world, dense_value)
                sent, received = sent + ring, received + ring
            elif path[t.key] == PathKind.REGION:
                region = planner.prices.wire_bytes(t.numel, planner.k(t, density),
                                                   PathKind.REGION)
                sent, received = sent + region, received + region
    if paths.get(PathKind.REGION.value):  # one launch a step (batched): its blocks'
        # heads, a count (and, 8-bit values, a scale) from and to each other rank, both
        # rounds
        heads = 2 * (world - 1) * (REGION_COUNT_BYTES + (
            SCALE_BYTES if region_value_bits(planner.compressor) == 8 else 0))
        sent, received = sent + heads, received + heads
    return sent, received, paths


def _adam(planner, tensors, world):
    """AdamW's default once its variance is frozen: each tensor's path (the sign's
    allgather, from 3 ranks its compressed allreduce, or dense), an exchange every
    ``period`` steps. The compressed allreduce carries a step's tensors together (one
    launch: hvd_dgc/torch/scheduler.py), its scales and padding once."""
    from hvd_dgc.aggregation import dense_bytes
    from hvd_dgc.packing import exchange_bytes, reduces_signs, sign_reduce_bytes
    from hvd_dgc.paths import PathKind
    from hvd_dgc.predict import NEVER
    period = planner.config.period
    sent = received = 0.0
    paths, signs = {}, []
    together = reduces_signs(planner.compressor, world)
    for t in tensors:
        path = planner.path(t, 1.0, NEVER)
        paths[path.value] = paths.get(path.value, 0) + 1
        if path == PathKind.EXCHANGE and together:
            signs.append(t.numel)
        elif path == PathKind.EXCHANGE:
            out, got = exchange_bytes(planner.compressor, t.numel, world)
            sent, received = sent + out, received + got
        else:
            ring = dense_bytes(t.numel, world, planner.prices.dense_value_bytes)
            sent, received = sent + ring, received + ring
    if signs:
        out, got = sign_reduce_bytes(tuple(signs), world)
        sent, received = sent + out, received + got
    return sent / period, received / period, paths


def step_bytes(model, mode, world):
    """``{"sent", "received", "dense_received", "paths"}``: one rank's bytes a step (see
    the module's docstring) and a dense fp32 ring allreduce's."""
    from hvd_dgc.aggregation import dense_bytes
    from hvd_dgc.outer import OuterLoop
    tensors = tensors_of(model)
    total = sum(t.numel for t in tensors)
    dense = dense_bytes(total, world, 4)
    if mode == "outer_default":  # the change whole, in Horovod's allreduce
        steps = OuterLoop().steps
        return {"sent": dense / steps, "received": dense / steps, "dense_received": dense,
                "paths": {"dense": len(tensors)}}
    planner = planner_for(mode, tensors, world)
    sent, received, paths = (_adam if mode == "adamw_default" else _dgc)(
        planner, tensors, world)
    return {"sent": sent, "received": received, "dense_received": dense, "paths": paths}
