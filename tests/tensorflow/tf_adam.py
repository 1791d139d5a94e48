"""Bodies of tests/tensorflow/test_adam.py, run on every rank under horovodrun: Keras' Adam and
AdamW taken over (hvd_dgc/tensorflow/adam.py) against the NumPy reference
(tests/reference.py) step by step, in model.fit on digits, through a checkpoint.
Keras 2 (tf_keras, with its legacy Adam) or Keras 3 by TF_USE_LEGACY_KERAS; run by
tests/tensorflow/tf_dgc.py's suite ("tf_adam.<name>")."""

import os

import numpy as np

from hvd_dgc.adam import VARIANCE_FLOOR
from tests import reference as ref
from tests.tensorflow.tf_callbacks import _digits
from tests.tensorflow.tf_dgc import _identical, _tf

FEATURES, HIDDEN, CLASSES = 12, 40, 6


def _legacy():
    return os.environ.get("TF_USE_LEGACY_KERAS") == "1"


def _classes():
    """(label, make(lr, betas, eps, wd), Keras' decoupled decay) per optimizer."""
    tf = _tf()
    opts = tf.keras.optimizers
    out = [("AdamW", lambda lr, b, e, wd: opts.AdamW(lr, weight_decay=wd, beta_1=b[0],
                                                     beta_2=b[1], epsilon=e), True),
           ("Adam", lambda lr, b, e, wd: opts.Adam(lr, beta_1=b[0], beta_2=b[1], epsilon=e),
            False)]
    if _legacy():
        out.append(("legacy.Adam", lambda lr, b, e, wd: opts.legacy.Adam(
            lr, beta_1=b[0], beta_2=b[1], epsilon=e), False))
    return out


def _model(keras, seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.layers.Input((FEATURES,)),
                             keras.layers.Dense(HIDDEN, activation="tanh"),
                             keras.layers.Dense(CLASSES)])


def _batch(step, rank, n=8):
    rng = np.random.RandomState(1000 * step + rank)
    return (rng.randn(n, FEATURES).astype(np.float32),
            rng.randint(0, CLASSES, n).astype(np.int32))


def _loss(tf, model, x, y):
    return tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
        y, model(x), from_logits=True))


def _flat(weights):
    return [np.asarray(w, np.float32).reshape(-1).copy() for w in weights]


def _grads_at(tf, model, weights, x, y):
    """The flat gradients at ``weights`` (the model's weights are left at them)."""
    for var, w in zip(model.trainable_variables, weights):
        var.assign(np.reshape(w, var.shape))
    with tf.GradientTape() as tape:
        loss = _loss(tf, model, x, y)
    return _flat(t.numpy() for t in tape.gradient(loss, model.trainable_variables))


def _reference(tf, model, start, steps, world, freeze, lr, betas, eps, wd, clip=None):
    """Keras' Adam on the average of every rank's (clipped) gradient to the freeze, then
    the memory's momentum on the scaled average (dense: everything sent); the weights
    after each step. Keras decays AdamW's weights before the step, in both phases."""
    x = [a.copy() for a in start]
    n = len(x)
    m, v = [np.zeros_like(a) for a in x], [np.zeros_like(a) for a in x]
    out = []
    for step in range(steps):
        t = step + 1
        per_rank = [[ref.local_gradient(g, clip, world)
                     for g in _grads_at(tf, model, x, *_batch(step, r))] for r in range(world)]
        avg = [ref.average([g[i] for g in per_rank]) for i in range(n)]
        if step < freeze:
            for i in range(n):
                x[i], m[i], v[i] = ref.keras_adam(x[i], m[i], v[i], avg[i], t, lr, betas, eps, wd)
            if t == freeze:
                pre = [ref.frozen_precondition(v[i], t, betas, eps, VARIANCE_FLOOR, keras=True)
                       for i in range(n)]
                u = [pre[i] * m[i] for i in range(n)]
        else:
            for i in range(n):
                u[i] = np.float32(betas[0]) * u[i] + ref.frozen_adam_gradient(avg[i], pre[i],
                                                                              betas[0])
                if wd:
                    x[i] = x[i] - x[i] * np.float32(wd) * np.float32(lr)
                x[i] = ref.frozen_adam_apply(x[i], u[i], t, lr, betas[0])
        out.append([a.copy() for a in x])
    return out


def _train_step(tf, model, opt):
    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = _loss(tf, model, x, y)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))
    return step


def _scales(opt):
    """The frozen scales among the optimizer's variables."""
    from hvd_dgc.tensorflow.keras_optimizers import optimizer_variables
    return [v for v in optimizer_variables(opt)
            if "hvd_dgc_scale" in (getattr(v, "path", None) or v.name)]


def reference_equivalence():
    """Each Adam taken over, at density 1 (the dense path; allgather sending every
    coordinate, with DGC's local clipping), equals the reference step by step."""
    tf = _tf()
    import hvd_dgc.tensorflow.keras as hvd
    rank, world = hvd.rank(), hvd.size()
    steps, freeze, lr, betas, eps, wd = 8, 3, 0.01, (0.9, 0.99), 1e-7, 0.05
    # (one optimizer built a variant: each build traces its step twice, seconds each)
    variants = (("dense", dict(min_compress_size=10 ** 9)),
                ("allgather_clipped", dict(density=1.0, aggregation="allgather",
                                           min_compress_size=64, clip_norm=0.05)))
    results = {}
    for label, make, decoupled in _classes():
        decay = wd if decoupled else 0.0
        shadow = _model(tf.keras, 0)
        start = _flat(v.numpy() for v in shadow.trainable_variables)
        unclipped = _reference(tf, shadow, start, steps, world, freeze, lr, betas, eps, decay)
        for variant, options in variants:
            expected = unclipped if options.get("clip_norm") is None else _reference(
                tf, shadow, start, steps, world, freeze, lr, betas, eps, decay,
                clip=options["clip_norm"])
            model = _model(tf.keras, 0)
            opt = hvd.DistributedOptimizer(make(lr, betas, eps, decay),
                                           compression=hvd.Compression.dgc,
                                           freeze_variance=freeze, **options)
            step, diffs, phases = _train_step(tf, model, opt), [], []
            for s in range(steps):
                step(*_batch(s, rank))
                ours = _flat(v.numpy() for v in model.trainable_variables)
                diffs.append(max(float(np.abs(a - b).max())
                                 for a, b in zip(ours, expected[s])))
                phases.append(opt.compression_stats()["adam_phase"])
            scales = _scales(opt)
            results[f"{label}.{variant}"] = {
                "diffs": diffs, "phases": phases,
                "moved": max(float(np.abs(a - b).max())
                             for a, b in zip(expected[-1], expected[freeze - 1])),
                "identical": _identical(tf, hvd, model.trainable_variables,
                                        f"adam.{label}.{variant}"),
                "scales": len(scales),
                "scales_set": all(float(np.abs(s.numpy() - 1).max()) > 0.1 for s in scales),
                "paths": opt.compression_stats()["paths"],
                "clipped": max(float(np.abs(a - b).max())
                               for a, b in zip(expected[-1], unclipped[-1])) > 1e-3}
    return results


def _reference_delay(tf, model, start, steps, world, freeze, lr, betas, eps, wd, delay,
                     batches=None, period=1, refresh=(), compress=None):
    """tests/reference.py ``delayed_frozen_adam`` with Keras' Adam, each rank's gradients
    at its own weights on its batch; ``batches``: which batch each step takes (default:
    step i the i-th)."""
    batches = list(range(steps)) if batches is None else batches
    return ref.delayed_frozen_adam(
        start, lambda x, step, r: _grads_at(tf, model, x, *_batch(batches[step], r)), steps,
        world, freeze, lr, betas, eps, wd, delay, VARIANCE_FLOOR, keras=True, period=period,
        refresh=refresh, compress=compress)


def declined_on_a_fast_link(steps=26):
    """Keras AdamW with no option where the cost model sends every tensor dense: not
    taken over, exact Adam past the default freeze (step 20), the weights those of
    ``density=1.0`` (dense averaging, Adam untouched); on 1 Gbit/s it is taken over."""
    tf = _tf()
    import hvd_dgc.tensorflow.keras as hvd
    from hvd_dgc import CostModel
    rank = hvd.rank()
    # DGC's selection and the sign's encoding cost more than the dense allreduce
    fast = CostModel(bandwidth=1e11, select_element_seconds=1e-5, encode_element_seconds=1e-5)
    runs = {}
    # "later": a first stage (0.5, steps 3 to 6) that goes dense where selecting a record
    # costs 1 us, the final 0.05 sparse: the freeze moves from step 3 to 7
    later = {"cost_model": CostModel(select_record_seconds=1e-6), "freeze_variance": 3,
             "density": 0.05, "warmup": 4, "warmup_unit": "step", "warmup_densities": (0.5,)}
    phases = []
    for tag, options in (("fast", {"cost_model": fast}), ("dense", {"density": 1.0}),
                         ("slow", {}), ("later", later)):
        model = _model(tf.keras, 0)
        opt = hvd.DistributedOptimizer(tf.keras.optimizers.AdamW(0.01), min_compress_size=64,
                                       **options)
        step = _train_step(tf, model, opt)
        weights = []
        for s in range(steps):
            step(*_batch(s, rank))
            weights.append(_flat(v.numpy() for v in model.trainable_variables))
            if tag == "later":
                phases.append(opt.compression_stats()["adam_phase"])
        stats = opt.compression_stats()
        runs[tag] = (weights, stats, opt._hvd_dgc)

    def diffs(a, b):
        return [max(float(np.abs(x - y).max()) for x, y in zip(wa, wb))
                for wa, wb in zip(runs[a][0], runs[b][0])]
    return {"diff": max(diffs("fast", "dense")),
            "phase": runs["fast"][1]["adam_phase"], "freeze": runs["fast"][1]["adam_freeze"],
            "paths": runs["fast"][1]["paths"], "slow_phase": runs["slow"][1]["adam_phase"],
            # with no option: 0/1 Adam where taken over, its period dropped where declined
            "periods": {tag: runs[tag][2].period for tag in ("fast", "slow")},
            "compressors": {tag: type(runs[tag][2].compression).__name__
                            for tag in ("fast", "slow")},
            "later": {"diffs": diffs("later", "dense"), "phases": phases,
                      "freeze": runs["later"][1]["adam_freeze"],
                      "paths": runs["later"][1]["paths"]}}


def refresh_reference():
    """Each Adam taken over with its variance refreshed every 2nd step after a freeze at
    step 3 (at the ends of steps 5, 7 and 9), dense, synchronous (AdamW also with
    delay=2): the reference PyTorch's refresh is held to, with Keras' forms, step by step
    on each rank; the refreshes counted, each one dense exchange more."""
    tf = _tf()
    import hvd_dgc.tensorflow.keras as hvd
    rank, world = hvd.rank(), hvd.size()
    steps, freeze, lr, betas, eps, wd = 10, 3, 0.01, (0.9, 0.99), 1e-7, 0.05
    runs = [(label, make, decoupled, 0) for label, make, decoupled in _classes()]
    runs.append(_classes()[0] + (2,))
    results = {}
    for label, make, decoupled, delay in runs:
        decay = wd if decoupled else 0.0
        shadow = _model(tf.keras, 0)
        start = _flat(v.numpy() for v in shadow.trainable_variables)
        numel = sum(a.size for a in start)
        per_rank, flushed = _reference_delay(tf, shadow, start, steps, world, freeze, lr,
                                             betas, eps, decay, delay, refresh={5, 7, 9})
        plain, _ = _reference_delay(tf, shadow, start, steps, world, freeze, lr, betas, eps,
                                    decay, delay)
        model = _model(tf.keras, 0)
        opt = hvd.DistributedOptimizer(make(lr, betas, eps, decay), freeze_variance=freeze,
                                       refresh_variance=2, min_compress_size=10 ** 9,
                                       compression=hvd.Compression.dgc, delay=delay)
        step, diffs, refreshes, sent = _train_step(tf, model, opt), [], [], []
        before = 0  # (no statistics before the first step builds the exchange)
        for s in range(steps):
            step(*_batch(s, rank))
            ours = _flat(v.numpy() for v in model.trainable_variables)
            diffs.append(max(float(np.abs(a - b).max()) for a, b in zip(ours, per_rank[rank][s])))
            stats = opt.compression_stats()
            refreshes.append(stats["adam_refreshes"])
            sent.append(round((stats["bytes_sent"] - before) / (4 * numel), 6))
            before = stats["bytes_sent"]
        opt.flush()
        ours = _flat(v.numpy() for v in model.trainable_variables)
        results[f"{label}.delay{delay}"] = {
            "diffs": diffs, "refreshes": refreshes, "dense_steps_sent": sent,
            "flushed_diff": max(float(np.abs(a - b).max()) for a, b in zip(ours, flushed)),
            "identical": _identical(tf, hvd, model.trainable_variables,
                                    f"adamr.{label}.{delay}"),
            "refreshed": max(float(np.abs(a - b).max())
                             for a, b in zip(per_rank[rank][-1], plain[rank][-1]))}
    return results


def sign_reference():
    """Keras' AdamW taken over with ``compression=Compression.sign`` (1-bit Adam): exact
    Adam on dense averages to the freeze (step 3), then each rank's memory sends the
    scaled sign of what it holds and keeps the rest (tests/reference.py ``sign_sent``);
    synchronous with the variance refreshed every 2nd step, with delay=2, and with
    period=2 (0/1 Adam's local steps): the reference PyTorch's is held to, step by step
    on each rank, and after the flush."""
    tf = _tf()
    import hvd_dgc.tensorflow.keras as hvd
    from hvd_dgc.tensorflow import Compression
    rank, world = hvd.rank(), hvd.size()
    steps, freeze, lr, betas, eps, wd = 10, 3, 0.01, (0.9, 0.99), 1e-7, 0.05
    label, make, _ = _classes()[0]  # AdamW
    shadow = _model(tf.keras, 0)
    start = _flat(v.numpy() for v in shadow.trainable_variables)
    large = 200  # min_compress_size: the two kernels go sign, the biases dense
    compress = [ref.sign_sent if a.size >= large else None for a in start]
    results = {}
    for name, delay, refresh, period in (("delay=0", 0, 2, 1), ("delay=2", 2, False, 1),
                                         ("period=2", 0, False, 2)):
        refreshed = {5, 7, 9} if refresh else ()
        per_rank, flushed = _reference_delay(tf, shadow, start, steps, world, freeze, lr,
                                             betas, eps, wd, delay, period=period,
                                             refresh=refreshed, compress=compress)
        _, dense = _reference_delay(tf, shadow, start, steps, world, freeze, lr, betas, eps,
                                    wd, delay, period=period, refresh=refreshed)
        model = _model(tf.keras, 0)
        opt = hvd.DistributedOptimizer(make(lr, betas, eps, wd), freeze_variance=freeze,
                                       refresh_variance=refresh, min_compress_size=large,
                                       compression=Compression.sign, delay=delay,
                                       period=period)
        step, diffs, off, phases = _train_step(tf, model, opt), [], [], []
        for s in range(steps):
            step(*_batch(s, rank))
            ours = np.concatenate(_flat(v.numpy() for v in model.trainable_variables))
            diff = np.abs(ours - np.concatenate(per_rank[rank][s]))
            diffs.append(float(diff.max()))
            off.append(int((diff > 2e-5).sum()))
            phases.append(opt.compression_stats()["adam_phase"])
        opt.flush()
        stats = opt.compression_stats()
        ours = np.concatenate(_flat(v.numpy() for v in model.trainable_variables))
        diff = np.abs(ours - np.concatenate(flushed))
        results[name] = {
            "diffs": diffs, "off": off, "phases": phases, "paths": stats["paths"],
            "refreshes": stats.get("adam_refreshes"), "numel": int(diff.size),
            "flushed_diff": float(np.median(diff)), "flushed_off": int((diff > 2e-5).sum()),
            "dense_off": int((np.abs(np.concatenate(flushed) - np.concatenate(dense))
                              > 2e-5).sum()),
            "identical": _identical(tf, hvd, model.trainable_variables,
                                    f"adams.{label}.{name}")}
    return results


def delay_reference():
    """Each Adam taken over with delay=2, dense, frozen at step 3: the reference on each
    rank step by step (ranks apart once the delayed steps begin), synchronous before the
    freeze, and every rank's weights the flushed reference after ``flush()``. AdamW also
    with ``period`` (3, and 2 with delay=1): exchanges every period-th step from the
    freeze on, the steps between on each rank's own memory intake."""
    tf = _tf()
    import hvd_dgc.tensorflow.keras as hvd
    rank, world = hvd.rank(), hvd.size()
    steps, freeze, lr, betas, eps, wd = 9, 3, 0.01, (0.9, 0.99), 1e-7, 0.05
    results = {}
    runs = [(label, make, decoupled, 2, 1) for label, make, decoupled in _classes()]
    runs += [(_classes()[0][0] + f".period{p}.delay{d}",) + _classes()[0][1:] + (d, p)
             for d, p in ((0, 3), (1, 2))]
    for label, make, decoupled, delay, period in runs:
        decay = wd if decoupled else 0.0
        shadow = _model(tf.keras, 0)
        start = _flat(v.numpy() for v in shadow.trainable_variables)
        per_rank, flushed = _reference_delay(tf, shadow, start, steps, world, freeze, lr,
                                             betas, eps, decay, delay, period=period)
        model = _model(tf.keras, 0)
        opt = hvd.DistributedOptimizer(make(lr, betas, eps, decay), freeze_variance=freeze,
                                       min_compress_size=10 ** 9, delay=delay, period=period,
                                       compression=hvd.Compression.dgc)
        step, diffs, identical, in_flight = _train_step(tf, model, opt), [], [], []
        for s in range(steps):
            step(*_batch(s, rank))
            ours = _flat(v.numpy() for v in model.trainable_variables)
            diffs.append(max(float(np.abs(a - b).max()) for a, b in zip(ours, per_rank[rank][s])))
            identical.append(_identical(tf, hvd, model.trainable_variables,
                                        f"adamd.{label}.{s}"))
            in_flight.append(opt.in_flight)
        phase = opt.compression_stats()["adam_phase"]
        flushed_now = opt.flush()
        ours = _flat(v.numpy() for v in model.trainable_variables)
        results[label] = {
            "diffs": diffs, "identical": identical, "in_flight": in_flight, "phase": phase,
            "flushed": flushed_now, "iterations": int(opt.iterations.numpy()),
            "flushed_diff": max(float(np.abs(a - b).max()) for a, b in zip(ours, flushed)),
            "flushed_identical": _identical(tf, hvd, model.trainable_variables,
                                            f"adamd.{label}.flushed"),
            "apart": max(float(np.abs(a - b).max())
                         for a, b in zip(per_rank[0][-1], per_rank[1][-1]))}
    # a NaN in rank 1's batch 1, in the exact warm-up: every rank skips that step (it is
    # synchronous, as PyTorch's warm-up is), and the run is the reference fed the others
    label, make, decoupled = _classes()[0]
    delay = 2
    model = _model(tf.keras, 0)
    opt = hvd.DistributedOptimizer(make(lr, betas, eps, wd if decoupled else 0.0),
                                   freeze_variance=freeze, min_compress_size=10 ** 9,
                                   compression=hvd.Compression.dgc, delay=delay)
    step = _train_step(tf, model, opt)
    for s in range(steps + 1):
        x, y = _batch(s, rank)
        step(np.full_like(x, np.nan) if (s, rank) == (1, 1) else x, y)
    shadow = _model(tf.keras, 0)
    start = _flat(v.numpy() for v in shadow.trainable_variables)
    per_rank, _ = _reference_delay(tf, shadow, start, steps, world, freeze, lr, betas, eps,
                                   wd if decoupled else 0.0, delay,
                                   batches=[0] + list(range(2, steps + 1)))
    ours = _flat(v.numpy() for v in model.trainable_variables)
    stats = opt.compression_stats()
    results["nan_in_warm_up"] = {
        "diff": max(float(np.abs(a - b).max()) for a, b in zip(ours, per_rank[rank][-1])),
        "nonfinite_steps": stats["nonfinite_steps"], "step": stats["step"],
        "iterations": int(opt.iterations.numpy())}
    return results


def fit_digits(epochs=6):
    """model.fit on digits: AdamW densely (density=1.0) and taken over, frozen at step
    20, then DGC at 1% (the 4,096-value kernel sparse), synchronous and with delay=2
    (DGCCallback flushes before evaluating): accuracy, bytes, phases."""
    tf = _tf()
    import hvd_dgc.tensorflow.keras as hvd
    keras = tf.keras
    rank, size = hvd.rank(), hvd.size()
    (x, y), (xt, yt) = _digits(rank, size)
    out = {}
    for tag, options in (("dense", {"density": 1.0}),
                         ("dgc", {"density": 0.01, "freeze_variance": 20}),
                         ("dgc_delay", {"density": 0.01, "freeze_variance": 20, "delay": 2})):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.layers.Input((64,)),
                                  keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(10)])
        opt = hvd.DistributedOptimizer(keras.optimizers.AdamW(0.003, weight_decay=0.01),
                                       **options)
        model.compile(optimizer=opt, metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      **({} if _legacy() else {"jit_compile": False}))
        history = model.fit(x, y, batch_size=32, epochs=epochs, verbose=0,
                            callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                       hvd.callbacks.DGCCallback(verbose=0)])
        acc = float(np.mean(np.argmax(model.predict(xt, verbose=0), 1) == yt))
        stats = opt.compression_stats()
        out[tag] = {"accuracy": acc, "loss": history.history["loss"][-1],
                    "ratio": stats["compression_ratio"], "paths": stats["paths"],
                    "phase": stats.get("adam_phase"), "step": stats["step"],
                    "scales": len(_scales(opt)),
                    "identical": _identical(tf, hvd, model.trainable_variables
                                            + _scales(opt), f"adam.fit.{tag}")}
    return out


def zero_one_fit(epochs=4):
    """A Keras script switched by one line: AdamW with no option (0/1 Adam: the sign
    from step 20, an exchange every 4th step) in model.fit with hvd_dgc's
    BroadcastGlobalVariablesCallback only. Each epoch (23 steps) ends between exchanges;
    the callback flushes there, so a callback after it (a ModelCheckpoint's place) sees
    the weights every rank agrees on, where one before it sees each rank's own."""
    tf = _tf()
    import hvd_dgc.tensorflow.keras as hvd
    keras = tf.keras
    rank, size = hvd.rank(), hvd.size()
    (x, y), (xt, yt) = _digits(rank, size)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Input((64,)),
                              keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10)])
    opt = hvd.DistributedOptimizer(keras.optimizers.AdamW(0.003, weight_decay=0.01))
    model.compile(optimizer=opt, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  **({} if _legacy() else {"jit_compile": False}))
    seen = {"before": [], "after": []}

    class Recorder(keras.callbacks.Callback):
        def __init__(self, where):
            super().__init__()
            self.where = where

        def on_epoch_end(self, epoch, logs=None):
            seen[self.where].append(_identical(tf, hvd, model.trainable_variables,
                                               f"adam.zo.{self.where}.{epoch}"))

    model.fit(x, y, batch_size=32, epochs=epochs, verbose=0,
              callbacks=[Recorder("before"), hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                         Recorder("after")])
    acc = float(np.mean(np.argmax(model.predict(xt, verbose=0), 1) == yt))
    stats = opt.compression_stats()
    return {"seen": seen, "accuracy": acc, "paths": stats["paths"], "step": stats["step"],
            "bytes": stats["bytes_sent"], "collective": opt._hvd_dgc.compression.collective,
            "phase": stats.get("adam_phase"), "period": opt._hvd_dgc.period,
            "in_flight": opt._hvd_dgc.in_flight,
            "identical": _identical(tf, hvd, model.trainable_variables, "adam.zo.end")}


def zero_one_embedding(steps=26):
    """AdamW with no option on a model with an Embedding (IndexedSlices gradients): 0/1
    Adam's local steps cannot take a looked-up row back, so the default sends the sign
    at every step instead (1-bit Adam), warned on every rank; the ranks stay identical
    at every step past the freeze, and the table's gradient travels as Horovod's."""
    import warnings
    tf = _tf()
    import hvd_dgc.tensorflow.keras as hvd
    keras = tf.keras
    rank = hvd.rank()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Input((6,), dtype="int32"),
                              keras.layers.Embedding(50, 8), keras.layers.Flatten(),
                              keras.layers.Dense(256, activation="relu"),
                              keras.layers.Dense(10)])
    opt = hvd.DistributedOptimizer(keras.optimizers.AdamW(0.003))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))

    identical = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(steps):
            rng = np.random.RandomState(100 * s + rank)
            step(rng.randint(0, 50, (16, 6)).astype(np.int32), rng.randint(0, 10, 16))
            identical.append(_identical(tf, hvd, model.trainable_variables, f"zo.emb.{s}"))
    said = [str(w.message) for w in caught if "IndexedSlices" in str(w.message)]
    stats = opt.compression_stats()
    return {"period": opt._hvd_dgc.period, "said": said, "identical": identical,
            "compressor": type(opt._hvd_dgc.compression).__name__, "paths": stats["paths"],
            "phase": stats.get("adam_phase")}


def checkpoint(ckdir):
    """After the freeze, model, optimizer (its scales) and DGC's memory (the momentum)
    through tf.train.Checkpoint; a fresh model and optimizer restored from it take the
    next steps bit for bit as the uninterrupted run. Controls: the model alone restored
    (exact Adam again from step 0), and model and optimizer without ``dgc_state`` (Keras
    2 saves DGC's memory with the optimizer; Keras 3 does not, so the momentum seeded
    at the freeze is lost)."""
    tf = _tf()
    import hvd_dgc.tensorflow.keras as hvd
    rank = hvd.rank()
    path = os.path.join(ckdir, f"adam_rank{rank}")
    options = dict(freeze_variance=3, density=0.05, min_compress_size=64)

    def build(seed):
        model = _model(tf.keras, seed)
        opt = hvd.DistributedOptimizer(tf.keras.optimizers.AdamW(0.01, weight_decay=0.02),
                                       **options)
        return model, opt, _train_step(tf, model, opt)

    model, opt, step = build(0)
    for s in range(5):
        step(*_batch(s, rank))
    tf.train.Checkpoint(model=model, optimizer=opt, dgc=opt.dgc_state).write(path)
    for s in range(5, 8):
        step(*_batch(s, rank))
    final = _flat(v.numpy() for v in model.trainable_variables)
    out = {}
    for tag, names in (("restored", ("model", "optimizer", "dgc")),
                       ("without_memory", ("model", "optimizer")), ("model_only", ("model",))):
        model2, opt2, step2 = build(7)
        parts = {name: part for name, part in (("model", model2), ("optimizer", opt2),
                                              ("dgc", opt2.dgc_state)) if name in names}
        tf.train.Checkpoint(**parts).read(path).expect_partial()
        for s in range(5, 8):
            step2(*_batch(s, rank))
        resumed = _flat(v.numpy() for v in model2.trainable_variables)
        out[tag] = {"max_diff": max(float(np.abs(a - b).max())
                                    for a, b in zip(final, resumed)),
                    "phase": opt2.compression_stats()["adam_phase"],
                    "step": opt2.compression_stats()["step"]}
    return out


def taken_back_at_their_size():
    """The ranks' spread after every step where each step's size moves (as the PyTorch
    side's ``taken_back_at_their_size``): AdamW (the sign, ``period=4``, frozen at step 3,
    Keras' decoupled decay 0.1), SGD with momentum (dense, ``period=4``) under a schedule
    that changes the rate every step (tf_keras' ``learning_rate`` is the last step's until
    it steps: the one the step will use is read), and a schedule with a rate of 0 at the
    exchange of step 7 (said once)."""
    import warnings
    tf = _tf()
    import hvd_dgc.tensorflow.keras as hvd
    from hvd_dgc.tensorflow import Compression
    import horovod.tensorflow as _hvd
    rank, schedules = hvd.rank(), tf.keras.optimizers.schedules
    out = {}
    for name in ("adamw", "sgd_schedule", "zero_rate"):
        model = _model(tf.keras, 3)
        if name == "adamw":
            opt = hvd.DistributedOptimizer(
                tf.keras.optimizers.AdamW(0.01, weight_decay=0.1),
                compression=Compression.sign, period=4, freeze_variance=3,
                min_compress_size=64)
        else:
            rate = schedules.InverseTimeDecay(0.1, 1, 1.0) if name == "sgd_schedule" else \
                schedules.PiecewiseConstantDecay([6, 7], [0.1, 0.0, 0.1])
            opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(rate, momentum=0.9),
                                           density=1.0, period=4)
        step, spread = _train_step(tf, model, opt), []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for s in range(16):
                step(*_batch(s, rank))
                flat = np.concatenate(_flat(v.numpy() for v in model.trainable_variables))
                everyone = _hvd.allgather(flat[None], name=f"tb.{name}.{s}").numpy()
                spread.append(float(np.abs(everyone - everyone[0]).max()))
        out[name] = {"spread": spread, "said": [str(w.message) for w in caught
                                                if "learning rate is 0" in str(w.message)]}
    return out


def checkpoint_between_exchanges(ckdir):
    """0/1 Adam (an exchange every 4th step from the freeze at 3: steps 3, 7, 11) written
    to a checkpoint after step 5, this rank's own steps 4 and 5 in flight: a fresh model
    and optimizer restored from it take steps 6-11 as the uninterrupted run (to rounding:
    the checkpoint holds their sum at the last one's step size).
    Control: the same checkpoint with the own steps left out (what it held before they
    were carried), whose restored run keeps each rank's own steps for good. With
    ``delay=2`` a checkpoint written while an average is in flight is refused; after
    ``flush()`` it is written."""
    tf = _tf()
    import hvd_dgc.tensorflow.keras as hvd
    from hvd_dgc.tensorflow import Compression
    rank = hvd.rank()
    options = dict(freeze_variance=3, compression=Compression.sign, period=4,
                   min_compress_size=64)

    def build(seed, **extra):
        model = _model(tf.keras, seed)
        opt = hvd.DistributedOptimizer(tf.keras.optimizers.AdamW(0.01, weight_decay=0.02),
                                       **dict(options, **extra))
        return model, opt, _train_step(tf, model, opt)

    def parts(model, opt):
        return dict(model=model, optimizer=opt, dgc=opt.dgc_state)

    model, opt, step = build(0)
    for s in range(6):
        step(*_batch(s, rank))
    paths = {tag: os.path.join(ckdir, f"between_{tag}_rank{rank}") for tag in ("carried",
                                                                               "left_out")}
    out = {"in_flight": opt._hvd_dgc.in_flight, "period": opt._hvd_dgc.period}
    tf.train.Checkpoint(**parts(model, opt)).write(paths["carried"])
    dga = opt._hvd_dgc.dga
    dga.owed = lambda: None  # the control: a checkpoint that holds no own steps
    tf.train.Checkpoint(**parts(model, opt)).write(paths["left_out"])
    del dga.owed
    out["in_flight_after_writing"] = opt._hvd_dgc.in_flight
    for s in range(6, 12):
        step(*_batch(s, rank))
    final = np.concatenate(_flat(v.numpy() for v in model.trainable_variables))
    for tag, path in paths.items():
        model2, opt2, step2 = build(7)
        tf.train.Checkpoint(**parts(model2, opt2)).read(path).expect_partial()
        for s in range(6, 12):
            step2(*_batch(s, rank))
        resumed = np.concatenate(_flat(v.numpy() for v in model2.trainable_variables))
        out[tag] = {"max_diff": float(np.abs(final - resumed).max()),
                    "step": opt2.compression_stats()["step"],
                    "in_flight": opt2._hvd_dgc.in_flight}
    model, opt, step = build(0, delay=2)
    for s in range(5):  # from the freeze on, steps 3 and 4 await their averages
        step(*_batch(s, rank))
    path = os.path.join(ckdir, f"between_delay_rank{rank}")
    try:
        tf.train.Checkpoint(**parts(model, opt)).write(path)
        out["delay_refused"] = "NO EXCEPTION"
    except RuntimeError as exc:
        out["delay_refused"] = str(exc)
    opt.flush()
    tf.train.Checkpoint(**parts(model, opt)).write(path)
    out["delay_written_after_flush"] = os.path.exists(path + ".index")
    return out


def refusals():
    """What the take-over cannot honour, refused with the fix; freeze_variance=False
    leaves Adam on error feedback (said), which delay cannot run on."""
    tf = _tf()
    import hvd_dgc.tensorflow.keras as hvd
    opts = tf.keras.optimizers
    out = {}
    for label, fn in (
            ("clipnorm", lambda: hvd.DistributedOptimizer(opts.Adam(0.01, clipnorm=1.0))),
            ("ema", lambda: hvd.DistributedOptimizer(opts.AdamW(0.01, use_ema=True))),
            ("sgd_clip_delay", lambda: hvd.DistributedOptimizer(
                opts.SGD(0.1, momentum=0.9, clipnorm=1.0), delay=2)),
            ("delay_unfrozen", lambda: hvd.DistributedOptimizer(
                opts.Adam(0.01), delay=2, freeze_variance=False))):
        try:
            fn()
            out[label] = "NO EXCEPTION"
        except ValueError as exc:
            out[label] = str(exc)
    error_feedback = hvd.DistributedOptimizer(opts.Adam(0.01), freeze_variance=False)
    out["error_feedback_taken"] = error_feedback._hvd_dgc_adam is not None
    out["error_feedback_said"] = error_feedback._hvd_dgc.resolved.taken_over.said
    return out

