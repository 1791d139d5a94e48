"""Hierarchical DGC in TensorFlow (hvd_dgc/tensorflow/paths.py HierarchicalPath) on real
Horovod ranks that Horovod places on two hosts (``-H localhost:L,127.0.0.1:L --gloo``),
as tests/torch/torch_hierarchical.py does for PyTorch: density 1 == flat == Horovod's
tape and Keras optimizer, bit-identical ranks at 0.1%, a host's records across hosts,
error feedback's conservation with slice-owned residuals, a skipped step, delayed
averaging over it, the cost model's choice, and what is refused."""

import numpy as np

from hvd_dgc.aggregation import slices
from tests.tensorflow.tf_aggregation import _exchange, _grads, nan_at_step_2
from tests.tensorflow.tf_dgc import _batch, _flat, _identical, _loss, _sgd_momentum_step, _tf, \
    _vars, keras_against_horovod
from tests.tensorflow.tf_sparse import _error_of


def topology():
    import hvd_dgc.tensorflow as hvd
    return {"rank": hvd.rank(), "local_size": hvd.local_size(),
            "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size()}


def density_one(steps=8):
    """density 1, every tensor forced hierarchical / flat allgather: the tape == Horovod's
    tape (SGD momentum applied by the test), and Keras 2's SGD with momentum (taken over
    by the memory) == Horovod's Keras optimizer. Ranks bit-identical after every step."""
    tf = _tf()
    import horovod.tensorflow as hvd_stock
    import hvd_dgc.tensorflow as hvd
    rank, out = hvd.rank(), {}
    runs = {"reference": lambda t: hvd_stock.DistributedGradientTape(t)}
    for method in ("hierarchical", "allgather"):
        runs[method] = (lambda t, m=method: hvd.DistributedGradientTape(
            t, density=1.0, aggregation=m, min_compress_size=0))
    params, identical, stats = {}, [], None
    for name, wrap in runs.items():
        variables = _vars(tf, seed=1)
        buffers = [tf.Variable(tf.zeros_like(v)) for v in variables]
        for step in range(steps):
            x, y = _batch(step, rank)
            with tf.GradientTape() as tape:
                loss = _loss(tf, variables, x, y)
            _sgd_momentum_step(tf, variables, wrap(tape).gradient(loss, variables), buffers)
            if name == "hierarchical":
                identical.append(_identical(tf, hvd, variables, f"d1.{step}"))
        params[name] = _flat(tf, variables).numpy()
        if name == "hierarchical":
            stats = hvd.compression_stats()
            stats = stats[-1] if isinstance(stats, list) else stats
    out["tape"] = {
        "hierarchical_vs_dense": float(np.abs(params["hierarchical"]
                                              - params["reference"]).max()),
        "hierarchical_vs_flat": float(np.abs(params["hierarchical"]
                                             - params["allgather"]).max()),
        "moved": float(np.abs(params["reference"] - _flat(tf, _vars(tf, seed=1)).numpy()).max()),
        "identical": identical, "paths": stats["paths"]}
    out["keras"] = _keras_density_one(tf, steps)
    return out


def _keras_density_one(tf, steps):
    """Keras 2 (tf_keras) SGD momentum 0.9: hvd_dgc's optimizer, hierarchical at density
    1 (its memory holds the host's momentum) against Horovod's."""
    import hvd_dgc.tensorflow.keras as hvd
    identical = []
    ref, ours, opt = keras_against_horovod(
        tf, lambda o: hvd.DistributedOptimizer(o, density=1.0, aggregation="hierarchical",
                                               min_compress_size=0), steps, "kref",
        each_step=lambda variables, step: identical.append(
            _identical(tf, hvd, variables, f"kd1.{step}")))
    return {"max_diff": float(tf.reduce_max(tf.abs(ref - ours))), "identical": identical,
            "paths": opt.compression_stats()["paths"]}


def sparse_steps(steps=10, density=0.001):
    """density 0.1% (warm-up off), every tensor sparse, a tape in a tf.function: ranks
    bit-identical after every step; the records this rank sent in the last step,
    hierarchical vs flat allgather of the same model, summed over each host's ranks
    (what crosses between hosts; records, as PyTorch's test counts them: the
    allgather's are coded, hierarchical DGC's int32 pairs)."""
    tf = _tf()
    import hvd_dgc.tensorflow as hvd
    from hvd_dgc.tensorflow.tape_exchanges import EXCHANGES
    rank, out = hvd.rank(), {}
    for method in ("hierarchical", "allgather"):
        variables = _vars(tf, seed=3, width=256)
        buffers = [tf.Variable(tf.zeros_like(v)) for v in variables]

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = _loss(tf, variables, x, y)
            tape = hvd.DistributedGradientTape(tape, density=density, warmup=0,
                                               aggregation=method, min_compress_size=0)
            _sgd_momentum_step(tf, variables, tape.gradient(loss, variables), buffers)
        identical, sent = [], [0]
        for s in range(steps):
            x, y = _batch(s, rank)
            step(tf.constant(x), tf.constant(y))
            identical.append(_identical(tf, hvd, variables, f"sp.{method}.{s}"))
            stats = hvd.compression_stats()
            stats = stats[-1] if isinstance(stats, list) else stats
            # the records it sent so far (the newest exchange is this method's)
            sent.append(list(EXCHANGES.values())[-1].statistics.value("elements_sent"))
        host = hvd.allreduce(tf.constant([float(sent[-1] - sent[-2])]), op=hvd.Sum,
                             name=f"sp.{method}.records").numpy()[0] / hvd.cross_size()
        out[method] = {"identical": identical, "paths": stats["paths"], "host_records": host,
                       "moved": float(np.abs(
                           _flat(tf, variables).numpy()
                           - _flat(tf, _vars(tf, seed=3, width=256)).numpy()).max())}
    return out


def conservation(steps=6):
    """No momentum: over all ranks, the residuals after (each a slice of its host's
    summed gradient, placed where it lies in the tensor) + N x the average == the
    residuals before + every rank's gradient; nothing a host did not send is lost."""
    tf = _tf()
    import hvd_dgc.tensorflow as hvd
    rank, world = hvd.rank(), hvd.size()
    variables = _vars(tf, seed=2, width=128)
    exchange = _exchange(tf, hvd, variables, density=0.02, aggregation="hierarchical",
                         name="chier")
    peers = exchange.wire.peers
    run = tf.function(exchange)

    def residuals():
        out = []
        for t, v in zip(exchange.tensors, exchange.memory.v):
            full = np.zeros(t.numel)
            if int(v.shape[0]) == t.numel:  # a dense tensor: all of it here
                full[:] = v.numpy()
            else:
                lo, hi = slices(t.numel, len(peers))[peers.index(rank)]
                full[lo:hi] = v.numpy()
            out.append(full)
        return np.concatenate(out)

    errors, scale, sizes = [], [], [int(v.shape[0]) for v in exchange.memory.v]
    for step in range(steps):
        grads = _grads(tf, variables, step, rank)
        before = residuals()
        avg = run(grads)
        g = np.concatenate([x.numpy().ravel() for x in grads]).astype(np.float64)
        flat = np.concatenate([a.numpy().ravel() for a in avg]).astype(np.float64)
        terms = residuals() - before - g + flat  # summed: + N avg, as avg = sum / N
        mismatch = hvd.allreduce(tf.constant(terms), op=hvd.Sum, name=f"ch.{step}").numpy()
        errors.append(float(np.abs(mismatch).max()))
        scale.append(float(np.abs(g).max()))
    return {"errors": errors, "scale": max(scale), "world": world, "sizes": sizes,
            "numels": exchange.numels, "peers": list(peers), "stats": exchange.stats()}


def nonfinite_skip():
    """A NaN on rank 1 at step 2: every rank (its host peer summed the NaN) skips the
    step; every rank's memory and the step count unchanged."""
    tf = _tf()
    import hvd_dgc.tensorflow as hvd
    variables = _vars(tf, seed=4, width=128)
    exchange = _exchange(tf, hvd, variables, density=0.02, aggregation="hierarchical",
                         momentum=0.9, name="nanhier")
    return {"steps": nan_at_step_2(tf, exchange, variables, hvd.rank()),
            "nonfinite_steps": exchange.stats()["nonfinite_steps"]}


def auto_choice():
    """aggregation="auto" at 0.1% across a 100 Mbit/s link: hierarchical for the large
    weights the cost model gives it (one choice per tensor), with delay too; at 1 Gbit/s
    (the default model) flat; "flat" never takes it. (fp32 values, as PyTorch's test: in
    8 bits the allgather's records weigh a third of hierarchical DGC's ``[int32 |
    fp32]`` ones, and it wins.)"""
    tf = _tf()
    import hvd_dgc.tensorflow as hvd
    from hvd_dgc import CostModel
    slow = CostModel(bandwidth=100e6 / 8)
    out = {}
    for tag, kwargs in (("auto", {"cost_model": slow}), ("auto_1gbit", {}),
                        ("flat", {"aggregation": "flat", "cost_model": slow}),
                        ("auto_delay", {"delay": 1, "cost_model": slow})):
        variables = _vars(tf, seed=5, width=256)
        exchange = _exchange(tf, hvd, variables, density=0.001, warmup=0, momentum=0.9,
                             name="auto" + tag, compression=hvd.Compression.dgc(value_bits=32),
                             **kwargs)
        out[tag] = {"stages": [[k.value for k in stages] for stages in exchange.paths.stages],
                    "peers": list(exchange.wire.peers)}
    return out


def bad_inputs():
    """A forced hierarchical aggregation that cannot run says why and what to use: on
    one host, with ``period``, with Adam's variance taken over (TensorFlow)."""
    tf = _tf()
    import hvd_dgc.tensorflow as hvd
    import hvd_dgc.tensorflow.keras as hvd_keras
    out = {}
    variables = _vars(tf, seed=6)
    cases = {"period": lambda: _exchange(tf, hvd, variables, aggregation="hierarchical",
                                         period=2, momentum=0.9, name="bad_period"),
             "adam": lambda: _keras_adam_step(tf, hvd_keras)}
    if hvd.cross_size() == 1:
        cases = {"single_host": lambda: _exchange(tf, hvd, variables,
                                                  aggregation="hierarchical", name="bad1")}
    for tag, make in cases.items():
        out[tag] = _error_of(make)
    return out


def _keras_adam_step(tf, hvd_keras):
    variables = _vars(tf, seed=7)
    opt = hvd_keras.DistributedOptimizer(tf.keras.optimizers.Adam(1e-3),
                                         aggregation="hierarchical")
    x, y = _batch(0, 0)
    with tf.GradientTape() as tape:
        loss = _loss(tf, variables, x, y)
    opt.apply_gradients(zip(tape.gradient(loss, variables), variables))


def delayed(steps=6, lr=0.05):
    """Delayed averaging (D=2) over hierarchical DGC, SGD with momentum taken over: each
    rank applies what it sent (its slice of its host's sum) at once and the average two
    steps later; rank 1's gradient NaN at step 2 (dropped: it sends zeros to its host,
    nobody waits). Two steps in flight before the flush, every rank the same weights
    after it; at density 0.01 and 1."""
    tf = _tf()
    import hvd_dgc.tensorflow as hvd
    rank, out = hvd.rank(), {}
    for tag, density in (("sparse", 0.01), ("dense", 1.0)):
        variables = _vars(tf, seed=8, width=128)
        start = _flat(tf, variables).numpy()
        exchange = _exchange(tf, hvd, variables, density=density, warmup=0, delay=2,
                             momentum=0.9, aggregation="hierarchical", min_compress_size=0,
                             name="dga" + tag)
        run = tf.function(exchange)
        for step in range(steps):
            grads = _grads(tf, variables, step, rank)
            if step == 2 and rank == 1 and tag == "sparse":
                grads[2] = tf.tensor_scatter_nd_update(grads[2], [[0, 0]], [float("nan")])
            for v, u in zip(variables, run(grads)):
                v.assign_sub(lr * u)
        in_flight = exchange.in_flight

        def apply(corrections, to):
            for v, c in zip(to, corrections):
                v.assign_sub(lr * c)
        exchange.flush(apply)
        stats = exchange.stats()
        out[tag] = {"in_flight": in_flight, "after": exchange.in_flight,
                    "identical": _identical(tf, hvd, variables, "dga." + tag),
                    "finite": bool(np.isfinite(_flat(tf, variables).numpy()).all()),
                    "moved": float(np.abs(_flat(tf, variables).numpy() - start).max()),
                    "paths": stats["paths"], "nonfinite_steps": stats["nonfinite_steps"]}
    return out
