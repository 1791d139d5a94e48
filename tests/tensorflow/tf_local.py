"""``DistributedOptimizer.register_local_var`` (Horovod's Keras API) on every rank: bodies
of tests/tensorflow/test_tf.py, run by tests/tensorflow/tf_dgc.py's suite ("tf_local.<name>"), Keras 2
or 3 by TF_USE_LEGACY_KERAS."""

import numpy as np

from tests.tensorflow.tf_dgc import _tf


def _constant(rank, shape, salt):
    return np.random.RandomState(100 * salt + rank).randn(*shape).astype(np.float32)


def keras_local_vars(steps=5, lr=0.1):
    """Two shared and two local variables, each rank's gradients constant but its own
    (so the expected weights have a closed form): SGD without and with momentum (DGC
    takes it over), density 1.0. The weights after ``steps`` steps, the gradients each
    rank fed, and what ``register_local_var`` refuses after the first step."""
    tf = _tf()
    import hvd_dgc.tensorflow.keras as hvd
    rank = hvd.rank()
    shapes = [(3, 4), (4,), (4, 2), (2,)]
    out = {}
    for tag, momentum in (("sgd", 0.0), ("momentum", 0.9)):
        variables = [tf.Variable(_constant(0, s, 7 + i), name=f"{tag}{i}")
                     for i, s in enumerate(shapes)]
        grads = [_constant(rank, s, i) for i, s in enumerate(shapes)]
        opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(lr, momentum=momentum),
                                       density=1.0)
        for v in variables[:2]:
            opt.register_local_var(v)

        @tf.function
        def step():
            opt.apply_gradients(zip([tf.constant(g) for g in grads], variables))

        start = [v.numpy().tolist() for v in variables]
        for _ in range(steps):
            step()
        try:
            opt.register_local_var(variables[2])
            late = "NO EXCEPTION"
        except ValueError as exc:
            late = str(exc)
        out[tag] = {"start": start, "final": [v.numpy().tolist() for v in variables],
                    "grads": [g.tolist() for g in grads], "late": late,
                    "velocity": sorted(v.name for v in opt.dgc_state.variables
                                       if "local_velocity" in v.name),
                    "exchanged": opt.compression_stats()["paths"]}
    return out
