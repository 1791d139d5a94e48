"""Bodies of tests/core/test_stuck_warmup.py, run on every rank under horovodrun: an
epoch-counted warm-up (``warmup=4``, ``warmup_unit="epoch"``) in scripts that set the
epoch and in scripts that never do, in PyTorch, Keras' ``model.fit`` and TensorFlow's
tape. The launcher sets ``HVD_DGC_CHECK_STEPS`` low, so a few tens of steps show
the warning. Each scenario returns the warnings it raised, as the user would read them,
and the densities the optimizer stepped with."""

import warnings

import numpy as np


STEPS_PER_EPOCH = 4  # Keras: 8 samples per rank, batches of 2
EPOCHS = 6


def _said(caught):
    """hvd_dgc's warnings, as printed."""
    return [str(w.message) for w in caught if str(w.message).startswith("hvd_dgc:")]


def torch_scenarios(steps=24, per_epoch=4):
    """One optimizer never told the epoch, one told at each epoch's start
    (``set_epoch(e)``, 0 first): what each said and its density at each epoch."""
    import torch
    import hvd_dgc.torch as hvd
    from hvd_dgc import say
    hvd.init()
    torch.manual_seed(0)
    out = {}
    for name, sets_epoch in (("never", False), ("set_epoch", True)):
        say.reset()
        model = torch.nn.Linear(64, 32)
        densities = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt = hvd.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                named_parameters=model.named_parameters(), density=0.001, warmup=4,
                link_watch=hvd.LinkWatch(window=20))
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            for step in range(steps):
                if sets_epoch and step % per_epoch == 0:
                    opt.set_epoch(step // per_epoch)
                if step % per_epoch == 0:
                    densities.append(opt.density)
                x = torch.randn(8, 64)
                opt.zero_grad()
                model(x).pow(2).mean().backward()
                opt.step()
        stats = opt.compression_stats()
        out[name] = {"said": _said(caught), "densities": densities,
                     "epoch": stats["epoch"], "step": stats["step"]}
    return out


def _tf():
    import tensorflow as tf
    tf.config.threading.set_inter_op_parallelism_threads(2)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    return tf


def _keras_fit(tf, hvd, callbacks, **options):
    """``fit`` of a 2,080-weight Dense model for EPOCHS epochs with hvd_dgc's callbacks
    named in ``callbacks``; the density each epoch stepped with (read at its end)."""
    keras = tf.keras
    rank = hvd.rank()
    model = keras.Sequential([keras.layers.Input((32,)), keras.layers.Dense(64)])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01, momentum=0.9),
                                   **{"density": 0.001, "warmup": 4, **options})
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    densities = []

    class Record(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            stats = self.model.optimizer.compression_stats()
            densities.append((stats["current_density"], stats["epoch"]))

    made = {"broadcast": lambda: hvd.callbacks.BroadcastGlobalVariablesCallback(0),
            "metric_average": lambda: hvd.callbacks.MetricAverageCallback(),
            "lr_warmup": lambda: hvd.callbacks.LearningRateWarmupCallback(
                initial_lr=0.01, warmup_epochs=2)}
    rng = np.random.default_rng(rank)
    x = rng.standard_normal((2 * STEPS_PER_EPOCH, 32)).astype(np.float32)
    y = rng.standard_normal((2 * STEPS_PER_EPOCH, 64)).astype(np.float32)
    model.fit(x, y, batch_size=2, epochs=EPOCHS, shuffle=False, verbose=0,
              callbacks=[made[name]() for name in callbacks] + [Record()])
    return densities


def _tape(tf, hvd, sets_epoch, per_epoch=12):
    """A custom loop on ``DistributedGradientTape``; ``hvd.set_epoch(e)`` at each epoch's
    start (0 first, before the tape's first step) where ``sets_epoch``. Its epochs are
    longer than the check's 10 steps, so epoch 0's ``set_epoch`` must count."""
    w = tf.Variable(tf.ones([64, 32]) * (hvd.rank() + 1.0))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * w)
        tape = hvd.DistributedGradientTape(tape, density=0.001, warmup=4)
        (g,) = tape.gradient(loss, [w])
        w.assign_sub(0.001 * g)

    densities = []
    for i in range(EPOCHS * per_epoch):
        if sets_epoch and i % per_epoch == 0:
            hvd.set_epoch(i // per_epoch)
        step()
        if i % per_epoch == per_epoch - 1:
            stats = hvd.compression_stats()  # (this loop's exchange: the last made)
            stats = stats[-1] if isinstance(stats, list) else stats
            densities.append(float(stats["current_density"]))
    return densities


def tf_scenarios():
    """Keras' ``fit`` with no hvd_dgc callback, with Horovod's callbacks re-exported by
    hvd_dgc (no ``DGCCallback``), with ``DGCCallback`` beside them; the tape without and
    with ``hvd.set_epoch``."""
    tf = _tf()
    import hvd_dgc.tensorflow as hvd_tf
    import hvd_dgc.tensorflow.keras as hvd
    from hvd_dgc import say
    hvd.init()
    out = {}
    runs = {"keras_none": lambda: _keras_fit(tf, hvd, ()),
            "keras_horovod": lambda: _keras_fit(tf, hvd, ("broadcast", "metric_average",
                                                          "lr_warmup")),
            "keras_metric_only": lambda: _keras_fit(tf, hvd, ("metric_average",)),
            "keras_delay_none": lambda: _keras_fit(tf, hvd, (), delay=2,
                                                   warmup_unit="step"),
            "keras_delay_broadcast": lambda: _keras_fit(tf, hvd, ("broadcast",), delay=2,
                                                        warmup_unit="step"),
            "tape_never": lambda: _tape(tf, hvd_tf, False),
            "tape_set_epoch": lambda: _tape(tf, hvd_tf, True)}
    for name, body in runs.items():
        say.reset()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            densities = body()
        out[name] = {"said": _said(caught), "densities": densities}
    return out
