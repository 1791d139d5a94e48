"""Region reduce and forced aggregations on the TensorFlow side (hvd_dgc/tensorflow/
region.py), on every rank under horovodrun: parity with the NumPy reference, density 1
== Horovod's tape, bit-identical ranks, error feedback's conservation (synchronous and
delayed), a skipped step, and Keras."""

import numpy as np

from hvd_dgc.aggregation import region_of, region_reduce_reference
from tests.tensorflow.tf_sparse import _error_of
from tests.tensorflow.tf_dgc import _batch, _flat, _identical, _loss, _sgd_momentum_step, _tf, \
    _vars

METHODS = ("allgather", "region")


def reference_parity(cases=((1000, 10), (37, 5), (3, 2), (4096, 40), (50, 1))):
    """One region reduce of records every rank can recompute (so each rank runs the
    reference for all), bit for bit: the sum everyone gets, and what this rank keeps.
    (50, 1): on 4 ranks, 2 regions (aggregation.regions), ranks 2 and 3 owning none."""
    tf = _tf()
    import hvd_dgc.tensorflow as hvd
    from hvd_dgc.tensorflow.region import region_reduce
    rank, world = hvd.rank(), hvd.size()
    out = []
    for case, (n, k) in enumerate(cases):
        selections = []
        for r in range(world):
            rng = np.random.RandomState(100 * case + r)
            idx = rng.choice(n, size=min(k, n), replace=False)
            # rank 0 picks from its own region only: unbalanced owners, ties of |sum|
            if r == 0:
                idx = np.arange(0, n, world)[:k]
            values = rng.randn(idx.size).astype(np.float32)
            if r == 1:
                values[: idx.size // 2] = 0.5
            selections.append((idx.astype(np.int64), values))
        ref = region_reduce_reference(selections, n, k)
        idx, val = selections[rank]
        res = region_reduce(tf.constant(idx, tf.int32), tf.constant(val), n, k,
                            f"parity.{case}")
        expected = np.zeros(n, np.float32)
        expected[ref.indices] = ref.values
        back_idx, back_val = ref.returned[rank]
        got_idx = res.returned_indices.numpy()
        order = np.argsort(got_idx)
        out.append({
            "total_equal": bool(np.array_equal(res.total.numpy(), expected)),
            "returned_equal": bool(np.array_equal(got_idx[order], back_idx)
                                   and np.array_equal(res.returned_values.numpy()[order],
                                                      back_val.astype(np.float32))),
            "kept": int(res.kept),
            "kept_ref": int((region_of(ref.indices, n, world, k) == rank).sum())})
    return out


def reference_parity_fp16(cases=((1000, 10), (37, 5), (4096, 40))):
    """Region reduce with 6-byte records (``Compression.topk(fp16_values=True)``'s wire),
    against the reference fed every rank's values rounded to fp16: the owners' sums in
    float32, the kept ones rounded to fp16 on the way out; what an owner gives back is
    its sums not kept and the kept ones' rounding. Bit for bit."""
    tf = _tf()
    import hvd_dgc.tensorflow as hvd
    from hvd_dgc.tensorflow.region import region_reduce
    rank, world = hvd.rank(), hvd.size()
    codec = hvd.Compression.topk(fp16_values=True)
    out = []
    for case, (n, k) in enumerate(cases):
        selections = []
        for r in range(world):
            rng = np.random.RandomState(700 + 100 * case + r)
            idx = rng.choice(n, size=min(k, n), replace=False)
            values = (rng.randn(idx.size) * 3).astype(np.float32)
            selections.append((idx.astype(np.int64), values))
        rounded = [(i, v.astype(np.float16).astype(np.float32)) for i, v in selections]
        ref = region_reduce_reference(rounded, n, k)
        wire = ref.values.astype(np.float16).astype(np.float32)
        expected = np.zeros(n, np.float32)
        expected[ref.indices] = wire
        mine = region_of(ref.indices, n, world, k) == rank
        back = {int(i): v for i, v in zip(*ref.returned[rank])}
        for i, s, w in zip(ref.indices[mine], ref.values[mine], wire[mine]):
            if s != w:
                back[int(i)] = np.float32(s - w)
        idx, val = selections[rank]
        res = region_reduce(tf.constant(idx, tf.int32), tf.constant(val), n, k,
                            f"parity16.{case}", codec=codec)
        got = dict(zip(res.returned_indices.numpy().tolist(), res.returned_values.numpy()))
        out.append({
            "total_equal": bool(np.array_equal(res.total.numpy(), expected)),
            "returned_equal": sorted(got) == sorted(back) and all(
                np.float32(got[i]) == np.float32(back[i]) for i in back),
            "rounding_returned": sum(1 for i in back if i not in dict(zip(
                ref.returned[rank][0].tolist(), ref.returned[rank][1]))),
            "kept": int(res.kept),
            "kept_ref": int(mine.sum())})
    return out


def density_one(steps=8):
    """density 1 through the forced method == Horovod's DistributedGradientTape (SGD with
    momentum applied outside), every tensor sparse (min_compress_size=0)."""
    tf = _tf()
    import horovod.tensorflow as hvd_stock
    import hvd_dgc.tensorflow as hvd
    rank, out = hvd.rank(), {}
    for method in METHODS + ("region_predivide",):
        predivide = 2.0 if "predivide" in method else 1.0
        ref, ours = _vars(tf), _vars(tf)
        bufs = [[tf.Variable(tf.zeros_like(v)) for v in vs] for vs in (ref, ours)]
        wraps = (lambda t: hvd_stock.DistributedGradientTape(
                     t, gradient_predivide_factor=predivide),
                 lambda t: hvd.DistributedGradientTape(
                     t, density=1.0, aggregation=method.split("_")[0], min_compress_size=0,
                     gradient_predivide_factor=predivide))
        for step in range(steps):
            x, y = _batch(step, rank)
            for variables, wrap, buf in zip((ref, ours), wraps, bufs):
                with tf.GradientTape() as tape:
                    loss = _loss(tf, variables, x, y)
                _sgd_momentum_step(tf, variables, wrap(tape).gradient(loss, variables), buf)
        out[method] = {
            "max_diff": float(tf.reduce_max(tf.abs(_flat(tf, ref) - _flat(tf, ours)))),
            "moved": float(tf.reduce_max(tf.abs(_flat(tf, ours) - _flat(tf, _vars(tf))))),
            "identical": _identical(tf, hvd, ours, "d1." + method),
            "paths": _last(hvd.compression_stats())["paths"]}
    return out


def _last(stats):
    """The newest exchange's statistics (compression_stats lists several, if any)."""
    return stats[-1] if isinstance(stats, list) else stats


def _exchange(tf, hvd, variables, **options):
    from hvd_dgc.tensorflow.exchange import GradientExchange
    exchange = GradientExchange(**options)
    exchange.build(variables)
    return exchange


def _grads(tf, variables, step, rank):
    rng = np.random.RandomState(7919 * step + rank)
    return [tf.constant(rng.randn(*v.shape).astype(np.float32)) for v in variables]


def _memory(tf, hvd, exchange, name):
    """Sum over ranks of the residuals v (flat, float64)."""
    v = np.concatenate([x.numpy() for x in exchange.memory.v]).astype(np.float64)
    return hvd.allreduce(tf.constant(v), op=hvd.Sum, name=name).numpy()


def conservation(steps=6):
    """Error feedback through the exchange (no momentum, density 1%, inside a
    tf.function): sum over ranks of (memory after - before - gradient) + N x average
    is 0 every step; ranks receive identical averages; region's give-backs counted."""
    tf = _tf()
    import hvd_dgc.tensorflow as hvd
    rank, world, out = hvd.rank(), hvd.size(), {}
    for method in METHODS:
        variables = _vars(tf, seed=2, width=128)
        exchange = _exchange(tf, hvd, variables, density=0.01, aggregation=method,
                             name="c" + method)
        run = tf.function(exchange)
        errors, identical, scale = [], [], []
        for step in range(steps):
            grads = _grads(tf, variables, step, rank)
            before = _memory(tf, hvd, exchange, f"c.{method}.{step}.b")
            avg = run(grads)
            after = _memory(tf, hvd, exchange, f"c.{method}.{step}.a")
            g = np.concatenate([x.numpy().ravel() for x in grads]).astype(np.float64)
            g_sum = hvd.allreduce(tf.constant(g), op=hvd.Sum, name=f"c.{method}.{step}.g")
            flat = tf.concat([tf.reshape(a, [-1]) for a in avg], 0)
            residual = after - before - g_sum.numpy() + world * flat.numpy().astype(np.float64)
            errors.append(float(np.abs(residual).max()))
            scale.append(float(np.abs(g_sum.numpy()).max()))
            identical.append(_identical(tf, hvd, [flat], f"c.{method}.{step}.id"))
        out[method] = {"errors": errors, "scale": max(scale), "identical": identical,
                       "stats": exchange.stats()}
    return out


def delayed_conservation(steps=6, delay=2):
    """delay=2 with region reduce, give-backs at the correction of step i-D and at the
    drain: N x (sum of everything applied) + sum over ranks of the final memory ==
    sum over ranks of every gradient; the drain leaves nothing in flight."""
    tf = _tf()
    import hvd_dgc.tensorflow as hvd
    rank, world = hvd.rank(), hvd.size()
    variables = _vars(tf, seed=3, width=128)
    exchange = _exchange(tf, hvd, variables, density=0.01, aggregation="region", delay=delay,
                         name="delayed")
    run = tf.function(exchange)
    applied = np.zeros(sum(exchange.numels))
    given = np.zeros(sum(exchange.numels))
    for step in range(steps):
        grads = _grads(tf, variables, step, rank)
        given += np.concatenate([x.numpy().ravel() for x in grads])
        applied += np.concatenate([tf.reshape(a, [-1]).numpy() for a in run(grads)])
    drained = exchange.dga.drain()
    applied += np.concatenate(drained)
    memory = _memory(tf, hvd, exchange, "dc.m")
    total = hvd.allreduce(tf.constant(world * applied), op=hvd.Sum, name="dc.a").numpy() / world
    given = hvd.allreduce(tf.constant(given), op=hvd.Sum, name="dc.g").numpy()
    return {"imbalance": float(np.abs(total + memory - given).max()),
            "scale": float(np.abs(given).max()), "in_flight": exchange.in_flight,
            "stats": exchange.stats()}


def nonfinite_skip():
    """A NaN on rank 1 at step 2: every rank skips it; memory and counters unchanged."""
    tf = _tf()
    import hvd_dgc.tensorflow as hvd
    variables = _vars(tf, seed=4, width=128)
    exchange = _exchange(tf, hvd, variables, density=0.01, aggregation="region", name="nan")
    return nan_at_step_2(tf, exchange, variables, hvd.rank())


def nan_at_step_2(tf, exchange, variables, rank, steps=4):
    """``exchange``'s steps (in a tf.function) with rank 1's gradient NaN at step 2: per
    step whether every rank skipped it, whether this rank's memory (v and u) and region
    reduce's returned count are as before, and how far the step count moved."""
    run = tf.function(exchange.exchange)
    memory, out = exchange.memory, []
    for step in range(steps):
        grads = _grads(tf, variables, step, rank)
        if step == 2 and rank == 1:
            grads[2] = tf.tensor_scatter_nd_update(grads[2], [[0, 0]], [float("nan")])
        before = np.concatenate([x.numpy() for x in memory.v + memory.u])
        stats, at = exchange.stats(), int(exchange.step.numpy())
        _, skipped = run(grads)
        after = np.concatenate([x.numpy() for x in memory.v + memory.u])
        out.append({"skipped": bool(skipped), "memory_same": bool(np.array_equal(before, after)),
                    "returned_same": stats["returned_elements"]
                    == exchange.stats()["returned_elements"],
                    "step_moved": int(exchange.step.numpy()) - at})
    return out


def keras_region(steps=6):
    """Keras 3 SGD with momentum, DGC 1% summed by region reduce: ranks identical after
    every step, the path counted."""
    tf = _tf()
    import hvd_dgc.tensorflow as hvd
    import hvd_dgc.tensorflow.keras as hvd_keras
    rank = hvd.rank()
    keras = tf.keras
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(5)])
    opt = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9),
                                         density=0.01, aggregation="region")
    model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
    identical = []
    for step in range(steps):
        x, y = _batch(step, rank, 32)
        model.train_on_batch(x, y)
        identical.append(_identical(tf, hvd, model.trainable_variables, f"k.{step}"))
    return {"identical": identical, "stats": opt.compression_stats()}


def bad_inputs():
    """aggregation= typos are refused at the tape's and the optimizer's construction,
    naming the choices (TF has sparse compressors only, so 'region' always applies)."""
    tf = _tf()
    import hvd_dgc.tensorflow as hvd
    import hvd_dgc.tensorflow.keras as hvd_keras
    tape = _error_of(lambda: hvd.DistributedGradientTape(tf.GradientTape(),
                                                         aggregation="regoin"))
    keras = _error_of(lambda: hvd_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.1),
                                                             aggregation=None))
    return {"tape": tape, "keras": keras}
