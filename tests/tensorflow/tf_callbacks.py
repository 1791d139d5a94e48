"""Bodies of tests/tensorflow/test_keras_callbacks.py, run on every rank under horovodrun:
hvd_dgc.tensorflow.keras.callbacks in model.fit (Keras 2 or 3 by TF_USE_LEGACY_KERAS)
and Keras 2 legacy optimizers under hvd_dgc's DistributedOptimizer."""

import os
import traceback

import numpy as np

STEPS_PER_EPOCH = 4  # 8 samples per rank, batches of 2


def _tf():
    import tensorflow as tf
    tf.config.threading.set_inter_op_parallelism_threads(2)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    return tf


def _legacy():
    return os.environ.get("TF_USE_LEGACY_KERAS") == "1"


def _compile(model, opt, loss, **kw):
    # Horovod's collectives have no XLA kernels: Keras 3 must not jit the step.
    model.compile(optimizer=opt, loss=loss, **({} if _legacy() else {"jit_compile": False}),
                  **kw)


def _raw(var):
    """A Keras 3 Variable's tf.Variable (local_variables accepts either)."""
    return var if _legacy() else var.value


class _Recorder:
    """Keras callback factory (tf.keras differs between Keras 2 and 3)."""

    @staticmethod
    def make(tf, on_batch_begin=None, on_batch_end=None, on_epoch_end=None):
        class Recorder(tf.keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                if on_batch_begin:
                    on_batch_begin(self.model, batch)

            def on_train_batch_end(self, batch, logs=None):
                if on_batch_end:
                    on_batch_end(self.model, batch)

            def on_epoch_end(self, epoch, logs=None):
                if on_epoch_end:
                    on_epoch_end(self.model, epoch, logs)
        return Recorder()


def _mean_prediction(y_true, y_pred):
    """A loss whose gradient w.r.t. a bias-free Dense(1) kernel is mean(x): known exactly."""
    import tensorflow as tf
    return tf.reduce_mean(y_pred)


def _lr_probe(tf, hvd, opt, callback, epochs, extra=()):
    """Fit a 1-weight model whose averaged gradient is a known constant (rank r feeds
    x = r + 1, so the average over 2 ranks is 1.5); return the weight after every batch,
    so that ``w[t-1] - w[t]`` is the step the optimizer really took."""
    keras = tf.keras
    rank = hvd.rank()
    model = keras.Sequential([keras.layers.Input((1,)),
                              keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
    _compile(model, opt, _mean_prediction)
    weights = [0.0]
    lrs = []
    record = _Recorder.make(
        tf, on_batch_begin=lambda m, b: lrs.append(float(np.asarray(m.optimizer.learning_rate))),
        on_batch_end=lambda m, b: weights.append(float(m.layers[0].kernel.numpy()[0, 0])))
    x = np.full((2 * STEPS_PER_EPOCH, 1), rank + 1.0, np.float32)
    history = model.fit(x, np.zeros_like(x), batch_size=2, epochs=epochs, shuffle=False,
                        verbose=0, callbacks=[callback, *extra, record])
    return {"weights": weights, "lr_seen": lrs, "logged_lr": history.history.get("lr")}


def lr_warmup():
    """LearningRateWarmupCallback over hvd_dgc's SGD (no momentum): steps taken."""
    tf = _tf()
    import hvd_dgc.tensorflow.keras as hvd
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1))
    cb = hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.1, warmup_epochs=2)
    return _lr_probe(tf, hvd, opt, cb, epochs=3)


def lr_schedule(optimizers=("keras",)):
    """LearningRateScheduleCallback: staircase with a constant multiplier inside
    [start, end), smooth with a function and momentum correction over hvd_dgc's
    momentum SGD (DGC holds the momentum)."""
    tf = _tf()
    import hvd_dgc.tensorflow.keras as hvd
    out = {}
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.2))  # 0.2 until start_epoch
    cb = hvd.callbacks.LearningRateScheduleCallback(0.1, 0.5, start_epoch=1, end_epoch=3)
    out["staircase"] = _lr_probe(tf, hvd, opt, cb, epochs=4)
    for kind in optimizers:
        sgd = (tf.keras.optimizers.legacy.SGD if kind == "legacy" else tf.keras.optimizers.SGD)(
            0.1, momentum=0.9)
        opt = hvd.DistributedOptimizer(sgd)
        cb = hvd.callbacks.LearningRateScheduleCallback(
            0.1, lambda epoch: 1.0 / (1.0 + epoch), staircase=False, momentum_correction=True)
        out[f"smooth_momentum_{kind}"] = _lr_probe(tf, hvd, opt, cb, epochs=2)
        out[f"smooth_momentum_{kind}"]["dgc_momentum"] = opt._hvd_dgc.momentum
    return out


def lr_legacy_momentum_correction():
    """Keras 2: a legacy RMSprop's momentum is a variable, corrected as in Horovod."""
    tf = _tf()
    import hvd_dgc.tensorflow.keras as hvd
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.legacy.RMSprop(0.01, momentum=0.5))
    cb = hvd.callbacks.LearningRateWarmupCallback(0.01, warmup_epochs=2)
    momenta = []
    spy = _Recorder.make(tf, on_batch_begin=lambda m, b: momenta.append(
        float(m.optimizer.momentum.numpy())))
    out = _lr_probe(tf, hvd, opt, cb, epochs=3, extra=[spy])
    out["momentum_seen"] = momenta
    out["momentum_after"] = float(opt.momentum.numpy())
    return out


def lr_refusals():
    """What cannot be honoured is refused with the argument and the fix in the message."""
    tf = _tf()
    import hvd_dgc.tensorflow.keras as hvd
    keras = tf.keras
    out = {}

    def error(make_opt, cb):
        model = keras.Sequential([keras.layers.Input((1,)), keras.layers.Dense(1)])
        _compile(model, make_opt(), "mse")  # not distributed: no collective to hang on
        try:
            model.fit(np.ones((4, 1)), np.ones((4, 1)), epochs=1, verbose=0, callbacks=[cb])
        except ValueError as e:
            return str(e)
        return None

    out["momentum_constant"] = error(lambda: keras.optimizers.RMSprop(0.1, momentum=0.9),
                                     hvd.callbacks.LearningRateWarmupCallback(0.1, 1))
    out["momentum_off_ok"] = error(lambda: keras.optimizers.RMSprop(0.1, momentum=0.9),
                                   hvd.callbacks.LearningRateWarmupCallback(
                                       0.1, 1, momentum_correction=False))
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    out["lr_schedule"] = error(lambda: keras.optimizers.SGD(schedule),
                               hvd.callbacks.LearningRateScheduleCallback(0.1, 0.5))
    try:
        hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=["dense/kernel"])
        out["local_not_variable"] = None
    except ValueError as e:
        out["local_not_variable"] = str(e)
    try:
        hvd.callbacks.LearningRateScheduleCallback(None, 0.5)
        out["initial_lr_none"] = None
    except ValueError as e:
        out["initial_lr_none"] = str(e)
    return out


def signatures():
    """Each Horovod callback's parameters (name, default) next to hvd_dgc's, and whether
    ``hvd.callbacks.X`` is ``hvd_dgc.tensorflow.keras.callbacks.X``."""
    import inspect
    import horovod.tensorflow.keras.callbacks as theirs
    import hvd_dgc.tensorflow.keras as hvd
    import hvd_dgc.tensorflow.keras.callbacks as ours

    def params(cls):
        return [(p.name, p.default if p.default is not p.empty else "<required>", p.kind.name)
                for p in list(inspect.signature(cls.__init__).parameters.values())[1:]]
    out = {}
    for name in ("BroadcastGlobalVariablesCallback", "MetricAverageCallback",
                 "LearningRateScheduleCallback", "LearningRateWarmupCallback",
                 "BestModelCheckpoint"):
        out[name] = {"horovod": params(getattr(theirs, name)),
                     "hvd_dgc": params(getattr(ours, name)),
                     "same_object": getattr(hvd.callbacks, name) is getattr(ours, name)}
    return out


def _dataset(rank, n=64):
    rng = np.random.RandomState(100 + rank)
    x = rng.randn(n, 8).astype(np.float32)
    y = (x @ np.linspace(-1, 1, 8).astype(np.float32) * (rank + 1))[:, None]
    return x, y


def _regression_mlp(keras, seed):
    """8 -> 16 -> 1, initialised from ``seed`` (a different model on every rank)."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.layers.Input((8,)), keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(1)])


def metric_average():
    """MetricAverageCallback: logs (train, validation, a rank-dependent custom value)
    before and after it, and what History kept."""
    tf = _tf()
    import hvd_dgc.tensorflow.keras as hvd
    keras = tf.keras
    rank = hvd.rank()
    model = _regression_mlp(keras, seed=rank)
    _compile(model, hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), "mse",
             metrics=["mae"])
    before, after = [], []

    def mark(m, epoch, logs):
        logs["rank_value"] = 10.0 * rank + epoch
        before.append({k: float(v) for k, v in logs.items()})

    x, y = _dataset(rank)
    history = model.fit(
        x, y, batch_size=16, epochs=2, verbose=0, validation_data=_dataset(rank + 7, 16),
        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                   _Recorder.make(tf, on_epoch_end=mark),
                   hvd.callbacks.MetricAverageCallback(),
                   _Recorder.make(tf, on_epoch_end=lambda m, e, logs: after.append(
                       {k: float(v) for k, v in logs.items()}))])
    return {"before": before, "after": after,
            "history": {k: [float(v) for v in vs] for k, vs in history.history.items()}}


def broadcast_local():
    """BroadcastGlobalVariablesCallback(local_variables=...) on a model and an Adam whose
    state differ between ranks: every value before and after the broadcast."""
    tf = _tf()
    import hvd_dgc.tensorflow.keras as hvd
    keras = tf.keras
    rank = hvd.rank()
    model = _regression_mlp(keras, seed=rank)
    opt = keras.optimizers.Adam(0.01)  # not distributed: every rank's own state
    _compile(model, opt, "mse")
    model.fit(*_dataset(rank), batch_size=16, epochs=1, verbose=0)
    from hvd_dgc.tensorflow.keras_optimizers import optimizer_variables
    local = [model.layers[0].kernel, _raw(model.layers[1].bias)]
    names = ["kernel0", "bias0", "kernel1", "bias1"]
    opt_vars = [v for v in optimizer_variables(opt) if len(v.shape) > 0]  # Adam's slots

    def snapshot():
        return {"model": dict(zip(names, [v.numpy().copy() for v in model.variables])),
                "optimizer": [v.numpy().copy() for v in opt_vars]}

    out = {"before": snapshot()}
    cb = hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=local)
    cb.set_model(model)
    cb.on_train_begin({})
    out["after"] = snapshot()
    out["local"] = ["kernel0", "bias1"]
    out["n_optimizer_slots"] = len(opt_vars)
    return out


def best_checkpoint(ckdir):
    """BestModelCheckpoint on a monitored value 3, 1, 2, 0 (epochs 1-4): which files each
    rank wrote, and whether the last one holds the final weights."""
    tf = _tf()
    import hvd_dgc.tensorflow.keras as hvd
    keras = tf.keras
    rank = hvd.rank()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Input((8,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    _compile(model, hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), "mse")
    folder = os.path.join(ckdir, "keras2" if _legacy() else "keras3", f"rank{rank}")
    path = os.path.join(folder, "best-{epoch:02d}.weights.h5")
    if _legacy():  # Horovod's way: the filepath set after construction
        best = hvd.callbacks.BestModelCheckpoint(monitor="score", mode="min",
                                                 save_weights_only=True)
        best.filepath = path
    else:
        best = hvd.callbacks.BestModelCheckpoint(monitor="score", mode="min",
                                                 save_weights_only=True, filepath=path)
    scores = [3.0, 1.0, 2.0, 0.0]
    inject = _Recorder.make(tf, on_epoch_end=lambda m, e, logs: logs.update(
        score=scores[e] + rank))  # averaged to scores[e] + 0.5 on both ranks
    model.fit(*_dataset(rank), batch_size=16, epochs=4, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), inject,
                         hvd.callbacks.MetricAverageCallback(), best])
    files = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    out = {"files": files, "last_matches_final": None}
    if files:
        final = [v.numpy().copy() for v in model.weights]
        model.load_weights(os.path.join(folder, files[-1]))
        out["last_matches_final"] = max(float(np.max(np.abs(a - v.numpy())))
                                        for a, v in zip(final, model.weights))
    unset = hvd.callbacks.BestModelCheckpoint(monitor="loss")
    unset.set_model(model)
    try:
        unset.on_train_begin({})  # rank 0 writes, so rank 0 needs a path
        out["unset_error"] = None
    except ValueError as e:
        out["unset_error"] = str(e)
    return out


def legacy_sgd_takeover(steps=8):
    """Keras 2: legacy SGD(momentum) under hvd_dgc at density 1 == legacy SGD(momentum)
    on gradients averaged by hand (DGC holds the momentum, the optimizer runs with 0)."""
    tf = _tf()
    import hvd_dgc.tensorflow.keras as hvd
    keras = tf.keras
    rank = hvd.rank()
    rng = np.random.RandomState(0)
    init = [0.3 * rng.randn(*shape).astype(np.float32) for shape in ((8, 16), (16,), (16, 1))]
    runs = []
    for k in range(2):
        variables = [tf.Variable(a) for a in init]
        sgd = keras.optimizers.legacy.SGD(0.01, momentum=0.9)
        opt = sgd if k == 0 else hvd.DistributedOptimizer(sgd, density=1.0)
        for step in range(steps):
            x, y = _dataset(rank + 10 * step, 16)
            with tf.GradientTape() as tape:
                h = tf.nn.relu(x @ variables[0] + variables[1])
                loss = tf.reduce_mean((h @ variables[2] - y) ** 2)
            grads = tape.gradient(loss, variables)
            if k == 0:
                grads = [hvd.allreduce(g, name=f"ref.{i}") for i, g in enumerate(grads)]
            opt.apply_gradients(zip(grads, variables))
        runs.append(np.concatenate([v.numpy().ravel() for v in variables]))
        if k == 1:
            own_momentum = float(opt.momentum.numpy())
            dgc_momentum = opt._hvd_dgc.momentum
    return {"max_diff": float(np.max(np.abs(runs[0] - runs[1]))),
            "moved": float(np.max(np.abs(runs[0] - np.concatenate([a.ravel() for a in init])))),
            "own_momentum": own_momentum, "dgc_momentum": dgc_momentum}


def _digits(rank, size):
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    perm = np.random.RandomState(0).permutation(len(y))
    test, train = perm[:360], perm[360:]
    shard = train[rank::size]
    return (x[shard], y[shard]), (x[test], y[test])


def legacy_fit_digits(epochs=8):
    """Keras 2 legacy SGD(momentum) and Adam under hvd_dgc in model.fit on digits: DGC
    at 1% (a 4096-value kernel goes sparse; Adam taken over, its variance frozen at step
    20) vs density=1.0; test accuracy and bytes."""
    tf = _tf()
    import hvd_dgc.tensorflow.keras as hvd
    keras = tf.keras
    rank, size = hvd.rank(), hvd.size()
    (x, y), (xt, yt) = _digits(rank, size)
    out = {}
    for name, make in (("sgd", lambda: keras.optimizers.legacy.SGD(0.05, momentum=0.9)),
                       ("adam", lambda: keras.optimizers.legacy.Adam(0.003))):
        for tag, options in (("dense", {"density": 1.0}),
                             ("dgc", {"density": 0.01, "warmup": 2})):
            if name == "adam" and tag == "dgc":
                options = dict(options, freeze_variance=20)
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.layers.Input((64,)),
                                      keras.layers.Dense(64, activation="relu"),
                                      keras.layers.Dense(10)])
            opt = hvd.DistributedOptimizer(make(), **options)
            model.compile(optimizer=opt, metrics=["accuracy"],
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            history = model.fit(x, y, batch_size=32, epochs=epochs, verbose=0,
                                callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                           hvd.callbacks.DGCCallback(verbose=0),
                                           hvd.callbacks.MetricAverageCallback()])
            acc = float(np.mean(np.argmax(model.predict(xt, verbose=0), 1) == yt))
            flat = tf.concat([tf.reshape(v, [-1]) for v in model.trainable_variables], 0)
            everyone = hvd.allgather(tf.expand_dims(flat, 0), name=f"fit.{name}.{tag}").numpy()
            stats = opt.compression_stats()
            out[f"{name}_{tag}"] = {
                "accuracy": acc, "loss": history.history["loss"][-1],
                "ratio": stats["compression_ratio"], "paths": stats["paths"],
                "identical": all(np.array_equal(everyone[0], e) for e in everyone),
                "class": next(c for c in type(opt).__mro__[1:]  # the user's class
                              if not c.__module__.startswith("hvd_dgc")).__module__}
    return out


def suite(names, kwargs=None):
    """Run the named scenarios in one launch; an error is returned, not raised, so the
    other scenarios still report."""
    import hvd_dgc.tensorflow as hvd
    hvd.init()
    results = {}
    for name in names:
        try:
            results[name] = globals()[name](**(kwargs or {}).get(name, {}))
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    return results
