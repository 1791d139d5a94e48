"""The tape's dense tensors folded into the step's allgathers (hvd_dgc/tensorflow/paths.py
``DensePath.synchronous``) and the step's tensors in buckets (``ExchangePaths.step``),
against the same step with them apart, on every rank."""

import numpy as np

from tests.tensorflow.tf_dgc import _identical, _tf, _vars


def _ops(graph):
    """Horovod collectives of a traced step, its functions' (cond branches') included."""
    found = [op.type for op in graph.get_operations()]
    for function in graph._functions.values():
        found += [node.op for node in function.definition.node_def]
    return {"allreduce": sum("Allreduce" in t for t in found),
            "allgather": sum("Allgather" in t for t in found)}


def folded_equals_apart(steps=6):
    """The same DGC run (density 0.01 after no warm-up, SGD momentum, fp32 values so that
    a folded bias goes exact) three times: the defaults, which fold the biases into the
    allgathers and put every tensor in one bucket (64 MiB); ``fusion_threshold=0``,
    folded but each tensor alone; and a cost model of no latency and a slow allgather,
    which keeps the biases in an allreduce and leaves every tensor alone. Returns per
    step whether the averaged gradients are bit-identical to the last's, the Horovod
    collectives in each traced step, and the statistics."""
    tf = _tf()
    import hvd_dgc.tensorflow as hvd
    from hvd_dgc import CostModel
    rank = hvd.rank()
    out = {}
    grads_of = {}
    exact = hvd.Compression.dgc(value_bits=32)
    for name, extra in (("bucketed", {}), ("folded", {"fusion_threshold": 0}),
                        ("apart", {"cost_model": CostModel(alpha=0, gather_bandwidth=1e7)})):
        variables = _vars(tf, seed=3)
        names = [f"{name}.{i}" for i in range(len(variables))]
        variables = [tf.Variable(v, name=n) for v, n in zip(variables, names)]
        rng = np.random.RandomState(10 + rank)

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                h = tf.nn.relu(x @ variables[0] + variables[1])
                h = tf.nn.relu(h @ variables[2] + variables[3])
                logits = h @ variables[4] + variables[5]
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
            tape = hvd.DistributedGradientTape(tape, density=0.01, warmup=0,
                                               min_compress_size=1000, compression=exact,
                                               **extra)
            grads = tape.gradient(loss, variables)
            for v, g in zip(variables, grads):
                v.assign_sub(0.1 * g)
            return grads
        seen = []
        for s in range(steps):
            x = tf.constant(rng.randn(32, 20).astype(np.float32))
            y = tf.constant(rng.randint(0, 5, 32).astype(np.int64))
            seen.append([g.numpy() for g in step(x, y)])
        grads_of[name] = seen
        stats = hvd.compression_stats()  # (a list once there are two exchanges)
        stats = stats[-1] if isinstance(stats, list) else stats
        out[name] = {"ops": _ops(step.get_concrete_function(x, y).graph),
                     "bytes": int(stats["bytes_sent"]), "paths": stats["paths"],
                     "identical": _identical(tf, hvd, variables, f"fold.{name}")}
    out["equal"] = {name: [all(np.array_equal(a, b) for a, b in zip(fa, fb))
                           for fa, fb in zip(grads_of[name], grads_of["apart"])]
                    for name in ("bucketed", "folded")}
    out["dense_numel"] = int(sum(np.prod(v.shape) for v in _vars(tf, seed=3)
                                 if np.prod(v.shape) < 1000))
    return out


def buckets_across_stages(steps=8):
    """The warm-up's stages (0.25, then 0.01 from step 4) with buckets that change with
    the stage (a ``tf.switch_case``): the default ``fusion_threshold``, one of 6,000
    bytes (several buckets a step), and 0 (each tensor alone); rank 1's gradient NaN at
    step 2 (every rank skips it). Per setting: the averaged gradients every step, bit
    for bit against each tensor alone, the collectives in the traced step, whether the
    ranks end identical, the statistics."""
    tf = _tf()
    import hvd_dgc.tensorflow as hvd
    rank = hvd.rank()
    out, grads_of = {}, {}
    for name, threshold in (("default", None), ("small", 6000), ("alone", 0)):
        variables = [tf.Variable(v) for v in _vars(tf, seed=4, width=96)]
        rng = np.random.RandomState(20 + rank)

        @tf.function
        def step(x, y, poison):
            with tf.GradientTape() as tape:
                h = tf.nn.relu(x @ variables[0] + variables[1])
                h = tf.nn.relu(h @ variables[2] + variables[3])
                logits = h @ variables[4] + variables[5]
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
                loss = loss * poison
            tape = hvd.DistributedGradientTape(tape, density=0.01, warmup=4,
                                               warmup_densities=(0.25,),
                                               min_compress_size=1000,
                                               fusion_threshold=threshold)
            grads = tape.gradient(loss, variables)
            finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])
            for v, g in zip(variables, grads):
                v.assign_sub(tf.where(finite, 0.1 * g, 0.0))
            return grads
        seen = []
        for s in range(steps):
            x = tf.constant(rng.randn(32, 20).astype(np.float32))
            y = tf.constant(rng.randint(0, 5, 32).astype(np.int64))
            poison = tf.constant(float("nan") if (s == 2 and rank == 1) else 1.0)
            seen.append([g.numpy() for g in step(x, y, poison)])
        grads_of[name] = seen
        stats = hvd.compression_stats()
        stats = stats[-1] if isinstance(stats, list) else stats
        out[name] = {"ops": _ops(step.get_concrete_function(x, y, poison).graph),
                     "paths": stats["paths"], "nonfinite_steps": stats["nonfinite_steps"],
                     "bytes": int(stats["bytes_sent"]),
                     "identical": _identical(tf, hvd, variables, f"bst.{name}")}
    out["equal"] = {name: [all(np.array_equal(a, b, equal_nan=True) for a, b in zip(fa, fb))
                           for fa, fb in zip(grads_of[name], grads_of["alone"])]
                    for name in ("default", "small")}
    return out
