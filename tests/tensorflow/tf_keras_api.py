"""Horovod's Keras optimizer API beyond ``apply_gradients`` on every rank: the gradients
``_compute_gradients`` hands out (exchanged there, applied as given) and Keras'
``compute_gradients`` (this rank's own), ``backward_passes_per_step`` seen through them
(``_agg_helper.counter``), local variables among the passes, a non-finite pass. Bodies of tests/tensorflow/test_tf.py, run by
tests/tensorflow/tf_dgc.py's suite ("tf_keras_api.<name>"), Keras 2 or 3 by
TF_USE_LEGACY_KERAS.

Each rank's loss is ``sum_i <w_i, c_i(rank)>``, so its gradient is the constant
``c_i(rank)`` and every expected weight has a closed form (the test computes it)."""

import numpy as np

from hvd_dgc import CostModel
from tests.tensorflow.tf_dgc import _tf

SHAPES = [(3, 4), (4,)]


def _coefficients(rank, salt=20):
    return [np.random.RandomState(100 * (salt + i) + rank).randn(*s).astype(np.float32)
            for i, s in enumerate(SHAPES)]


def _setup(tf, hvd, options, seed=3):
    """Variables, this rank's coefficients, the loss, and the wrapped optimizer: a
    user's own subclass of Keras' SGD (not taken over as SGD, and a class Keras' own
    module did not define)."""
    class Plain(tf.keras.optimizers.SGD):
        pass
    variables = [tf.Variable(np.random.RandomState(seed + i).randn(*s).astype(np.float32))
                 for i, s in enumerate(SHAPES)]
    coef = _coefficients(hvd.rank())
    constants = [tf.constant(c) for c in coef]

    def loss():
        return tf.add_n([tf.reduce_sum(v * c) for v, c in zip(variables, constants)])
    opt = hvd.DistributedOptimizer(Plain(0.1), **{"density": 1.0, **options})
    return variables, coef, loss, opt


def _values(variables):
    return [v.numpy().tolist() for v in variables]


def _applied(tf, opt, pairs):
    opt.apply_gradients(pairs)
    return tf.constant(True)


def keras_compute_gradients(steps=3):
    """Keras 2: ``_compute_gradients(loss_fn, var_list)`` (eagerly and in a
    tf.function, and applied in a ``tf.cond``), Keras' public ``compute_gradients(loss,
    vars, tape)``, and the gradients halved by the user between compute and apply. The gradients returned,
    the weights, the exchanges counted, ``iterations``; what ``apply_gradients`` says
    when given other variables than ``_compute_gradients`` just exchanged, and given a
    loss tensor without its tape; DGC at 25%
    trained by ``minimize`` with and without a LossScaleOptimizer around it; and what
    ``_compute_gradients`` returns with the outer loop."""
    tf = _tf()
    import hvd_dgc.tensorflow.keras as hvd
    out = {"coef": [c.tolist() for c in _coefficients(hvd.rank())]}
    for mode in ("eager", "function", "in_cond", "public", "halved"):
        variables, _, loss, opt = _setup(tf, hvd, {})

        def call():
            if mode == "public":
                with tf.GradientTape() as tape:
                    value = loss()
                pairs = opt.compute_gradients(value, variables, tape=tape)
            else:
                pairs = opt._compute_gradients(loss, var_list=variables)
            if mode == "halved":
                pairs = [(g * 0.5, v) for g, v in pairs]
            if mode == "in_cond":  # (as a LossScaleOptimizer applies: in a branch)
                tf.cond(tf.constant(True), lambda: _applied(tf, opt, pairs),
                        lambda: tf.constant(False))
            else:
                opt.apply_gradients(pairs)
            return [g for g, _ in pairs]
        step = call if mode == "eager" else tf.function(call)
        start = _values(variables)
        returned = [[g.numpy().tolist() for g in step()] for _ in range(steps)]
        out[mode] = {"start": start, "final": _values(variables), "returned": returned,
                     "exchanges": opt.compression_stats()["steps"],
                     "iterations": int(opt.iterations.numpy())}
    for scaled in (False, True):
        variables, _, loss, opt = _setup(tf, hvd, dict(  # a slow link: sparse pays
            density=0.25, warmup=0, min_compress_size=8, cost_model=CostModel(bandwidth=1e6)))
        ours = opt
        if scaled:  # what compile() does under the mixed_float16 policy
            opt = tf.keras.mixed_precision.LossScaleOptimizer(  # doubled every step
                opt, initial_scale=2.0 ** 10, dynamic_growth_steps=1)
        step = tf.function(lambda: opt.minimize(loss, variables))
        for _ in range(steps):
            step()
        out["loss_scaled" if scaled else "unscaled"] = {
            "weights": _values(variables), "paths": ours.compression_stats()["paths"]}
    variables, _, loss, opt = _setup(tf, hvd, dict(outer=hvd.OuterLoop(steps=2)))
    out["outer"] = {"returned": [g.numpy().tolist()
                                 for g, _ in opt._compute_gradients(loss, var_list=variables)],
                    "agg_helper": opt._agg_helper}
    variables, _, loss, opt = _setup(tf, hvd, {})
    pairs = opt._compute_gradients(loss, var_list=variables)
    try:
        opt.apply_gradients(reversed(pairs))
        out["other_variables"] = "NO EXCEPTION"
    except ValueError as exc:
        out["other_variables"] = str(exc)
    try:  # a loss already computed, without the tape that recorded it
        opt._compute_gradients(loss(), var_list=variables)
        out["no_tape"] = "NO EXCEPTION"
    except ValueError as exc:
        out["no_tape"] = str(exc)
    return out


def keras_passes(how, passes=3, calls=7, nonfinite_call=2):
    """``backward_passes_per_step=passes`` with the first variable registered local:
    summed ("sum"), averaged (``average_aggregated_gradients``, "mean"), and summed
    with rank 1's gradient of the shared variable inf at call ``nonfinite_call``
    (1-based; "nonfinite"). ``how``: "compute" (Keras 2: ``_compute_gradients`` then
    ``apply_gradients``, what Horovod's aggregation API hands out) or "apply" (the
    gradients given to ``apply_gradients``, Keras 2 and 3). Per call: the gradients
    returned, the weights, Horovod's ``_agg_helper.counter`` and ``iterations``."""
    tf = _tf()
    import hvd_dgc.tensorflow.keras as hvd
    out = {"coef": [c.tolist() for c in _coefficients(hvd.rank())]}
    for name, average, bad in (("sum", False, None), ("mean", True, None),
                               ("nonfinite", False, nonfinite_call)):
        variables, coef, _, opt = _setup(tf, hvd, dict(
            backward_passes_per_step=passes, average_aggregated_gradients=average))
        opt.register_local_var(variables[0])
        inf = np.full(SHAPES[1], np.inf if hvd.rank() == 1 else 0.0, np.float32)

        @tf.function
        def call(extra):  # added to the shared variable's gradient
            constants = [tf.constant(coef[0]), coef[1] + extra]
            if how == "compute":
                def loss():
                    return tf.add_n([tf.reduce_sum(v * c)
                                     for v, c in zip(variables, constants)])
                pairs = opt._compute_gradients(loss, var_list=variables)
                opt.apply_gradients(pairs)
                return [g for g, _ in pairs]
            opt.apply_gradients(zip(constants, variables))
            return []
        history = {"start": _values(variables), "weights": [], "returned": [],
                   "counter": [], "iterations": []}
        for k in range(1, calls + 1):
            extra = inf if k == bad else np.zeros(SHAPES[1], np.float32)
            returned = call(tf.constant(extra))
            history["returned"].append([g.numpy().tolist() for g in returned])
            history["weights"].append(_values(variables))
            history["counter"].append(int(opt._agg_helper.counter.numpy()))
            history["iterations"].append(int(opt.iterations.numpy()))
        stats = opt.compression_stats()
        history.update(exchanges=stats["steps"], nonfinite=stats.get("nonfinite_steps"),
                       paths=stats["paths"])
        out[name] = history
    return out
