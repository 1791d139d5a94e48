"""Bodies of the TensorFlow/Keras tests, run on every rank under horovodrun."""

import importlib
import os
import re
import time
import traceback

import numpy as np


def _tf():
    import tensorflow as tf
    tf.config.threading.set_inter_op_parallelism_threads(2)  # delay=D needs 2 (delayed.py)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    return tf


def _vars(tf, seed=0, width=64):
    rng = np.random.RandomState(seed)
    shapes = [(20, width), (width,), (width, width), (width,), (width, 5), (5,)]
    return [tf.Variable(rng.randn(*s).astype(np.float32) * 0.1, name=f"w{i}")
            for i, s in enumerate(shapes)]


def _batch(step, rank, n=16):
    rng = np.random.RandomState(1000 * step + rank)
    return rng.randn(n, 20).astype(np.float32), rng.randint(0, 5, n)


def _loss(tf, variables, x, y):
    h = x
    for i in range(0, len(variables) - 2, 2):
        h = tf.nn.relu(h @ variables[i] + variables[i + 1])
    logits = h @ variables[-2] + variables[-1]
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))


def _flat(tf, variables):
    return tf.concat([tf.reshape(v, [-1]) for v in variables], 0)


def _identical(tf, hvd, variables, name):
    everyone = hvd.allgather(tf.expand_dims(_flat(tf, variables), 0), name=name).numpy()
    return all(np.array_equal(everyone[0], everyone[r]) for r in range(everyone.shape[0]))


def _sgd_momentum_step(tf, variables, grads, buffers, lr=0.1, momentum=0.9):
    for v, g, b in zip(variables, grads, buffers):
        b.assign(momentum * b + g)
        v.assign_sub(lr * b)


def tape_dense_equivalence(steps=10):
    """density=1.0 through hvd_dgc's tape == Horovod's DistributedGradientTape."""
    tf = _tf()
    import horovod.tensorflow as hvd_stock
    import hvd_dgc.tensorflow as hvd
    rank = hvd.rank()
    ref, ours = _vars(tf), _vars(tf)
    bufs = [[tf.Variable(tf.zeros_like(v)) for v in vs] for vs in (ref, ours)]
    for step in range(steps):
        x, y = _batch(step, rank)
        for k, (variables, wrap) in enumerate(((ref, lambda t: hvd_stock.DistributedGradientTape(t)),
                                               (ours, lambda t: hvd.DistributedGradientTape(
                                                   t, density=1.0)))):
            with tf.GradientTape() as tape:
                loss = _loss(tf, variables, x, y)
            grads = wrap(tape).gradient(loss, variables)
            _sgd_momentum_step(tf, variables, grads, bufs[k])
    diff = float(tf.reduce_max(tf.abs(_flat(tf, ref) - _flat(tf, ours))))
    moved = float(tf.reduce_max(tf.abs(_flat(tf, ours) - _flat(tf, _vars(tf)))))
    return {"max_diff": diff, "moved": moved, "identical": _identical(tf, hvd, ours, "t.id")}


def tape_users_compressor(steps=10):
    """docs/extending.md's compressor recipe followed from outside the package, as
    tests/torch/torch_compressors.py ``users_compressor``: a user's top-k by sorting
    (ours uses tf.math.top_k), registered on ``Compression`` and named there by the tape;
    its run equals ``Compression.topk``'s bit for bit, through its own ``select``."""
    tf = _tf()
    import hvd_dgc.tensorflow as hvd
    from hvd_dgc.tensorflow.compression import SparseCompressor

    class SortedTopK(SparseCompressor):
        name = "sorted_topk"
        calls = 0

        def select(self, flat, k, seed):
            type(self).calls += 1
            return tf.argsort(tf.abs(flat), direction="DESCENDING")[:k]

    hvd.Compression.sorted_topk = SortedTopK()
    rank, out = hvd.rank(), {}
    for tag, comp in (("users", hvd.Compression.sorted_topk), ("topk", hvd.Compression.topk)):
        variables = _vars(tf, seed=5, width=96)
        bufs = [tf.Variable(tf.zeros_like(v)) for v in variables]
        for step in range(steps):
            with tf.GradientTape() as tape:
                loss = _loss(tf, variables, *_batch(step, rank))
            grads = hvd.DistributedGradientTape(
                tape, compression=comp, density=0.02, warmup=0,
                aggregation="allgather").gradient(loss, variables)
            _sgd_momentum_step(tf, variables, grads, bufs)
        stats = hvd.compression_stats()  # (every exchange of the process: this one last)
        out[tag] = {"weights": _flat(tf, variables).numpy().tolist(),
                    "identical": _identical(tf, hvd, variables, f"user.{tag}"),
                    "paths": (stats[-1] if isinstance(stats, list) else stats)["paths"]}
    out["calls"] = SortedTopK.calls
    out["repr"] = repr(hvd.Compression.sorted_topk(seed=1))
    del hvd.Compression.sorted_topk
    return out


def tape_sparse_in_tf_function(steps=8):
    """DGC 1% inside tf.function: ranks identical after every step, counts in the window."""
    tf = _tf()
    import hvd_dgc.tensorflow as hvd
    rank = hvd.rank()
    variables = _vars(tf, seed=1, width=128)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = _loss(tf, variables, x, y)
        tape = hvd.DistributedGradientTape(tape, density=0.01)
        grads = tape.gradient(loss, variables)
        for v, g in zip(variables, grads):
            v.assign_sub(0.1 * g)
        return loss

    identical = []
    for step in range(steps):
        train_step(*_batch(step, rank))
        identical.append(_identical(tf, hvd, variables, "s.id.%d" % step))
    stats = hvd.compression_stats()
    from hvd_dgc.tensorflow.tape_exchanges import EXCHANGES, variable_ref
    refs = tuple(variable_ref(v) for v in variables)
    mine, = [e for (key, _), e in EXCHANGES.items() if key == refs]
    return {"identical": identical, "stats": stats, "compressed": mine.paths.compressed(),
            "traces": train_step.experimental_get_tracing_count()}


def tape_horovod_patterns(steps=4):
    """Horovod's tensorflow2 examples with the import line switched:
    ``DistributedGradientTape(tape, compression=hvd.Compression.fp16)`` (and a name) is DGC,
    with the default warm-up by steps; rank 0 prints what runs, once per tape set-up."""
    import contextlib
    import io
    tf = _tf()
    import hvd_dgc.tensorflow as hvd
    rank = hvd.rank()
    out = {}
    for tag, comp in (("fp16", hvd.Compression.fp16), ("name", "TopK"),
                      ("dense", hvd.Compression.none)):
        variables = _vars(tf, seed=3, width=128)
        printed = io.StringIO()
        for step in range(steps):
            with tf.GradientTape() as tape:
                loss = _loss(tf, variables, *_batch(step, rank))
            tape = hvd.DistributedGradientTape(
                tape, compression=comp, **({"density": 1.0} if tag == "dense" else {}))
            with contextlib.redirect_stdout(printed):
                grads = tape.gradient(loss, variables)
            for v, g in zip(variables, grads):
                v.assign_sub(0.1 * g)
        out[tag] = {"printed": printed.getvalue(),
                    "identical": _identical(tf, hvd, variables, "hp." + tag)}
    return out


def tape_keras3_model(steps=6):
    """Horovod's tensorflow2_mnist pattern on TF 2.21's default Keras 3: a keras model, a
    tf.GradientTape, ``hvd.DistributedGradientTape(tape)``, gradients of
    ``model.trainable_variables`` (Keras 3 variables, which have no ``.ref()``), applied by
    a Keras optimizer; plus ``register_local_source`` on one of them."""
    tf = _tf()
    import keras
    import hvd_dgc.tensorflow as hvd
    rank = hvd.rank()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Input((20,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(5)])
    opt = keras.optimizers.SGD(0.1)
    losses = []
    for step in range(steps):
        x, y = _batch(step, rank)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
                y, model(x), from_logits=True))
        tape = hvd.DistributedGradientTape(tape, density=0.05, min_compress_size=64)
        if step == 0:
            tape.register_local_source(model.trainable_variables[-1])
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
    shared = [v.value if hasattr(v, "value") else v for v in model.trainable_variables[:-1]]
    stats = hvd.compression_stats()
    stats = stats[-1] if isinstance(stats, list) else stats  # the newest exchange is this one
    return {"losses": losses, "keras_version": keras.__version__,
            "has_ref": hasattr(model.trainable_variables[0], "ref"),
            "identical": _identical(tf, hvd, shared, "k3.id"),
            "ratio": stats["compression_ratio"]}


def keras_dense_equivalence(steps=10):
    """Keras 2 (tf_keras): hvd_dgc's optimizer at density 1 == Horovod's, SGD momentum."""
    tf = _tf()
    import hvd_dgc.tensorflow.keras as hvd
    out = {}
    for nesterov in (False, True):
        ref, ours, _ = keras_against_horovod(
            tf, lambda o: hvd.DistributedOptimizer(o, density=1.0), steps, "ref",
            nesterov=nesterov)
        out["nesterov" if nesterov else "momentum"] = float(tf.reduce_max(tf.abs(ref - ours)))
    return out


def keras_against_horovod(tf, ours, steps, name, each_step=None, nesterov=False):
    """Keras 2 SGD (momentum 0.9) on the same batches through Horovod's Keras
    DistributedOptimizer and through ``ours(sgd)``: both runs' flat weights, and our
    optimizer. ``each_step(variables, step)`` runs after each of our steps."""
    import horovod.tensorflow.keras as hvd_stock
    rank, params = hvd_stock.rank(), []
    for k, wrap in enumerate((hvd_stock.DistributedOptimizer, ours)):
        variables = _vars(tf, seed=2)
        opt = wrap(tf.keras.optimizers.SGD(0.05, momentum=0.9, nesterov=nesterov))
        for step in range(steps):
            x, y = _batch(step, rank)
            with tf.GradientTape() as tape:
                loss = _loss(tf, variables, x, y)
            grads = tape.gradient(loss, variables)
            if k == 0:  # Horovod's Keras optimizer averages in _compute_gradients
                grads = [hvd_stock.allreduce(g, name=f"{name}.{i}")
                         for i, g in enumerate(grads)]
            opt.apply_gradients(zip(grads, variables))
            if k == 1 and each_step is not None:
                each_step(variables, step)
        params.append(_flat(tf, variables))
    return params[0], params[1], opt


def keras_backward_passes(passes=2, calls=8):
    """backward_passes_per_step=P (Keras 2 or 3 by env): DGC 5% with SGD momentum, P
    calls per exchange, equals the same optimizer with P=1 fed each P calls' summed
    gradients (their mean with average_aggregated_gradients) bit for bit; the calls
    between exchanges leave the weights alone and only count in ``iterations``
    (Horovod's LocalGradientAggregationHelper). Ranks stay identical."""
    tf = _tf()
    import hvd_dgc.tensorflow.keras as hvd
    rank = hvd.rank()
    out = {}
    for average in (False, True):
        grads = [[g.numpy() for g in _grads_at(tf, c, rank)] for c in range(calls)]
        summed = [[sum(grads[c + j][i] for j in range(passes)) for i in range(len(grads[0]))]
                  for c in range(0, calls, passes)]
        if average:
            summed = [[g / np.float32(passes) for g in group] for group in summed]
        runs = {}
        for name, feed, kw in (("passes", grads, dict(backward_passes_per_step=passes,
                                                       average_aggregated_gradients=average)),
                               ("summed", summed, {})):
            variables = _vars(tf, seed=4)
            opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.05, momentum=0.9),
                                           density=0.05, warmup=0, min_compress_size=64, **kw)

            @tf.function
            def step(gs):
                opt.apply_gradients(zip(gs, variables))

            history = []
            for gs in feed:
                step([tf.constant(g) for g in gs])
                history.append(_flat(tf, variables).numpy())
            runs[name] = (history, int(opt.iterations.numpy()),
                          opt.compression_stats()["steps"],
                          _identical(tf, hvd, variables, f"bpp.{name}.{average}"))
        passes_hist, summed_hist = runs["passes"][0], runs["summed"][0]
        key = "mean" if average else "sum"
        out[key] = {
            # after every P-th call: the same weights as the summed run's step
            "max_diff": max(float(np.abs(passes_hist[c * passes + passes - 1] - w).max())
                            for c, w in enumerate(summed_hist)),
            # between: nothing applied yet
            "moved_between": [bool(np.any(passes_hist[c] != passes_hist[c - 1]))
                              for c in range(1, calls) if (c + 1) % passes],
            "iterations": runs["passes"][1], "exchanges": runs["passes"][2],
            "summed_iterations": runs["summed"][1],
            "identical": runs["passes"][3] and runs["summed"][3]}
    return out


def _grads_at(tf, call, rank):
    """Gradients of the test model at a fixed point, on a batch of this call and rank."""
    variables = _vars(tf, seed=9)
    x, y = _batch(call, rank)
    with tf.GradientTape() as tape:
        loss = _loss(tf, variables, x, y)
    return tape.gradient(loss, variables)


def tape_quantizers(steps=3, shape=(60, 50)):
    """Compression.sign / qsgd / bf16 / powersgd (rank 2 from step 0) through the tape on 2
    ranks (eager, no momentum): per step this rank's v (residual + gradient), its residual
    after the step (so what it sent is v - residual: error feedback) and the averaged
    gradient; the bytes counted and whether the ranks end identical. The test checks them
    against PyTorch's codecs, which TensorFlow's payloads equal byte for byte."""
    tf = _tf()
    import hvd_dgc.tensorflow as hvd
    from hvd_dgc.tensorflow.tape_exchanges import EXCHANGES as _EXCHANGES
    rank = hvd.rank()
    numel = int(np.prod(shape))
    out = {}
    compressors = {"sign": hvd.Compression.sign, "qsgd": hvd.Compression.qsgd,
                   "bf16": hvd.Compression.bf16,
                   "powersgd": hvd.Compression.powersgd(rank=2, start_iter=0)}
    for name, comp in compressors.items():
        w = tf.Variable(tf.zeros(shape), name=f"q_{name}")
        b = tf.Variable(tf.zeros([8]), name=f"qb_{name}")  # small: dense

        def exchange():
            return next((e for e in _EXCHANGES.values()
                         if e.memory is not None and e.names[0].startswith(f"q_{name}")), None)
        rows = []
        for step in range(steps):
            g = np.random.RandomState(50 * step + rank).randn(*shape).astype(np.float32)
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(w * g) + tf.reduce_sum(b)
            tape = hvd.DistributedGradientTape(tape, compression=comp)
            before = exchange().memory.v[0].numpy() if exchange() else np.zeros(numel)
            avg, _ = tape.gradient(loss, [w, b])
            rows.append({"v": before + g.reshape(-1),
                         "residual": exchange().memory.v[0].numpy(),
                         "avg": avg.numpy().reshape(-1)})
            w.assign_sub(0.1 * avg)
        stats = exchange().stats()
        out[name] = {"steps": rows, "bytes": stats["bytes_sent"], "paths": stats["paths"],
                     "identical": _identical(tf, hvd, [w, b], f"q.{name}")}
    return out


def tape_priced_dense(steps=3, shape=(60, 50)):
    """sign through the tape where the cost model finds its allgather dearer than the
    allreduce (plan.py ExchangeGroup): every tensor goes dense, each step's average and
    the weights those of dense averaging (density=1.0), the memory empty after each."""
    tf = _tf()
    import hvd_dgc.tensorflow as hvd
    from hvd_dgc import CostModel
    from hvd_dgc.tensorflow.tape_exchanges import EXCHANGES as _EXCHANGES
    rank = hvd.rank()
    runs = {}
    for tag, options in (("dense", {"density": 1.0}),
                         ("sign_slow", {"compression": hvd.Compression.sign,
                                        "cost_model": CostModel(gather_bandwidth=1e3)})):
        w = tf.Variable(tf.zeros(shape), name=f"pd_{tag}")
        avgs = []
        for step in range(steps):
            g = np.random.RandomState(90 * step + rank).randn(*shape).astype(np.float32)
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(w * w * g)
            tape = hvd.DistributedGradientTape(tape, **options)
            avg, = tape.gradient(loss, [w])
            avgs.append(avg.numpy())
            w.assign_sub(0.1 * avg)
        runs[tag] = {"avgs": avgs, "w": w.numpy()}
    ex = next(e for e in _EXCHANGES.values()
              if e.memory is not None and e.names[0].startswith("pd_sign_slow"))
    return {"paths": ex.stats()["paths"], "residual": float(np.abs(ex.memory.v[0].numpy()).max()),
            "avg_diff": max(float(np.abs(a - b).max()) for a, b in
                            zip(runs["dense"]["avgs"], runs["sign_slow"]["avgs"])),
            "w_diff": float(np.abs(runs["dense"]["w"] - runs["sign_slow"]["w"]).max())}


def tape_fixed_records(steps=6, shape=(600, 50), density=0.01):
    """DGC through the tape, eager: the records each step hands Horovod's allgather (its
    input's shape, recorded by wrapping the call), the elements the selection chose, and
    the bytes counted. DGC's selection chooses between 0.8 k and k; the payload is k
    records every step (coded: one size), so Horovod's response cache answers the
    negotiation."""
    tf = _tf()
    import hvd_dgc.tensorflow as hvd
    from hvd_dgc.tensorflow import paths as tf_paths
    from hvd_dgc.tensorflow.tape_exchanges import EXCHANGES as _EXCHANGES
    from hvd_dgc.tensorflow.compression import DGCCompressor
    # aimed at k rather than 1.3 k: about half the steps choose fewer than k
    comp = DGCCompressor(window=(0.5, 1.0))
    rank = hvd.rank()
    w = tf.Variable(tf.zeros(shape), name="fixed_rec")
    shapes = []
    real = tf_paths._hvd.allgather

    def recording(tensor, *args, **kwargs):
        if "sparse" in str(kwargs.get("name")):  # DGC's records, not the wrap-time check
            shapes.append(tuple(int(d) for d in tensor.shape))
        return real(tensor, *args, **kwargs)
    tf_paths._hvd.allgather = recording
    rows = []
    try:
        for step in range(steps):
            g = np.random.RandomState(70 * step + rank).randn(*shape).astype(np.float32)
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(w * g)
            tape = hvd.DistributedGradientTape(tape, compression=comp, density=density,
                                               warmup=0)
            avg, = tape.gradient(loss, [w])
            ex = next(e for e in _EXCHANGES.values()
                      if e.memory is not None and e.names[0].startswith("fixed_rec"))
            rows.append({"elements": ex.statistics.value("elements_sent"),
                         "bytes": ex.statistics.value("bytes_sent")})
            w.assign_sub(0.1 * avg)
    finally:
        tf_paths._hvd.allgather = real
    per_step = [{"elements": r["elements"] - (rows[i - 1]["elements"] if i else 0),
                 "bytes": r["bytes"] - (rows[i - 1]["bytes"] if i else 0)}
                for i, r in enumerate(rows)]
    from hvd_dgc.packing import gather_block_bytes
    k = int(np.ceil(density * np.prod(shape)))
    return {"shapes": shapes, "steps": per_step, "k": k,
            "block": gather_block_bytes(int(np.prod(shape)), k, 8),
            "identical": _identical(tf, hvd, [w], "fixed_rec")}


def tape_quantizers_delayed(steps=5, delay=2, shape=(60, 50), lr=0.1):
    """sign / qsgd / bf16 with delay=2 (one round: what a rank sent is known at launch),
    then hvd.flush, against the synchronous run of the same compressor: SGD, so both end
    at w0 - lr * (sum of the averages), and the payloads are the same in both (the memory
    moves alike), so the weights agree to float32 rounding; the ranks are identical."""
    tf = _tf()
    import hvd_dgc.tensorflow as hvd
    rank = hvd.rank()
    out = {}
    for name in ("sign", "qsgd", "bf16"):
        comp = getattr(hvd.Compression, name)
        final = {}
        for d in (0, delay):
            w = tf.Variable(tf.zeros(shape), name=f"qd{d}_{name}")
            opt = tf.keras.optimizers.SGD(lr)

            @tf.function
            def step(g):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(w * g)
                tape = hvd.DistributedGradientTape(tape, compression=comp, delay=d)
                opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))

            for i in range(steps):
                step(tf.constant(np.random.RandomState(70 * i + rank).randn(*shape)
                                 .astype(np.float32)))
            in_flight = hvd.in_flight()
            hvd.flush(opt)
            final[d] = (w.numpy().copy(), in_flight,
                        _identical(tf, hvd, [w], f"qd.{name}.{d}"))
        sync, delayed = final[0], final[delay]
        out[name] = {"max_diff": float(np.abs(sync[0] - delayed[0]).max()),
                     "scale": float(np.abs(sync[0]).max()),
                     "in_flight_before_flush": delayed[1],
                     "identical": sync[2] and delayed[2]}
    return out


def tape_world_guard():
    """A step that runs in a world of another size than its exchange was planned for
    (what an elastic reset would do) stops with a clear error before any collective,
    eagerly and inside tf.function, on every rank alike."""
    tf = _tf()
    import hvd_dgc.tensorflow as hvd
    from hvd_dgc.tensorflow.tape_exchanges import EXCHANGES as _EXCHANGES
    w = tf.Variable(tf.ones([3000]), name="guard_w")
    out = {}
    for mode in ("eager", "function"):
        def step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(w * w)
            return hvd.DistributedGradientTape(tape, density=0.01, warmup=0).gradient(loss, [w])
        run = tf.function(step) if mode == "function" else step
        run()  # planned and run in this world: fine
        exchange = next(e for e in _EXCHANGES.values()
                        if e.memory is not None and e.names == ["guard_w:0"])
        planned = exchange.built_world
        exchange.built_world = planned + 1  # as if the world had changed since
        try:
            (tf.function(step) if mode == "function" else step)()
            out[mode] = "no error"
        except tf.errors.InvalidArgumentError as error:
            out[mode] = next((line.strip() for line in str(error.message).splitlines()
                              if "hvd_dgc:" in line), str(error.message))
        exchange.built_world = planned
    return out


def digits(rank, size):
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32).reshape(-1, 8, 8, 1)
    perm = np.random.RandomState(0).permutation(len(y))
    test, train = perm[:360], perm[360:]
    shard = train[rank::size]
    return (x[shard], y[shard]), (x[test], y[test])


def keras_fit_digits(epochs=30, lr=0.02, batch=32, delay=0, compressors=(), dense=True):
    """model.fit on digits: DGC 0.1% with warm-up (Keras 2 or 3 by env), with ``dense``
    the dense baseline, with ``delay`` also DGC + delayed averaging, and each of
    ``compressors`` (names of hvd.Compression's quantisers)."""
    tf = _tf()
    import hvd_dgc.tensorflow.keras as hvd
    keras = tf.keras
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    (x, y), (xt, yt) = digits(rank, size)
    legacy = os.environ.get("TF_USE_LEGACY_KERAS") == "1"
    out = {"keras": keras.__version__ if hasattr(keras, "__version__") else "2", "legacy": legacy}
    runs = {"dgc": dict(compression=hvd.Compression.dgc, density=0.001, warmup=4)}
    if delay:  # delayed averaging on top; DGCCallback flushes when fit ends
        runs["dga"] = dict(runs["dgc"], delay=delay)
    for name in compressors:
        runs[name] = dict(compression=getattr(hvd.Compression, name))
    if legacy:
        import horovod.tensorflow.keras as hvd_stock
        if dense:
            runs = {"dense": "horovod", **runs}
    elif dense:  # Horovod's own optimizer fails under Keras 3 (horovod #4290): hvd_dgc's
        runs = {"dense": dict(density=1.0), **runs}
    for tag, options in runs.items():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.layers.Input((8, 8, 1)),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(2), keras.layers.Flatten(),
            keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)])
        sgd = keras.optimizers.SGD(lr, momentum=0.9)
        opt = hvd_stock.DistributedOptimizer(sgd) if options == "horovod" else \
            hvd.DistributedOptimizer(sgd, **options)
        compile_kw = {} if legacy else {"jit_compile": False}
        model.compile(optimizer=opt, metrics=["accuracy"], loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), **compile_kw)
        # the callbacks of Horovod's Keras examples (metrics averaged over ranks)
        cbs = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
               hvd.callbacks.MetricAverageCallback()]
        if options != "horovod":
            cbs.append(hvd.callbacks.DGCCallback(verbose=0))
        history = model.fit(x, y, batch_size=batch, epochs=epochs, callbacks=cbs, verbose=0,
                            shuffle=True).history
        acc = float(np.mean(np.argmax(model.predict(xt, verbose=0), 1) == yt))
        flat = tf.concat([tf.reshape(v, [-1]) for v in model.trainable_variables], 0)
        everyone = hvd.allgather(tf.expand_dims(flat, 0), name=f"fit.{tag}").numpy()
        out[tag] = {"accuracy": acc,
                    "identical": all(np.array_equal(everyone[0], e) for e in everyone),
                    "stats": opt.compression_stats() if options != "horovod" else None,
                    "in_flight": opt.in_flight if options != "horovod" else 0,
                    "history_last": {k: v[-1] for k, v in history.items()}}
    return out


def tape_log_every(steps=5):
    """log_every=2 on a tape in a tf.function and on Keras 3's model.fit: rank 0 prints
    the statistics after every 2nd step, as PyTorch's optimizer does; rank 1 nothing."""
    import contextlib
    import io
    import sys
    tf = _tf()
    import hvd_dgc.tensorflow as hvd
    import hvd_dgc.tensorflow.keras as hvd_keras
    rank, out = hvd.rank(), {}
    variables = _vars(tf, seed=9)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = _loss(tf, variables, x, y)
        tape = hvd.DistributedGradientTape(tape, density=0.01, warmup=0, log_every=2)
        for v, g in zip(variables, tape.gradient(loss, variables)):
            v.assign_sub(0.1 * g)
    keras = tf.keras
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(64), keras.layers.Dense(5)])
    model.compile(hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.05), density=0.01,
                                                 warmup=0, log_every=2),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
    for name, run in (("tape", lambda x, y: step(tf.constant(x), tf.constant(y))),
                      ("keras", lambda x, y: model.fit(x, y, batch_size=16, epochs=1,
                                                       verbose=0))):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            for s in range(steps):
                run(*_batch(s, rank))
            sys.stdout.flush()
        out[name] = [line for line in buf.getvalue().splitlines() if "[hvd_dgc] step" in line]
    return out


def suite(names, kwargs=None):
    """Run the named test bodies in one launch (here; "module.name": ``name`` in
    tests/tensorflow/module.py; "tests.module.name": in that module); ``kwargs`` maps a
    name to its keyword arguments."""
    import hvd_dgc.tensorflow as hvd
    hvd.init()
    results = {}
    times = os.environ.get("HVD_DGC_SUITE_TIMES")  # a file: rank 0 appends each body's time
    for name in names:
        started = time.perf_counter()
        try:
            module, _, func = name.rpartition(".")  # "tf_dga.x": tests/tensorflow/tf_dga.py
            path = module if module.startswith("tests.") else "tests.tensorflow." + module
            body = getattr(importlib.import_module(path), func) \
                if module else globals()[name]
            results[name] = body(**(kwargs or {}).get(name, {}))
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        if times and hvd.rank() == 0:
            with open(times, "a") as f:
                f.write(f"{time.perf_counter() - started:8.1f} s  {name}\n")
    return results


def checkpoint_roundtrip(ckdir, phase, kind):
    """DGC memory through tf.train.Checkpoint, across processes.

    Phase "save": 3 steps of DGC 5% (warm-up by step), checkpoint (one file per
    rank), 3 more steps; the final weights are written next to the checkpoint.
    Phase "resume" (a new horovodrun launch): other initial weights, restore, the
    same 3 steps; the weights must equal the uninterrupted run's bit for bit.
    A control run restores everything but the DGC state and must differ.
    kind: "tape" (hvd.dgc_state) or "keras" (opt.dgc_state; Keras 2 or 3 by env).
    """
    tf = _tf()
    import hvd_dgc.tensorflow as hvd
    import hvd_dgc.tensorflow.keras as hvd_keras
    rank = hvd.rank()
    width = 48  # shapes no other test body uses: tape exchanges are matched by them

    def build(seed):
        variables = _vars(tf, seed=seed, width=width)
        options = dict(density=0.05, warmup=2, warmup_unit="step",
                       warmup_densities=[0.5, 0.2])
        if kind == "tape":
            bufs = [tf.Variable(tf.zeros_like(v)) for v in variables]

            @tf.function
            def step(x, y):
                with tf.GradientTape() as tape:
                    loss = _loss(tf, variables, x, y)
                grads = hvd.DistributedGradientTape(tape, **options).gradient(loss, variables)
                _sgd_momentum_step(tf, variables, grads, bufs, lr=0.05)

            return variables, step, dict(bufs=bufs), hvd.dgc_state
        opt = hvd_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.05, momentum=0.9),
                                             **options)

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = _loss(tf, variables, x, y)
            opt.apply_gradients(zip(tape.gradient(loss, variables), variables))

        return variables, step, dict(optimizer=opt), opt.dgc_state

    path = os.path.join(ckdir, f"{kind}_rank{rank}")
    final = os.path.join(ckdir, f"{kind}_final_rank{rank}.npy")
    if phase == "save":
        variables, step, extra, state = build(seed=5)
        ckpt = tf.train.Checkpoint(variables=variables, dgc=state, **extra)
        for i in range(3):
            step(*_batch(i, rank))
        ckpt.write(path)
        for i in range(3, 6):
            step(*_batch(i, rank))
        np.save(final, _flat(tf, variables).numpy())
        # hvd_dgc's variables in the checkpoint, by key (the exchange's name masked).
        # The tape's registry holds every exchange this process made (other test
        # bodies' too): keep the one of these variables (their shapes are unique).
        shapes = [tuple(v.shape) for v in variables]
        mine = [f"dgc/{name}/" for name, ex in vars(state).items()
                if [t.shape for t in getattr(ex, "tensors", ())] == shapes]
        prefix = mine[0] if kind == "tape" and len(mine) == 1 else "dgc/"
        layout = sorted([re.sub(r"exchange_[0-9a-f]{12}", "exchange_*", key), list(shape)]
                        for key, shape in tf.train.list_variables(path)
                        if key.startswith(prefix))
        return {"saved": True, "layout": layout}

    out = {}
    for restore_dgc in (True, False):
        variables, step, extra, state = build(seed=6)
        # the control leaves out the optimizer too: Keras 2 tracks the memory there
        parts = dict(variables=variables, **(extra if restore_dgc else {}))
        if restore_dgc:
            parts["dgc"] = state
        elif kind == "tape":
            parts["bufs"] = extra["bufs"]
        status = tf.train.Checkpoint(**parts).read(path)
        for i in range(3, 6):
            step(*_batch(i, rank))
        status.assert_existing_objects_matched()
        diff = float(np.max(np.abs(_flat(tf, variables).numpy() - np.load(final))))
        out["restored" if restore_dgc else "without_dgc_state"] = diff
    return out


def tape_bad_inputs():
    """Clear errors: non-float variables, IndexedSlices gradients, bad options."""
    tf = _tf()
    import hvd_dgc.tensorflow as hvd

    def error_of(fn, exc_type):
        try:
            fn()
        except exc_type as exc:
            return str(exc)
        except Exception as exc:
            return f"WRONG EXCEPTION {type(exc).__name__}: {exc}"
        return "NO EXCEPTION"

    out = {}
    counter = tf.Variable(3, name="counter")
    w = tf.Variable(tf.ones([4]), name="w_int_case")

    def int_var():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * w) + tf.cast(counter, tf.float32)
        hvd.DistributedGradientTape(tape).gradient(loss, [w, counter])
    out["int_variable"] = error_of(int_var, TypeError)

    table = tf.Variable(tf.ones([50, 4]), name="embedding")

    def embedding(**kw):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.nn.embedding_lookup(table, [1, 7, 7]))
        grads = hvd.DistributedGradientTape(tape, density=1.0, **kw).gradient(loss, [table])
        return grads[0].numpy()
    grad = embedding(sparse_as_dense=True)  # IndexedSlices as Horovod: tests/test_tf_sparse_grads
    out["sparse_as_dense_rows"] = [float(grad[1, 0]), float(grad[7, 0]), float(grad[0, 0])]
    out["density"] = error_of(lambda: hvd.DistributedGradientTape(tf.GradientTape(),
                                                                  density=1.5), ValueError)
    out["bad_name"] = error_of(lambda: hvd.DistributedGradientTape(
        tf.GradientTape(), compression="dgcc"), ValueError)
    return out


def tape_inconsistent_config():
    tf = _tf()
    import hvd_dgc.tensorflow as hvd
    variables = _vars(tf, seed=4)
    with tf.GradientTape() as tape:
        loss = _loss(tf, variables, *_batch(0, hvd.rank()))
    try:
        hvd.DistributedGradientTape(tape, density=0.01 if hvd.rank() == 0 else 0.02).gradient(
            loss, variables)
    except ValueError as exc:
        return str(exc)
    return "NO EXCEPTION"


def checkpoint_tape(ckdir, phase):
    return checkpoint_roundtrip(ckdir, phase, "tape")


def checkpoint_keras(ckdir, phase):
    return checkpoint_roundtrip(ckdir, phase, "keras")
