"""Worker bodies for tests/core/test_messages.py: a small script switched by one line, run
with the defaults; what it prints is read by the test from horovodrun's output."""


def torch_default(optimizer="sgd", steps=3, options=None):
    import torch
    import hvd_dgc.torch as hvd
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 10))
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   **(options or {}))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return {"rank": hvd.rank(), "density": opt.compression_stats()["current_density"]}


def keras_default(epochs=2):
    """A Keras script switched by one line: hvd_dgc's optimizer and callbacks, defaults,
    model.fit with a progress bar (verbose=2) on rank 0; returns the epochs' logged
    dgc_density and the statistics' density in effect."""
    import numpy as np
    import tensorflow as tf
    import hvd_dgc.tensorflow.keras as hvd
    hvd.init()
    tf.config.threading.set_inter_op_parallelism_threads(2)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.random.set_seed(0)
    model = tf.keras.Sequential([tf.keras.Input((64,)), tf.keras.layers.Dense(128, "relu"),
                                 tf.keras.layers.Dense(10)])
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.05, momentum=0.9))
    model.compile(optimizer=opt, jit_compile=False, loss=tf.keras.losses.
                  SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.RandomState(hvd.rank())
    x, y = rng.randn(64, 64).astype("float32"), rng.randint(0, 10, 64)
    dgc = hvd.callbacks.DGCCallback()
    history = model.fit(x, y, batch_size=16, epochs=epochs, verbose=2 if hvd.rank() == 0
                        else 0, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                           dgc])
    return {"logged": [float(d) for d in history.history["dgc_density"]],
            "current": [s["current_density"] for s in dgc.history]}


def torch_clip_under_delay(steps=4, settings=({},)):
    """Horovod's clipping recipe (``synchronize()``, clip, ``skip_synchronize()``) in a
    script switched by one line, once for each of ``settings`` (hvd_dgc's options) in
    this process, rank 0's once-only words forgotten between; returns this rank's
    hvd_dgc warnings for each."""
    import warnings
    import torch
    import hvd_dgc.say
    import hvd_dgc.torch as hvd
    hvd.init()
    out = []
    for i, options in enumerate(settings):
        hvd_dgc.say._said.clear()  # (each setting as a script of its own would hear it)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                    torch.nn.Linear(128, 10))
        named = [(f"clip{i}.{n}", p) for n, p in model.named_parameters()]
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1,
                                                       momentum=0.9),
                                       named_parameters=named, **options)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(steps):
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.synchronize()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                with opt.skip_synchronize():
                    opt.step()
            opt.flush()
        out.append({"rank": hvd.rank(), "warnings": [
            str(w.message) for w in caught if "hvd_dgc" in str(w.message)]})
    return out
