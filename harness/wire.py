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
    "adamw_default": {"adamw": True},                # AdamW, no option: 0/1 Adam
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


def _optimizer(hvd, mode, named, density):
    """The optimizer a user of ``mode`` wraps: SGD with DGC at ``density`` from the first
    step, or AdamW with no option at all (0/1 Adam)."""
    params = [p for _, p in named]
    if MODES[mode].get("adamw"):
        return hvd.DistributedOptimizer(torch.optim.AdamW(params, lr=1e-3),
                                        named_parameters=named, cost_model=hvd.CostModel())
    fp16, bits = MODES[mode].get("fp16", False), MODES[mode].get("value_bits")
    return hvd.DistributedOptimizer(
        torch.optim.SGD(params, lr=0.1, momentum=0.9), named_parameters=named,
        density=density, warmup=0, cost_model=hvd.CostModel(),
        compression=hvd.Compression.fp16 if fp16 else hvd.Compression.dgc(value_bits=bits)
        if bits else hvd.Compression.none)


def _step(opt, named, gen):
    for _, p in named:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()


def _measured_step(hvd, opt, named, gen):
    """One step on random gradients: its ``last_step`` statistics and what crossed this
    host's link (None but on the first rank of an emulated host)."""
    from harness.wan import device_counters
    _barrier(hvd, "wire.before")
    before = device_counters()
    _step(opt, named, gen)
    _barrier(hvd, "wire.after")
    after = device_counters()
    _barrier(hvd, "wire.again")
    again = device_counters()
    link = None
    if hvd.local_rank() == 0 and before and after and again:
        link = {k: (after[k] - before[k]) - (again[k] - after[k]) for k in before}
        link["barrier"] = {k: again[k] - after[k] for k in before}
    return opt.compression_stats()["last_step"], link


def _received(last, world):
    """What a rank receives for the step ``last`` describes, priced by each tensor's path
    (region reduce's as hvd_dgc counted it arriving: it depends on where the others'
    records fall); whether every dense tensor rode the allgather (folded)."""
    from hvd_dgc.aggregation import allgather_bytes, dense_bytes
    from hvd_dgc.packing import sign_reduce_bytes
    received, paths, folded, signs = 0.0, {}, True, []
    for t in last["tensors"].values():
        paths[t["path"]] = paths.get(t["path"], 0) + 1
        whole = t["bytes"] in (2 * t["numel"], 4 * t["numel"])  # (else in 8 bits: folded)
        folded &= t["path"] != "dense" or not whole
        if t["path"] == "dense" and whole:  # the ring's
            received += dense_bytes(t["numel"], world, t["bytes"] / t["numel"])
        elif t["path"] in ("dense", "sparse") or t["path"] == "sign" and world == 2:
            received += allgather_bytes(1, world, t["bytes"])  # every rank's, the same size
        elif t["path"] == "sign":  # from 3 ranks: the sign's compressed allreduce
            signs.append(t["numel"])
        elif t["path"] == "region":
            received += t["received"]
        else:
            raise ValueError(f"bench/wire.py does not price the {t['path']} path")
    if signs:
        received += sign_reduce_bytes(tuple(signs), world)[1]
    return received, paths, folded


def step_bytes(model, mode, steps=6, density=0.001):
    """This rank's bytes a step, as hvd_dgc counts them: SGD's last step (DGC at
    ``density`` from the first step, the cost model's assumed 1 Gbit/s link); AdamW's
    second exchange after its freeze (its variance frozen after DEFAULT_FREEZE exact
    steps, an exchange every ``period`` steps from there) over the steps it covers.
    Sent, received (priced by each tensor's path), dense fp32's, by path; on emulated
    hosts (harness/hosts.py) also what crossed this host's link in that step
    (``link``, not divided by the period; from the first rank of each host; harness/wan.py
    ``device_counters``): the counters' change from a barrier before the step to one
    after it, less their change over one more barrier (``link["barrier"]``: what a
    barrier and Horovod's idle cycles send)."""
    import hvd_dgc.torch as hvd
    from hvd_dgc.adam import DEFAULT_FREEZE
    from hvd_dgc.aggregation import dense_bytes

    hvd.init()
    world = hvd.size()
    named = [(name, torch.nn.Parameter(torch.zeros(shape))) for name, shape in shapes_of(model)]
    opt = _optimizer(hvd, mode, named, density)
    adamw = MODES[mode].get("adamw", False)
    gen = torch.Generator().manual_seed(hvd.rank())
    period = 1
    if adamw:  # the exact steps, then two periods, the last step an exchange (the first
        # refresh comes later)
        from harness.wire_sim import planner_for, tensors_of
        period = planner_for(mode, tensors_of(model), world).config.period
        steps = DEFAULT_FREEZE + 2 * period
    for _ in range(steps - 1):
        _step(opt, named, gen)
    last, link = _measured_step(hvd, opt, named, gen)
    received, paths, folded = _received(last, world)
    dense = sum(4 * p.numel() for _, p in named)
    return {"sent": last["bytes_sent"] / period, "received": received / period,
            "paths": paths, "link": link, "folded": folded, "period": period, "world": world,
            "dense_sent": dense, "dense_received": dense_bytes(dense // 4, world, 4)}


def tf_step_bytes(model, steps=3, density=0.001):
    """``step_bytes``'s SGD measure through TensorFlow's tape (DGC at ``density`` from the
    first step, the cost model's assumed link, 8-bit values): this rank's bytes sent in
    the last of ``steps`` steps inside a ``tf.function``, as hvd_dgc counts them, by path,
    and dense fp32's."""
    import numpy as np
    import tensorflow as tf
    import hvd_dgc.tensorflow as hvd

    hvd.init()
    shapes = shapes_of(model)
    variables = [tf.Variable(tf.zeros(shape), name=f"w{i}") for i, (_, shape) in
                 enumerate(shapes)]

    @tf.function
    def step(grads):
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * g) for v, g in zip(variables, grads)])
        tape = hvd.DistributedGradientTape(tape, density=density, warmup=0,
                                           cost_model=hvd.CostModel())
        for v, g in zip(variables, tape.gradient(loss, variables)):
            v.assign_sub(0.1 * g)

    rng = np.random.default_rng(hvd.rank())
    sent = []
    for _ in range(steps):
        step([tf.constant(rng.standard_normal(s, dtype=np.float32)) for _, s in shapes])
        stats = hvd.compression_stats()
        sent.append((stats[-1] if isinstance(stats, list) else stats)["bytes_sent"])
    stats = stats[-1] if isinstance(stats, list) else stats
    return {"sent": sent[-1] - sent[-2], "world": hvd.size(),
            "paths": {path: n // steps for path, n in stats["paths"].items()},
            "dense_sent": sum(4 * int(np.prod(s)) for _, s in shapes)}
