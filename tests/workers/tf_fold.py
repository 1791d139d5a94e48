"""The tape's dense tensors folded into the step's allgathers (hvd_dgc/tensorflow/paths.py
``DensePath.synchronous``), against the same step with them apart, on every rank."""

import numpy as np

from tests.workers.tf_dgc import _identical, _tf, _vars


def _ops(graph):
    """Horovod collectives of a traced step, its functions' (cond branches') included."""
    found = [op.type for op in graph.get_operations()]
    for function in graph._functions.values():
        found += [node.op for node in function.definition.node_def]
    return {"allreduce": sum("Allreduce" in t for t in found),
            "allgather": sum("Allgather" in t for t in found)}


def folded_equals_apart(steps=6):
    """The same DGC run (density 0.01 after no warm-up, SGD momentum) twice: the default
    cost model, which folds the biases into the allgathers, and ``CostModel(alpha=0)``,
    which keeps them in an allreduce. Returns per step whether the averaged gradients
    are bit-identical, the Horovod collectives in each traced step, and the statistics."""
    tf = _tf()
    import hvd_dgc.tensorflow as hvd
    from hvd_dgc import CostModel
    rank = hvd.rank()
    out = {}
    grads_of = {}
    for name, extra in (("folded", {}), ("apart", {"cost_model": CostModel(alpha=0)})):
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
                                               min_compress_size=1000, **extra)
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
    out["equal"] = [all(np.array_equal(a, b) for a, b in zip(fa, fb))
                    for fa, fb in zip(grads_of["folded"], grads_of["apart"])]
    out["dense_numel"] = int(sum(np.prod(v.shape) for v in _vars(tf, seed=3)
                                 if np.prod(v.shape) < 1000))
    return out
