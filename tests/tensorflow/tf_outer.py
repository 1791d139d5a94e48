"""The outer loop in Keras (``DistributedOptimizer(opt, outer=hvd_dgc.OuterLoop(...))``,
hvd_dgc/tensorflow/outer.py) on every rank: bodies of tests/tensorflow/test_outer.py, run under
horovodrun by tests/tensorflow/tf_dgc.py's suite ("tf_outer.<name>"), Keras 2 (tf_keras) or
Keras 3 by TF_USE_LEGACY_KERAS."""

import os

import numpy as np

from hvd_dgc.outer import OuterLoop
from tests import reference as ref
from tests.tensorflow.tf_callbacks import _digits
from tests.tensorflow.tf_dgc import _identical, _tf


def _flat(tf, variables):
    return np.concatenate([np.asarray(tf.convert_to_tensor(v)).reshape(-1)
                           for v in variables])


def _quadratic(tag, steps, lr, **options):
    """Two tensors pulled towards per-rank, per-step targets (gradient ``x - T``), Keras'
    SGD inside, every step in one ``tf.function``: tests/torch/test_outer.py's replay."""
    tf = _tf()
    import hvd_dgc.tensorflow.keras as hvd
    rng = np.random.RandomState(7)
    w = tf.Variable(rng.randn(40, 50).astype(np.float32), name=f"w_{tag}")
    b = tf.Variable(rng.randn(30).astype(np.float32), name=f"b_{tag}")
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(lr), **options)

    @tf.function
    def step(tw, tb):
        with tf.GradientTape() as tape:
            loss = 0.5 * tf.reduce_sum((w - tw) ** 2) + 0.5 * tf.reduce_sum((b - tb) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, [w, b]), [w, b]))

    start = _flat(tf, [w, b]).tolist()
    for i in range(steps):
        step(*ref.outer_targets(i, hvd.rank()))
    out = {"start": start, "final": _flat(tf, [w, b]).tolist(),
           "identical": _identical(tf, hvd, [w, b], f"tf_outer.q.{tag}"),
           "stats": opt.compression_stats(), "in_flight": opt.in_flight,
           "ended": opt.flush()}
    out.update(flushed=_flat(tf, [w, b]).tolist(), flushed_stats=opt.compression_stats(),
               identical_after_flush=_identical(tf, hvd, [w, b], f"tf_outer.qf.{tag}"),
               ended_again=opt.flush())
    return out


def reference_quadratic():
    outer = OuterLoop(steps=3, lr=0.7, momentum=0.9, nesterov=True)
    return {name: _quadratic(name, steps, 0.1, outer=outer._replace(**changes), **options)
            for name, (steps, changes, options, _) in ref.OUTER_RUNS.items()}


def overlap_checkpoint_needs_flush(ckdir):
    """With a round's exchange in flight a checkpoint is refused, naming flush(); after
    flush() it is written, and the ranks hold the same weights."""
    tf = _tf()
    import hvd_dgc.tensorflow.keras as hvd
    keras = tf.keras
    model = _mlp(keras, 2)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.05),
                                   outer=hvd.OuterLoop(steps=2, overlap=True))
    step = _train_step(tf, model, opt)
    for i in range(4):
        step(*_batch(i, hvd.rank()))
    ckpt = tf.train.Checkpoint(model=model, optimizer=opt, dgc=opt.dgc_state)
    path = os.path.join(ckdir, f"overlap_rank{hvd.rank()}")
    try:
        ckpt.write(path)
        refused = "NO EXCEPTION"
    except RuntimeError as exc:
        refused = str(exc)
    in_flight = opt.in_flight
    opt.flush()
    ckpt.write(path)
    try:
        hvd.elastic.KerasState(model, opt, batch=0)
        elastic = "NO EXCEPTION"
    except ValueError as exc:
        elastic = str(exc)
    return {"refused": refused, "in_flight": in_flight, "after_flush": opt.in_flight,
            "saved": any(key.startswith("dgc/start") for key, _ in
                         tf.train.list_variables(path)),
            "identical": _identical(tf, hvd, model.trainable_variables, "tf_outer.ovck"),
            "elastic": elastic}


def _mlp(keras, seed, features=12, hidden=40, classes=6):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.layers.Input((features,)),
                             keras.layers.Dense(hidden, activation="tanh"),
                             keras.layers.Dense(classes)])


def _batch(step, rank, n=16, features=12, classes=6):
    rng = np.random.RandomState(1000 * step + rank)
    return (rng.randn(n, features).astype(np.float32),
            rng.randint(0, classes, n).astype(np.int32))


def _train_step(tf, model, opt):
    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
                y, model(x), from_logits=True))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))
        return loss
    return step


def sync_equivalence():
    """H = 1, the change sent whole, outer SGD of lr 1: synchronous training (hvd_dgc's
    optimizer at density 1.0, an allreduce of the gradients, beside it)."""
    tf = _tf()
    import hvd_dgc.tensorflow.keras as hvd
    keras = tf.keras
    outer_model, sync_model = _mlp(keras, 3), _mlp(keras, 3)
    outer_step = _train_step(tf, outer_model, hvd.DistributedOptimizer(
        keras.optimizers.SGD(0.05), outer=OuterLoop(steps=1, lr=1.0, momentum=0.0,
                                                    nesterov=False)))
    sync_step = _train_step(tf, sync_model, hvd.DistributedOptimizer(
        keras.optimizers.SGD(0.05), density=1.0))
    start = _flat(tf, outer_model.trainable_variables)
    diffs, identical = [], []
    for i in range(12):
        x, y = _batch(i, hvd.rank())
        outer_step(x, y)
        sync_step(x, y)
        diffs.append(float(np.max(np.abs(_flat(tf, outer_model.trainable_variables)
                                         - _flat(tf, sync_model.trainable_variables)))))
        identical.append(_identical(tf, hvd, outer_model.trainable_variables,
                                    f"tf_outer.sync.{i}"))
    moved = float(np.max(np.abs(_flat(tf, outer_model.trainable_variables) - start)))
    return {"diffs": diffs, "identical": identical, "moved": moved}


def fit_adamw_digits(epochs=4):
    """AdamW inside ``model.fit`` on digits, 4 inner steps a round, 5% of the 64x64
    kernel's change sent; the weights of rank 1 start other than rank 0's (the callback
    broadcasts them)."""
    tf = _tf()
    import hvd_dgc.tensorflow.keras as hvd
    keras = tf.keras
    rank, size = hvd.rank(), hvd.size()
    (x, y), (xt, yt) = _digits(rank, size)
    keras.utils.set_random_seed(11 + rank)
    model = keras.Sequential([keras.layers.Input((64,)),
                              keras.layers.Dense(64, activation="tanh"),
                              keras.layers.Dense(64, activation="tanh"),
                              keras.layers.Dense(10)])
    opt = hvd.DistributedOptimizer(keras.optimizers.AdamW(3e-3, weight_decay=0.01),
                                   outer=hvd.OuterLoop(steps=4), density=0.05,
                                   min_compress_size=1000)
    model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], jit_compile=False)
    callback = hvd.callbacks.DGCCallback(verbose=0)
    history = model.fit(x, y, batch_size=32, epochs=epochs, verbose=0, shuffle=False,
                        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                   callback])
    _, accuracy = model.evaluate(xt, yt, verbose=0)
    return {"loss": [float(v) for v in history.history["loss"]],
            "accuracy": float(accuracy), "stats": opt.compression_stats(),
            "steps_per_epoch": int(np.ceil(len(y) / 32)),
            "logged_density": [float(v) for v in history.history["dgc_density"]],
            "identical": _identical(tf, hvd, model.trainable_variables, "tf_outer.fit"),
            "numels": [int(np.prod(v.shape)) for v in model.trainable_variables]}


def checkpoint_resumes_exactly(ckdir):
    """A checkpoint in the middle of a round (the shared weights, outer momentum,
    residual, counts and Keras' own momentum), restored into a new model and optimizer
    before their first step, resumes bit for bit."""
    tf = _tf()
    import hvd_dgc.tensorflow.keras as hvd
    keras = tf.keras
    path = os.path.join(ckdir, f"outer_rank{hvd.rank()}")

    def build(seed):
        model = _mlp(keras, seed)
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9),
                                       outer=OuterLoop(steps=4), density=0.1,
                                       min_compress_size=100)
        return model, opt, _train_step(tf, model, opt), tf.train.Checkpoint(
            model=model, optimizer=opt, dgc=opt.dgc_state)

    model, opt, step, ckpt = build(4)
    for i in range(6):
        step(*_batch(i, hvd.rank()))
    ckpt.write(path)
    for i in range(6, 14):
        step(*_batch(i, hvd.rank()))
    resumed, resumed_opt, resumed_step, resumed_ckpt = build(9)
    status = resumed_ckpt.read(path)
    for i in range(6, 14):
        resumed_step(*_batch(i, hvd.rank()))
    status.assert_existing_objects_matched()
    stats = resumed_opt.compression_stats()
    return {"equal": bool(np.array_equal(_flat(tf, model.trainable_variables),
                                         _flat(tf, resumed.trainable_variables))),
            "rounds": stats["rounds"], "inner": stats["inner_steps"],
            "saved": sorted(key for key, _ in tf.train.list_variables(path)
                            if key.startswith("dgc/"))}


def elastic_sync_takes_rank_0s_round():
    """``hvd.elastic.KerasState``'s sync (what a reset runs on every rank): rank 1, with
    other weights and no step taken (a worker that joins), takes rank 0's shared weights,
    outer momentum and counts, and goes on in step with it."""
    os.environ["HOROVOD_ELASTIC"] = "1"  # as under horovodrun --min-np: each builds alone
    try:
        return _elastic_sync()
    finally:
        del os.environ["HOROVOD_ELASTIC"]


def _elastic_sync():
    tf = _tf()
    import hvd_dgc.tensorflow.keras as hvd
    keras = tf.keras
    rank = hvd.rank()
    model = _mlp(keras, 6 + rank)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9),
                                   outer=OuterLoop(steps=2))
    rounds = opt.dgc_state
    if rank == 0:  # rank 0 alone has stepped: its round's state, as if it had a partner
        variables = model.trainable_variables
        rounds.build(variables)
        for a, v in zip(rounds.anchor, variables):
            a.assign(tf.reshape(tf.convert_to_tensor(v), [-1]) + 0.5)
        rounds.started.assign(True)
        rounds.inner.assign(5)
        rounds.round_began.assign(4)
        rounds.rounds.assign(2)
        for b in rounds.buffer:
            b.assign(tf.ones_like(b))
    state = hvd.elastic.KerasState(model, opt, batch=0, epoch=0)
    state.sync()
    step = _train_step(tf, model, opt)
    step(*_batch(0, rank))  # step 6: the round that began at 4 ends here, on both ranks

    counts = [int(t.numpy()) for t in (rounds.inner, rounds.round_began, rounds.rounds)]
    return {"counts": counts,
            "shared": _identical(tf, hvd, rounds.anchor + rounds.buffer,
                                 "tf_outer.elastic.state"),
            "weights_identical": _identical(tf, hvd, model.trainable_variables,
                                            "tf_outer.elastic.w")}


def refusals():
    """What the Keras outer loop cannot honour, named with the fix."""
    tf = _tf()
    import hvd_dgc.tensorflow.keras as hvd
    sgd = tf.keras.optimizers.SGD(0.1)

    def error_of(**kwargs):
        try:
            hvd.DistributedOptimizer(sgd, **kwargs)
        except (ValueError, TypeError) as exc:
            return str(exc)
        return "NO EXCEPTION"
    try:
        hvd.DistributedOptimizer(sgd, outer=OuterLoop()).register_local_var(
            tf.Variable([1.0], name="mine"))
        local = "NO EXCEPTION"
    except ValueError as exc:
        local = str(exc)
    return {"local": local,
            "passes": error_of(outer=OuterLoop(), backward_passes_per_step=2),
            "delay": error_of(outer=OuterLoop(steps=8), delay=2),
            "powersgd": error_of(outer=OuterLoop(), compression=hvd.Compression.powersgd),
            "sum": error_of(outer=OuterLoop(), op=hvd.Sum),
            "not_outer": error_of(outer=8)}
