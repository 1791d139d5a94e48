"""hvd_dgc's Keras optimizer under elastic Horovod, written as Horovod's own
examples/elastic/tensorflow2/tensorflow2_keras_mnist_elastic.py is: ``KerasState``,
Horovod's commit / batch / epoch callbacks, ``model.fit`` inside ``@hvd.elastic.run``.

Rank 0 writes ``flag`` after step ``trigger``; the host-discovery script then offers
another number of slots and Horovod resets the workers (tests/tensorflow/test_elastic.py)."""

import os
import time

import numpy as np

from tests.tensorflow.tf_dgc import _identical, _tf

BATCH, STEPS_PER_EPOCH = 16, 10


def _compiled(tf, hvd, seed, adamw=False, **options):
    """A small MLP compiled with hvd_dgc's optimizer over SGD momentum 0.9 (``adamw``:
    over AdamW, taken over)."""
    keras = tf.keras
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.layers.Input((20,)),
                              keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(5)])
    base = keras.optimizers.AdamW(0.003, weight_decay=0.01) if adamw else \
        keras.optimizers.SGD(0.05, momentum=0.9)
    opt = hvd.DistributedOptimizer(base, **options)
    legacy = os.environ.get("TF_USE_LEGACY_KERAS") == "1"
    model.compile(optimizer=opt, **({} if legacy else {"jit_compile": False}),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model, opt


def _epoch_of_data(rank):
    """This rank's epoch: STEPS_PER_EPOCH batches, the label the largest of 5 inputs."""
    x = np.random.RandomState(100 + rank).randn(BATCH * STEPS_PER_EPOCH, 20)
    x = x.astype(np.float32)
    return x, np.abs(x[:, :5]).argmax(1).astype(np.int64)


def _fit_elastic(flag, epochs, trigger, wait, seed, crash_at=None, commit_every=1,
                 horovod_pattern=False, **options):
    """Train; log every step: the optimizer's step, world size, hvd_dgc's step, epoch
    and world size, and whether every rank holds the same weights. From step
    ``trigger`` on, while ``wait(size)``, each step sleeps a little (the driver sees the
    discovery script's change before training ends); ``crash_at``: rank 1 dies there
    (os._exit) before that step's commit."""
    tf = _tf()
    import hvd_dgc.tensorflow.keras as hvd
    keras = tf.keras
    hvd.init()
    model, opt = _compiled(tf, hvd, seed, **options)
    x0, y0 = _epoch_of_data(hvd.rank())
    if horovod_pattern:  # Horovod's example: one step "to initialise the optimizer state"
        model.fit(x0[:BATCH], y0[:BATCH], batch_size=BATCH, epochs=1, verbose=0)
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    if horovod_pattern:  # ... and one more in a reset callback, "to join new ranks"
        state.register_reset_callbacks([lambda: model.fit(
            x0[:BATCH], y0[:BATCH], batch_size=BATCH, epochs=1, verbose=0)])
    log = []

    class Probe(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            step, stats = int(opt.iterations.numpy()), opt.compression_stats()
            identical = _identical(tf, hvd, model.trainable_variables,
                                   f"el.{step}.{hvd.size()}")
            log.append({"step": step, "size": hvd.size(), "epoch": state.epoch,
                        "in_flight": opt.in_flight,
                        "loss": float(logs["loss"]),
                        # the outer loop counts inner steps and rounds, no warm-up
                        "dgc_step": stats.get("step", stats.get("inner_steps")),
                        "dgc_epoch": stats.get("epoch", state.epoch),
                        "rounds": stats.get("rounds"), "world_size": stats["world_size"],
                        "density": stats["current_density"], "hosts": hvd.cross_size(),
                        "local_size": hvd.local_size(),
                        "identical": identical})
            if step == crash_at and hvd.rank() == 1:
                os._exit(3)
            if trigger is None:
                return
            if step == trigger and hvd.rank() == 0:
                open(flag, "w").close()
            if step >= trigger and wait(hvd.size()):
                time.sleep(0.3)  # let the driver see the change before training ends

    callbacks = [hvd.callbacks.DGCCallback(verbose=0), Probe(),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=commit_every),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state)]

    @hvd.elastic.run
    def train(state):
        x, y = _epoch_of_data(hvd.rank())  # the rank may have changed in a reset
        model.fit(x, y, batch_size=BATCH, epochs=epochs - state.epoch, shuffle=False,
                  callbacks=callbacks, verbose=0)

    train(state)
    from hvd_dgc.tensorflow.keras_optimizers import optimizer_variables
    scales = [np.ravel(v.numpy()) for v in optimizer_variables(opt)
              if "hvd_dgc_scale" in (getattr(v, "path", None) or v.name)]
    return {"log": log, "rank": hvd.rank(), "size": hvd.size(), "epoch": state.epoch,
            "final": np.concatenate([np.ravel(v) for v in model.get_weights()]).tolist(),
            "stats": opt.compression_stats(),
            "scales": np.concatenate(scales).tolist() if scales else []}


def keras_drop_a_worker(flag, epochs=4, trigger=15):
    """Two ranks, then one: an epoch-based warm-up (3 epochs) runs across the reset."""
    return _fit_elastic(flag, epochs, trigger, lambda size: size > 1, seed=3,
                        density=0.01, warmup=3, clip_norm=1.0)


def keras_drop_a_host(flag, epochs=3, trigger=12):
    """Two hosts of two ranks, then one host: both ranks of the other host go at once."""
    return _fit_elastic(flag, epochs, trigger, lambda size: size > 2, seed=6,
                        density=0.01, warmup=2, clip_norm=1.0)


def keras_crash_a_worker(flag, epochs=3, crash_at=13):
    """Two hosts of one rank; rank 1 dies at step 13, commits every 5 steps: the
    survivor's collective fails, it restores the commit of step 10 (weights, optimizer
    and DGC state together) and goes on alone from step 11."""
    return _fit_elastic(flag, epochs, None, None, seed=5, crash_at=crash_at,
                        commit_every=5, density=0.01, warmup=20, warmup_unit="step")


def keras_crash_a_worker_delayed(flag, epochs=3, crash_at=13):
    """``keras_crash_a_worker`` with delayed averaging and ``period`` (delay=2,
    period=2): every commit (every 5 steps) flushes first, so the survivor goes back to
    weights both ranks agreed on and drops what was in flight."""
    return _fit_elastic(flag, epochs, None, None, seed=5, crash_at=crash_at,
                        commit_every=5, density=0.01, warmup=20, warmup_unit="step",
                        delay=2, period=2)


def keras_add_a_worker_delayed(flag, epochs=3, trigger=8):
    """``keras_add_a_worker`` with delay=2: the join comes at a commit, flushed, so the
    newcomer takes weights every rank agrees on; both end identical (fit's last flush)."""
    return _fit_elastic(flag, epochs, trigger, lambda size: size == 1, seed=4,
                        density=0.01, warmup=20, warmup_unit="step", delay=2)


def keras_crash_a_worker_passes(flag, epochs=3, crash_at=17):
    """``keras_crash_a_worker`` with backward_passes_per_step=2, rank 1 dying at step 17:
    the survivor's exchange at step 18 fails (its count already 2) and it restores the
    commit of step 15, which fell between two passes (count 1)."""
    return _fit_elastic(flag, epochs, None, None, seed=5, crash_at=crash_at,
                        commit_every=5, density=0.01, warmup=20, warmup_unit="step",
                        backward_passes_per_step=2)


def keras_add_a_worker_passes(flag, epochs=3, trigger=8):
    """``keras_add_a_worker`` with backward_passes_per_step=2."""
    return _fit_elastic(flag, epochs, trigger, lambda size: size == 1, seed=4,
                        density=0.01, warmup=20, warmup_unit="step",
                        backward_passes_per_step=2)


def keras_crash_a_worker_outer(flag, epochs=3, crash_at=13):
    """``keras_crash_a_worker`` with the outer loop overlapped (``OuterLoop(steps=4,
    overlap=True)``), commits at the 8th batch and each epoch's end (10 steps):
    exchanges in flight between commits; every commit flushes, so the survivor goes
    back to the commit of step 10 and drops what was in flight."""
    from hvd_dgc import OuterLoop
    return _fit_elastic(flag, epochs, None, None, seed=5, crash_at=crash_at,
                        commit_every=8, outer=OuterLoop(steps=4, overlap=True))


def keras_add_a_worker_outer(flag, epochs=3, trigger=8):
    """``keras_add_a_worker`` with the outer loop overlapped (steps=4), a commit every
    4 steps (every round end): the newcomer takes rank 0's weights and round."""
    from hvd_dgc import OuterLoop
    return _fit_elastic(flag, epochs, trigger, lambda size: size == 1, seed=4,
                        commit_every=4, outer=OuterLoop(steps=4, overlap=True))


def keras_add_a_worker(flag, epochs=3, trigger=8):
    """One rank, then two: the newcomer takes rank 0's weights and DGC step (a warm-up
    by step runs across the join), its residuals start empty."""
    return _fit_elastic(flag, epochs, trigger, lambda size: size == 1, seed=4,
                        density=0.01, warmup=20, warmup_unit="step")


def keras_add_a_worker_adamw(flag, epochs=3, trigger=8):
    """One rank, then two, with AdamW taken over and frozen at step 5: the newcomer
    joins after the freeze and takes rank 0's frozen scales with the optimizer's
    variables (its memory's momentum starts empty, as its residuals do)."""
    return _fit_elastic(flag, epochs, trigger, lambda size: size == 1, seed=4, adamw=True,
                        density=0.01, freeze_variance=5, min_compress_size=256)


def keras_state_commit_restore_sync(steps=6):
    """KerasState without a reset, on 2 ranks: ``restore`` puts back the weights, the
    optimizer's and hvd_dgc's variables of the last commit (residuals, velocities,
    step, epoch); ``sync`` gives every rank rank 0's weights, optimizer variables, DGC
    step and epoch and leaves each rank its own residuals. And the refusals."""
    tf = _tf()
    import hvd_dgc.tensorflow.keras as hvd
    keras = tf.keras
    rank = hvd.rank()
    model, opt = _compiled(tf, hvd, 5, density=0.05)
    rng = np.random.RandomState(7 + rank)
    x = rng.randn(BATCH * steps, 20).astype(np.float32)
    y = rng.randint(0, 5, BATCH * steps)
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    exchange = opt._hvd_dgc

    def snapshot():
        return {"weights": [np.array(w) for w in model.get_weights()],
                "iterations": int(opt.iterations.numpy()),
                "memory": [np.array(v) for v in exchange.memory.v + exchange.memory.u],
                "step": int(exchange.step.numpy()), "epoch": float(exchange.epoch.numpy())}

    def same(a, b):
        return (all(np.array_equal(p, q) for p, q in zip(a["weights"], b["weights"]))
                and all(np.array_equal(p, q) for p, q in zip(a["memory"], b["memory"]))
                and (a["iterations"], a["step"], a["epoch"]) ==
                (b["iterations"], b["step"], b["epoch"]))

    out = {}
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    opt.set_epoch(1)
    state.commit()
    committed = snapshot()
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    opt.set_epoch(2)
    moved = snapshot()
    state.restore()
    back = snapshot()
    out["restore"] = {"moved": not same(moved, committed), "back": same(back, committed),
                      "residual_norm": float(sum(np.abs(m).sum() for m in back["memory"])),
                      "python_epoch": exchange._epoch}
    # ranks apart: rank 1's weights, step and epoch differ from rank 0's
    if rank == 1:
        for w in model.trainable_variables:
            w.assign_add(tf.ones_like(w))
        exchange.step.assign_add(5)
        exchange.epoch.assign(9.0)
    before = snapshot()
    state.sync()
    after = snapshot()
    memories = hvd.allgather(tf.expand_dims(tf.concat(
        [tf.reshape(m, [-1]) for m in after["memory"]], 0), 0), name="el.sync.m").numpy()
    out["sync"] = {"weights_identical": _identical(tf, hvd, model.variables, "el.sync"),
                   "step": after["step"], "epoch": after["epoch"],
                   "own_memory_kept": all(np.array_equal(p, q) for p, q in
                                          zip(before["memory"], after["memory"])),
                   "memories_differ": not np.array_equal(memories[0], memories[1])}
    # and it trains on, in step
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    out["after"] = {"step": int(exchange.step.numpy()),
                    "iterations": int(opt.iterations.numpy())}

    refused = {}
    for tag, make in {
            "delay": lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), delay=1),
            "passes": lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                       backward_passes_per_step=2)}.items():
        try:
            hvd.elastic.KerasState(model, optimizer=make())
            refused[tag] = None
        except ValueError as e:
            refused[tag] = str(e)
    out["refused"] = refused
    return out


def plain_optimizer_state():
    """``KerasState`` with a plain (unwrapped) Keras optimizer, which Horovod's state takes:
    ``sync`` gives every rank rank 0's weights, optimizer variables and values; ``restore``
    puts back the last commit; ``commit`` moves what ``restore`` returns to."""
    tf = _tf()
    import hvd_dgc.tensorflow.keras as hvd
    from hvd_dgc.tensorflow.keras_optimizers import optimizer_variables
    keras = tf.keras
    rank = hvd.rank()
    model = keras.Sequential([keras.layers.Input((3,)), keras.layers.Dense(2)])
    model.set_weights([np.full((3, 2), rank + 1.0, np.float32),
                       np.full(2, rank + 1.0, np.float32)])
    optimizer = keras.optimizers.Adam(0.01)
    with tf.GradientTape() as tape:  # one local step: Adam's moments differ per rank
        loss = tf.reduce_sum(model(np.full((1, 3), rank + 1.0, np.float32)) ** 2)
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                  model.trainable_variables))

    def now():
        return [np.array(w).tolist() for w in model.get_weights()]
    before = now()
    state = hvd.elastic.KerasState(model, optimizer, batch=20 + rank, epoch=10 + rank)
    state.sync()
    synced = {"before": before, "weights": now(), "batch": state.batch, "epoch": state.epoch,
              "identical": _identical(tf, hvd, model.variables, "el.plain.w"),
              "optimizer_identical": _identical(
                  tf, hvd, [v for v in optimizer_variables(optimizer)
                            if v.dtype == tf.float32], "el.plain.o")}
    other = [np.full((3, 2), -5.0, np.float32), np.zeros(2, np.float32)]
    model.set_weights(other)
    state.batch, state.epoch = 21, 11
    state.restore()
    restored = {"weights": now(), "batch": state.batch, "epoch": state.epoch}
    model.set_weights(other)
    state.batch, state.epoch = 22, 12
    state.commit()
    model.set_weights([np.ones((3, 2), np.float32), np.ones(2, np.float32)])
    state.restore()
    committed = {"weights": now(), "batch": state.batch, "epoch": state.epoch}
    return {"synced": synced, "restored": restored, "committed": committed}


def keras_add_a_worker_horovod_pattern(flag, epochs=4, trigger=25):
    """As Horovod's elastic Keras example: a step before the state is made and one in a
    reset callback, both before the sync. The warm-up sends everything densely (density
    1.0) for 2 epochs, then sparsely: the newcomer's first step is at epoch 0, the
    others' at epoch 2, so without agreeing first their collectives would differ."""
    return _fit_elastic(flag, epochs, trigger, lambda size: size == 1, seed=7,
                        horovod_pattern=True, density=0.01, warmup=2,
                        warmup_densities=(1.0,))


def _tape_elastic(flag, steps, trigger, wait, seed, crash_at=None, commit_every=1,
                  **options):
    """Horovod's examples/elastic/tensorflow2/tensorflow2_mnist_elastic.py, its import
    switched: a ``tf.function`` made once, the tape wrapped inside it, one step without
    the exchange before the state (to make the optimizer's slots), a plain Keras
    optimizer in ``hvd.elastic.TensorFlowKerasState``, a commit after every batch. Logs
    each step: world size, loss, hvd_dgc's step and world size, ranks identical, and
    how often the step was traced."""
    tf = _tf()
    import hvd_dgc.tensorflow as hvd
    keras = tf.keras
    hvd.init()
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.layers.Input((20,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(5)])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = keras.optimizers.SGD(0.05, momentum=0.9)

    @tf.function
    def training_step(images, labels, allreduce=True):
        with tf.GradientTape() as tape:
            loss_value = loss(labels, model(images, training=True))
        if allreduce:
            tape = hvd.DistributedGradientTape(tape, **options)
        grads = tape.gradient(loss_value, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss_value

    x0, y0 = _epoch_of_data(hvd.rank())
    refusals = _tape_refusals(tf, hvd) if trigger is not None and wait(1) else {}
    training_step(x0[:BATCH], y0[:BATCH], allreduce=False)
    log = []

    @hvd.elastic.run
    def train(state):
        while state.batch < steps:
            x, y = _epoch_of_data(hvd.rank())
            i = state.batch % STEPS_PER_EPOCH
            value = training_step(x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH])
            state.batch += 1
            stats = hvd.compression_stats()
            log.append({"step": state.batch, "size": hvd.size(), "loss": float(value),
                        "dgc_step": stats["step"], "world_size": stats["world_size"],
                        "density": stats["current_density"],
                        "traced": training_step.experimental_get_tracing_count(),
                        "identical": _identical(tf, hvd, model.trainable_variables,
                                                f"tape.{state.batch}.{hvd.size()}")})
            if state.batch == crash_at and hvd.rank() == 1:
                os._exit(3)
            if trigger is not None and state.batch == trigger and hvd.rank() == 0:
                open(flag, "w").close()
            if trigger is not None and state.batch >= trigger and wait(hvd.size()):
                time.sleep(0.3)  # let the driver see the change before training ends
            if state.batch % commit_every == 0:
                state.commit()

    state = hvd.elastic.TensorFlowKerasState(model, opt, batch=0)
    train(state)
    return {"log": log, "rank": hvd.rank(), "size": hvd.size(),
            "final": np.concatenate([np.ravel(v) for v in model.get_weights()]).tolist(),
            "stats": hvd.compression_stats(), "refused": refusals}


def _tape_refusals(tf, hvd):
    """What a tape traced once for every world cannot hold, each refused at its first
    gradient (before any collective) with the fix."""
    out = {}
    for name, options in {"delay": {"delay": 2},
                          "fp16": {"compression": hvd.Compression.fp16},
                          "powersgd": {"compression": "powersgd"}}.items():
        v = tf.Variable(tf.ones([4096]), name=f"refused_{name}")
        with tf.GradientTape() as tape:
            y = tf.reduce_sum(v * v)
        try:
            hvd.DistributedGradientTape(tape, **options).gradient(y, [v])
            out[name] = "NO EXCEPTION"
        except ValueError as exc:
            out[name] = str(exc)
    return out


def tape_drop_a_worker(flag, steps=30, trigger=10):
    """Two ranks, then one: the survivor's step, traced for two, runs on in a world of
    one (its paths kept, the number of ranks read when it runs)."""
    return _tape_elastic(flag, steps, trigger, lambda size: size > 1, seed=3,
                         density=0.01, clip_norm=1.0)


def tape_add_a_worker(flag, steps=30, trigger=8):
    """One rank, then two, in a warm-up by step: the newcomer takes rank 0's DGC step
    before it makes its exchange (at its first tape step)."""
    return _tape_elastic(flag, steps, trigger, lambda size: size == 1, seed=4,
                         density=0.01, warmup=20, warmup_unit="step")


def tape_crash_a_worker(flag, steps=30, crash_at=13):
    """Two hosts of one rank; rank 1 dies at step 13: the survivor's collective fails,
    it restores the commit of step 12 (weights, optimizer and DGC memory; a commit every
    4 steps) and goes on."""
    return _tape_elastic(flag, steps, None, None, seed=5, crash_at=crash_at, commit_every=4,
                         density=0.01)
