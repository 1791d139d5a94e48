"""Bodies of tests/tensorflow/test_sparse_grads.py, run on every rank under horovodrun:
IndexedSlices gradients (embedding lookups) through hvd_dgc.tensorflow, held to
Horovod's own averaging of the same data.

Rank r looks up rows r*10 .. r*10+24 (with repeats): rows 10-24 are seen by both
ranks, 0-9 and 25-34 by one, 35-39 by none."""

import os
import time
import traceback

import numpy as np

from tests.tensorflow.tf_dgc import _identical, _tf

V, D, L, C = 40, 4, 3, 3  # vocabulary, embedding width, lookups per sample, classes
UNSEEN = slice(35, 40)    # rows no rank looks up


def _ids(seed, rank, n):
    rng = np.random.RandomState(seed * 100 + rank)
    return (rng.randint(rank * 10, rank * 10 + 25, (n, L)).astype(np.int32),
            rng.randint(0, C, n).astype(np.int32))


def _error_of(fn):
    try:
        fn()
    except Exception as exc:  # the type is asserted by the test
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": None, "message": "NO EXCEPTION"}


def _everyone_same(tf, hvd, arrays, name):
    return _identical(tf, hvd, [tf.constant(a) for a in arrays], name)


def _newest_exchange():
    from hvd_dgc.tensorflow.tape_exchanges import EXCHANGES as _EXCHANGES
    return list(_EXCHANGES.values())[-1]


def _newest_stats():
    return _newest_exchange().stats()


def _memory_sizes(exchange):
    """Per variable: (residual v, velocity u) sizes; u is [] without momentum."""
    memory = exchange.memory
    return {"v": [int(x.shape[0]) for x in memory.v], "u": [int(x.shape[0]) for x in memory.u]}


# -- DistributedGradientTape on plain tf.Variables (Horovod's own tape works there) ----
def _tape_vars(tf, hidden=0, seed=0):
    rng = np.random.RandomState(seed)
    shapes = [(V, D)] + ([(D, hidden), (hidden,), (hidden, C)] if hidden else [(D, C)]) + [(C,)]
    return [tf.Variable(rng.randn(*s).astype(np.float32) * 0.3, name=f"sp{i}")
            for i, s in enumerate(shapes)]


def _tape_loss(tf, variables, ids, y):
    h = tf.reduce_mean(tf.nn.embedding_lookup(variables[0], ids), 1)
    for i in range(1, len(variables) - 2, 2):
        h = tf.nn.relu(h @ variables[i] + variables[i + 1])
    logits = h @ variables[-2] + variables[-1]
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))


def _optimizer(tf, kind):
    return (tf.keras.optimizers.SGD(0.1, momentum=0.9) if kind == "sgd"
            else tf.keras.optimizers.Adam(0.05))


def _configs(names):
    """"sgd.slices" -> ("sgd", False); "adam.dense" -> ("adam", True) (sparse_as_dense)."""
    return [(n.split(".")[0], n.split(".")[1] == "dense") for n in names]


def tape_equivalence(configs=("sgd.slices", "adam.slices", "sgd.dense"), steps=4):
    """hvd_dgc's tape at density 1 against Horovod's, SGD(momentum 0.9) eager and Adam
    in tf.function, slices kept (sparse_as_dense=False) or densified (True)."""
    tf = _tf()
    import horovod.tensorflow as hvd_stock
    import hvd_dgc.tensorflow as hvd
    rank = hvd.rank()
    out = {}
    for kind, as_dense in _configs(configs):
        runs, returned = [], []
        for who in ("horovod", "hvd_dgc"):
            variables = _tape_vars(tf)
            opt = _optimizer(tf, kind)

            def step(ids, y, variables=variables, opt=opt, who=who, as_dense=as_dense):
                with tf.GradientTape() as tape:
                    loss = _tape_loss(tf, variables, ids, y)
                if who == "horovod":
                    tape = hvd_stock.DistributedGradientTape(tape, sparse_as_dense=as_dense)
                else:
                    tape = hvd.DistributedGradientTape(tape, density=1.0,
                                                       sparse_as_dense=as_dense)
                grads = tape.gradient(loss, variables)
                opt.apply_gradients(zip(grads, variables))
                return grads[0]

            if kind == "adam":
                step = tf.function(step)
            for s in range(steps):
                grad = step(*_ids(s, rank, 8))
            if who == "hvd_dgc":
                returned = type(grad).__name__
                stats = _newest_stats()
            runs.append(np.concatenate([v.numpy().ravel() for v in variables]))
        start = np.concatenate([v.numpy().ravel() for v in _tape_vars(tf)])
        out[f"{kind}.{'dense' if as_dense else 'slices'}"] = {
            "max_diff": float(np.max(np.abs(runs[0] - runs[1]))),
            "moved": float(np.max(np.abs(runs[1] - start))),
            "returned": returned, "paths": stats["paths"],
            "identical": _everyone_same(tf, hvd, [runs[1]], f"spt.{kind}.{as_dense}")}
    return out


def tape_dgc_rows(steps=4, lr=0.1):
    """DGC at 1% inside tf.function with an embedding: the large dense weight goes
    sparse, the table's gradient is every rank's rows averaged (checked each step
    against this step's local gradients, allgathered), ranks stay bit-identical."""
    tf = _tf()
    import hvd_dgc.tensorflow as hvd
    rank = hvd.rank()
    variables = _tape_vars(tf, hidden=512, seed=1)
    returned = []  # the table's gradient type, seen when tracing

    @tf.function
    def step(ids, y):
        with tf.GradientTape(persistent=True) as tape:
            loss = _tape_loss(tf, variables, ids, y)
        local = tf.convert_to_tensor(tape.gradient(loss, variables[0]))
        everyone = hvd.allgather(tf.expand_dims(local, 0), name="sp.local")
        grads = hvd.DistributedGradientTape(tape, density=0.01, min_compress_size=256).gradient(
            loss, variables)
        for v, g in zip(variables, grads):
            if isinstance(g, tf.IndexedSlices):
                v.scatter_sub(tf.IndexedSlices(lr * g.values, g.indices))
            else:
                v.assign_sub(lr * g)
        row_error = tf.reduce_max(tf.abs(tf.convert_to_tensor(grads[0])
                                         - tf.reduce_mean(everyone, 0)))
        returned.append(type(grads[0]).__name__)
        return row_error

    errors = [float(step(*_ids(s, rank, 8))) for s in range(steps)]
    table = variables[0].numpy()
    return {"row_errors": errors, "returned": returned, "stats": _newest_stats(),
            "memory": _memory_sizes(_newest_exchange()),
            "unseen_rows_moved": float(np.max(np.abs(table[UNSEEN] - _tape_vars(
                tf, hidden=512, seed=1)[0].numpy()[UNSEEN]))),
            "identical": _identical(tf, hvd, variables, "sp.dgc")}


def tape_delay_error():
    tf = _tf()
    import hvd_dgc.tensorflow as hvd
    variables = _tape_vars(tf, seed=2)

    def step():
        with tf.GradientTape() as tape:
            loss = _tape_loss(tf, variables, *_ids(0, hvd.rank(), 8))
        hvd.DistributedGradientTape(tape, density=1.0, delay=2).gradient(loss, variables)
    return _error_of(step)


# -- Keras model.fit ------------------------------------------------------------------
def _keras():
    tf = _tf()
    legacy = os.environ.get("TF_USE_LEGACY_KERAS") == "1"
    return tf, tf.keras, legacy


def _model(keras, hidden=0):
    layers = [keras.layers.Input((L,), dtype="int32"), keras.layers.Embedding(V, D),
              keras.layers.GlobalAveragePooling1D()]
    if hidden:
        layers.append(keras.layers.Dense(hidden, activation="relu"))
    return keras.Sequential(layers + [keras.layers.Dense(C)])


def _compile(keras, legacy, model, opt):
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=opt, loss=loss, **({} if legacy else {"jit_compile": False}))
    return loss


def _weights(model):
    return np.concatenate([np.asarray(w).ravel() for w in model.get_weights()])


def _horovod_loop(tf, keras, model, opt, loss_fn, x, y, batch, epochs, as_dense):
    """Horovod's averaging (allreduce of tensors / IndexedSlices) by hand: its Keras
    optimizer does not run under Keras 3 (horovod #4290), its allreduce does."""
    import horovod.tensorflow as hvd_stock
    variables = model.trainable_variables

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, variables)
        if as_dense:
            grads = [tf.convert_to_tensor(g) for g in grads]
        grads = [hvd_stock.allreduce(g, name=f"ref.{i}") for i, g in enumerate(grads)]
        opt.apply_gradients(zip(grads, variables))

    for _ in range(epochs):
        for i in range(0, len(x), batch):
            step(x[i:i + batch], y[i:i + batch])


def keras_fit_equivalence(configs=("sgd.slices", "adam.slices", "sgd.dense", "adam.dense"),
                          batch=8, epochs=2):
    """model.fit with an Embedding: hvd_dgc's optimizer at density 1 against Horovod's
    (its Keras DistributedOptimizer under Keras 2, its allreduce under Keras 3), for
    SGD(momentum 0.9) and Adam, slices kept or sparse_as_dense=True."""
    tf, keras, legacy = _keras()
    import horovod.tensorflow.keras as hvd_stock
    import hvd_dgc.tensorflow.keras as hvd
    rank = hvd.rank()
    x, y = _ids(50, rank, 32)
    keras.utils.set_random_seed(0)
    start = _model(keras).get_weights()
    out = {}
    for kind, as_dense in _configs(configs):
        ours = _model(keras)
        ours.set_weights(start)
        opt = hvd.DistributedOptimizer(_optimizer(tf, kind), density=1.0,
                                       sparse_as_dense=as_dense)
        _compile(keras, legacy, ours, opt)
        ours.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
        ref = _model(keras)
        ref.set_weights(start)
        if legacy:
            _compile(keras, legacy, ref, hvd_stock.DistributedOptimizer(
                _optimizer(tf, kind), sparse_as_dense=as_dense))
            ref.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
        else:
            loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
            _horovod_loop(tf, keras, ref, _optimizer(tf, kind), loss_fn, x, y, batch,
                          epochs, as_dense)
        w0 = np.concatenate([np.asarray(w).ravel() for w in start])
        out[f"{kind}.{'dense' if as_dense else 'slices'}"] = {
            "max_diff": float(np.max(np.abs(_weights(ours) - _weights(ref)))),
            "moved": float(np.max(np.abs(_weights(ours) - w0))),
            "paths": opt.compression_stats()["paths"],
            "identical": _everyone_same(tf, hvd, [_weights(ours)],
                                        f"spk.{kind}.{as_dense}")}
    return out


def keras_fit_dgc(batch=8, epochs=3, lr=0.1):
    """DGC at 1% under model.fit with an Embedding and a Dense large enough to be
    sparsified; SGD with momentum (taken over). The first step's table update is
    checked against the average of every rank's local gradient; then fit goes on."""
    tf, keras, legacy = _keras()
    import hvd_dgc.tensorflow.keras as hvd
    rank = hvd.rank()
    x, y = _ids(60, rank, 32)
    keras.utils.set_random_seed(1)
    model = _model(keras, hidden=512)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(lr, momentum=0.9), density=0.01,
                                   min_compress_size=256)
    loss_fn = _compile(keras, legacy, model, opt)
    table = model.trainable_variables[0]
    before = np.array(table.numpy())
    with tf.GradientTape() as tape:
        loss = loss_fn(y[:batch], model(x[:batch], training=True))
    local = tf.convert_to_tensor(tape.gradient(loss, table))
    average = tf.reduce_mean(hvd.allgather(tf.expand_dims(local, 0), name="spk.local"), 0)
    model.fit(x[:batch], y[:batch], batch_size=batch, epochs=1, shuffle=False, verbose=0)
    first_step_error = float(np.max(np.abs(table.numpy() - (before - lr * average.numpy()))))
    model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    after = table.numpy()
    return {"first_step_error": first_step_error,
            "first_step_moved": float(np.max(np.abs(lr * average.numpy()))),
            "unseen_rows_moved": float(np.max(np.abs(after[UNSEEN] - before[UNSEEN]))),
            "stats": opt.compression_stats(), "memory": _memory_sizes(opt._hvd_dgc),
            "numels": [int(np.prod(v.shape)) for v in model.trainable_variables],
            "identical": _everyone_same(tf, hvd, [_weights(model)], "spk.dgc")}


def keras_delay_error():
    tf, keras, legacy = _keras()
    import hvd_dgc.tensorflow.keras as hvd
    model = _model(keras)
    _compile(keras, legacy, model, hvd.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                            density=1.0, delay=2))
    x, y = _ids(70, hvd.rank(), 8)
    return _error_of(lambda: model.fit(x, y, batch_size=8, epochs=1, verbose=0))


def _poison_model(tf, keras):
    """ids -> Embedding -> (identity; its backward pass is NaN for flagged samples) ->
    mean -> Dense: a NaN in the embedding's gradient alone."""

    class PoisonGrad(keras.layers.Layer):
        def call(self, inputs):
            e, flag = inputs

            @tf.custom_gradient
            def identity(t):
                def grad(dy):
                    bad = tf.reshape(flag, [-1, 1, 1]) > 0
                    return tf.where(bad, tf.constant(float("nan"), dy.dtype), dy)
                return tf.identity(t), grad
            return identity(e)

        def compute_output_shape(self, input_shape):
            return input_shape[0]

    ids = keras.Input((L,), dtype="int32")
    flag = keras.Input((1,))
    e = PoisonGrad()([keras.layers.Embedding(V, D)(ids), flag])
    out = keras.layers.Dense(C)(keras.layers.GlobalAveragePooling1D()(e))
    return keras.Model([ids, flag], out)


def keras_nonfinite_embedding(kinds=("sgd", "adam"), batch=8):
    """Rank 1's embedding gradient is NaN at the middle step of three: every rank
    skips it; the run equals, bit for bit, the run that never had that step."""
    tf, keras, legacy = _keras()
    import hvd_dgc.tensorflow.keras as hvd
    rank = hvd.rank()
    x, y = _ids(80, rank, 3 * batch)
    flag = np.zeros((3 * batch, 1), np.float32)
    if rank == 1:
        flag[batch:2 * batch] = 1.0
    keras.utils.set_random_seed(2)
    start = _poison_model(tf, keras).get_weights()
    keep = np.r_[0:batch, 2 * batch:3 * batch]
    out = {}
    for kind in kinds:
        res = {}
        for tag, rows in (("with_nan", slice(None)), ("without_step", keep)):
            model = _poison_model(tf, keras)
            model.set_weights(start)
            opt = hvd.DistributedOptimizer(_optimizer(tf, kind), density=1.0)
            loss_fn = _compile(keras, legacy, model, opt)
            if tag == "with_nan":  # only the table's local gradient is non-finite, on rank 1
                xb, fb, yb = x[batch:2 * batch], flag[batch:2 * batch], y[batch:2 * batch]
                with tf.GradientTape() as tape:
                    loss = loss_fn(yb, model([xb, fb], training=True))
                grads = tape.gradient(loss, model.trainable_variables)
                res["local_finite"] = [bool(np.all(np.isfinite(tf.convert_to_tensor(g))))
                                       for g in grads]
                res["sliced"] = isinstance(grads[0], tf.IndexedSlices)
            model.fit([x[rows], flag[rows]], y[rows], batch_size=batch, epochs=1,
                      shuffle=False, verbose=0)
            stats = opt.compression_stats()
            res[tag] = {"weights": _weights(model), "nonfinite": stats["nonfinite_steps"],
                        "steps": stats["step"], "iterations": int(opt.iterations.numpy())}
        w, ref = res["with_nan"]["weights"], res["without_step"]["weights"]
        out[kind] = {
            "max_diff_vs_run_without_the_step": float(np.max(np.abs(w - ref))),
            "moved": float(np.max(np.abs(w - np.concatenate([a.ravel() for a in start])))),
            "finite": bool(np.all(np.isfinite(w))),
            "identical": _everyone_same(tf, hvd, [w], f"spn.{kind}"),
            "local_finite": res["local_finite"], "sliced": res["sliced"],
            **{f"{k}_{tag}": res[tag][k] for tag in ("with_nan", "without_step")
               for k in ("nonfinite", "steps", "iterations")}}
    return out


def suite(names, kwargs=None):
    """Run the named bodies; a body that raises reports its traceback."""
    import hvd_dgc.tensorflow as hvd
    hvd.init()
    results, seconds = {}, {}
    for name in names:
        start = time.monotonic()
        try:
            results[name] = globals()[name](**(kwargs or {}).get(name, {}))
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        seconds[name] = round(time.monotonic() - start, 1)
    results["seconds"] = seconds
    return results

