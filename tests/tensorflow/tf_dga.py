"""Delayed gradient averaging (``delay=D``) in hvd_dgc.tensorflow, on every rank.

The gradients here do not depend on the weights (``loss = sum(w * c)``), so
the DGA update can be written out exactly and compared step by step, and a
delayed run sends exactly what a synchronous run sends."""

import numpy as np

from tests.lagged import AUTO, SHAPES, fixed_grads as _fixed_grads, \
    period_reference as _period_reference
from tests.tensorflow.tf_dgc import _flat, _identical, _tf

def _init(tf, offset=0):
    rng = np.random.RandomState(3 + offset)
    return [tf.Variable(rng.randn(*s).astype(np.float32), name=f"dga{offset}_{i}")
            for i, s in enumerate(SHAPES)]


def _expected(w0, size, rank, steps, delay, lr, momentum, flushed, grads_at=None):
    """Weights of one rank after ``steps`` steps of dense DGA with DGC's momentum
    correction (dense: own = u = m u + g), and after a flush if ``flushed``;
    ``grads_at(i)``: every rank's gradients of step i (default: ``_fixed_grads``)."""
    u = [[np.zeros(s, np.float64) for s in SHAPES] for _ in range(size)]
    owns, w = [], [x.astype(np.float64) for x in w0]
    for i in range(steps):
        grads = grads_at(i) if grads_at else _fixed_grads(i, None, size)
        for r in range(size):
            u[r] = [momentum * a + g for a, g in zip(u[r], grads[r])]
        owns.append([list(x) for x in u])
        due = [i - delay] if i >= delay else []
        w = _apply(w, owns, due, rank, size, lr, own_step=i)
    if flushed:
        w = _apply(w, owns, range(max(0, steps - delay), steps), rank, size, lr, own_step=None)
    return w


def _apply(w, owns, due, rank, size, lr, own_step):
    update = [np.zeros_like(x) for x in w]
    if own_step is not None:
        update = [a + b for a, b in zip(update, owns[own_step][rank])]
    for j in due:
        avg = [sum(owns[j][r][t] for r in range(size)) / size for t in range(len(w))]
        update = [a + m - o for a, m, o in zip(update, avg, owns[j][rank])]
    return [x - lr * d for x, d in zip(w, update)]


def _max_diff(tf, variables, expected):
    return max(float(np.max(np.abs(v.numpy() - e))) for v, e in zip(variables, expected))


def _run_dense(tf, hvd, train_step, variables, w0, steps, delay, lr, momentum, flush,
               in_flight):
    rank, size = hvd.rank(), hvd.size()
    per_step, identical = [], []
    for i in range(steps):
        train_step([tf.constant(g) for g in _fixed_grads(i, rank)])
        per_step.append(_max_diff(tf, variables, _expected(w0, size, rank, i + 1, delay, lr,
                                                           momentum, False)))
        identical.append(_identical(tf, hvd, variables, f"dga.id.{momentum}.{i}"))
    before = in_flight()
    flushed = flush()
    return {"max_diff_each_step": max(per_step), "identical_before_flush": identical,
            "in_flight_before_flush": before, "flushed": flushed,
            "in_flight_after_flush": in_flight(),
            "max_diff_after_flush": _max_diff(tf, variables, _expected(
                w0, size, rank, steps, delay, lr, momentum, True)),
            "identical_after_flush": _identical(tf, hvd, variables, f"dga.flushed.{momentum}"),
            "moved": max(float(np.max(np.abs(v.numpy() - x))) for v, x in zip(variables, w0))}


def tape_delay_dense_matches_formula(steps=7, delay=2, lr=0.05):
    """Tape, density=1.0 (dense), delay=2, Keras SGD: w_i == the DGA formula at every step;
    hvd.flush(opt) leaves w == w0 - lr * sum of the averages, identical on all ranks."""
    tf = _tf()
    import hvd_dgc.tensorflow as hvd
    variables = _init(tf, 0)
    w0 = [v.numpy() for v in variables]
    opt = tf.keras.optimizers.SGD(lr)

    def train_step(grads):
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * g) for v, g in zip(variables, grads)])
        tape = hvd.DistributedGradientTape(tape, density=1.0, delay=delay)
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))

    out = _run_dense(tf, hvd, train_step, variables, w0, steps, delay, lr, 0.0,
                     lambda: hvd.flush(opt), hvd.in_flight)
    out["iterations"] = int(opt.iterations.numpy())  # the flush is not counted as a step
    return out


def keras_delay_dense_matches_formula(steps=7, delay=2, lr=0.05, momentum=0.9):
    """Keras optimizer (2 or 3 by env), SGD momentum taken over by DGC, dense, delay=2,
    inside tf.function: the DGA formula with own = u at every step, then opt.flush()."""
    tf = _tf()
    import hvd_dgc.tensorflow.keras as hvd
    variables = _init(tf, 1)
    w0 = [v.numpy() for v in variables]
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(lr, momentum=momentum),
                                   density=1.0, delay=delay)

    @tf.function
    def train_step(grads):
        opt.apply_gradients(zip(grads, variables))

    out = _run_dense(tf, hvd, train_step, variables, w0, steps, delay, lr, momentum,
                     opt.flush, lambda: opt.in_flight)
    out["iterations"] = int(opt.iterations.numpy())
    return out


def keras_passes_with_delay(exchanges=5, passes=3, delay=2, lr=0.05, momentum=0.9):
    """Keras SGD (momentum taken over by DGC), dense, ``delay=2`` with
    ``backward_passes_per_step=3`` inside tf.function: every third call exchanges the
    sum of its three passes' gradients, and the weights follow the DGA formula over
    those sums (one step of it per exchange); the calls between leave them alone; then
    opt.flush() ends where the formula's flush does."""
    tf = _tf()
    import hvd_dgc.tensorflow.keras as hvd
    rank, size = hvd.rank(), hvd.size()
    variables = _init(tf, 3)
    w0 = [v.numpy() for v in variables]
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(lr, momentum=momentum),
                                   density=1.0, delay=delay, backward_passes_per_step=passes)

    @tf.function
    def train_step(grads):
        opt.apply_gradients(zip(grads, variables))

    def summed(e):  # every rank's sum of exchange e's passes
        calls = [_fixed_grads(e * passes + p, None, size) for p in range(passes)]
        return [[sum(c[r][t] for c in calls) for t in range(len(SHAPES))] for r in range(size)]

    per_exchange, between, identical = [], [], []
    for e in range(exchanges):
        for p in range(passes):
            before = _flat(tf, variables).numpy()
            train_step([tf.constant(g) for g in _fixed_grads(e * passes + p, rank)])
            if p < passes - 1:
                between.append(float(np.max(np.abs(_flat(tf, variables).numpy() - before))))
        per_exchange.append(_max_diff(tf, variables, _expected(
            w0, size, rank, e + 1, delay, lr, momentum, False, summed)))
        identical.append(_identical(tf, hvd, variables, f"dgap.{e}"))
    in_flight = opt.in_flight
    flushed = opt.flush()
    # DGC at 5%: delayed then flushed ends where the synchronous run does (the gradients
    # do not depend on the weights, so both send the same records). fp32 values: the
    # synchronous step folds the bias into its allgather, in 8 bits its rounding kept
    # for later, where delayed averaging sends it dense
    sparse = {}
    for d in (0, delay):
        v = _init(tf, 4)  # the same values each time, other variables
        sgd = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(lr, momentum=momentum),
                                       density=0.05, min_compress_size=64, delay=d,
                                       backward_passes_per_step=passes,
                                       compression=hvd.Compression.dgc(value_bits=32))

        @tf.function
        def sparse_step(grads, v=v, sgd=sgd):
            sgd.apply_gradients(zip(grads, v))
        for i in range(exchanges * passes):
            sparse_step([tf.constant(g) for g in _fixed_grads(i, rank)])
        sparse[d] = {"in_flight": sgd.in_flight, "flushed": sgd.flush(), "variables": v,
                     "weights": _flat(tf, v),
                     "sparse_sent": sgd.compression_stats()["paths"]}
    return {"max_diff_each_exchange": max(per_exchange), "moved_between": max(between),
            "sparse_in_flight_before_flush": sparse[delay]["in_flight"],
            "sparse_paths": sparse[delay]["sparse_sent"],
            "sparse_delayed_vs_sync": float(np.max(np.abs(
                (sparse[0]["weights"] - sparse[delay]["weights"]).numpy()))),
            "sparse_identical_after_flush": _identical(tf, hvd, sparse[delay]["variables"],
                                                       "dgap.sparse"),
            "identical_before_flush": identical, "in_flight_before_flush": in_flight,
            "flushed": flushed, "iterations": int(opt.iterations.numpy()),
            "max_diff_after_flush": _max_diff(tf, variables, _expected(
                w0, size, rank, exchanges, delay, lr, momentum, True, summed)),
            "identical_after_flush": _identical(tf, hvd, variables, "dgap.flushed"),
            "moved": max(float(np.max(np.abs(v.numpy() - x))) for v, x in zip(variables, w0))}


def tape_delay_sparse_flush_equals_synchronous(steps=8, delay=2, lr=0.05):
    """DGC 5% inside tf.function: delay=2 then flush == delay=0 (same gradients, so the
    same values are sent), ranks differ while averages are in flight, identical after.
    Two wires: fp32 values, the bias dense (the synchronous step folds it into its
    allgather, delayed averaging sends it apart), and the default 8-bit values with every
    tensor sparse, where both steps round alike and keep the rounding in the memory."""
    return {f"{bits} bits": _delay_flush_run(steps, delay, lr, bits, min_size)
            for bits, min_size in ((32, 64), (8, 0))}


def _delay_flush_run(steps, delay, lr, value_bits, min_compress_size):
    tf = _tf()
    import hvd_dgc.tensorflow as hvd
    rank = hvd.rank()
    runs = {}
    for d in (0, delay):
        variables = _init(tf, 2)  # same values, other variables: another exchange
        opt = tf.keras.optimizers.SGD(lr)

        @tf.function
        def train_step(grads, variables=variables, opt=opt, d=d):
            with tf.GradientTape() as tape:
                loss = tf.add_n([tf.reduce_sum(v * g) for v, g in zip(variables, grads)])
            tape = hvd.DistributedGradientTape(
                tape, density=0.05, min_compress_size=min_compress_size, delay=d,
                compression=hvd.Compression.dgc(value_bits=value_bits))
            opt.apply_gradients(zip(tape.gradient(loss, variables), variables))

        identical = []
        for i in range(steps):
            train_step([tf.constant(g) for g in _fixed_grads(i, rank)])
            identical.append(_identical(tf, hvd, variables, f"dgas.{value_bits}.{d}.{i}"))
        runs[d] = {"variables": variables, "identical": identical, "in_flight": hvd.in_flight(),
                   "flushed": hvd.flush(opt) if d else None}
    stats = hvd.compression_stats()
    sync, delayed = runs[0]["variables"], runs[delay]["variables"]
    return {"max_diff_vs_synchronous": float(np.max(np.abs(
                (_flat(tf, sync) - _flat(tf, delayed)).numpy()))),
            "identical_sync": runs[0]["identical"],
            "identical_delayed_before_flush": runs[delay]["identical"],
            "in_flight_before_flush": runs[delay]["in_flight"],
            "flushed": runs[delay]["flushed"],
            "identical_after_flush": _identical(tf, hvd, delayed,
                                                f"dgas.{value_bits}.flushed"),
            "paths": [s["paths"] for s in (stats if isinstance(stats, list) else [stats])][-2:]}


def delay_bad_inputs():
    """delay must be an int >= 0; the Keras optimizer needs an update linear in the
    gradient (SGD, or Adam taken over) for delay > 0."""
    tf = _tf()
    import hvd_dgc.tensorflow as hvd
    import hvd_dgc.tensorflow.keras as hvd_keras
    out = {}
    for label, fn in (
            ("negative", lambda: hvd.DistributedGradientTape(tf.GradientTape(), delay=-1)),
            ("float", lambda: hvd.DistributedGradientTape(tf.GradientTape(), delay=1.5)),
            ("rmsprop", lambda: hvd_keras.DistributedOptimizer(
                tf.keras.optimizers.RMSprop(), delay=2))):
        try:
            fn()
            out[label] = "NO EXCEPTION"
        except ValueError as exc:
            out[label] = str(exc)
    return out


def _keras_momentum_sgd(tf, variables, lr, options):
    """hvd_dgc's Keras optimizer over SGD momentum 0.9 (taken over by DGC's memory) and a
    tf.function step applying given gradients (returns True: the step ran)."""
    import hvd_dgc.tensorflow.keras as hvd_keras
    opt = hvd_keras.DistributedOptimizer(tf.keras.optimizers.SGD(lr, momentum=0.9), **options)

    @tf.function
    def train_step(grads):
        opt.apply_gradients(zip(grads, variables))
        return tf.constant(True)
    return opt, train_step


def _nonfinite_run(tf, kind, bad_step, nan_rank, steps=6, lr=0.05, skip=True):
    """Fixed gradients through DGC 5% (tape in tf.function, or the Keras optimizer with
    SGD momentum); ``nan_rank`` puts a NaN into its gradient at ``bad_step`` (None:
    that step's batch is left out on every rank instead, the reference)."""
    import hvd_dgc.tensorflow as hvd
    rank = hvd.rank()
    variables = _init(tf, 5 if kind == "tape" else 6)
    options = dict(density=0.05, min_compress_size=64, skip_nonfinite=skip)
    if kind == "tape":
        opt = tf.keras.optimizers.SGD(lr)

        @tf.function
        def train_step(grads):
            with tf.GradientTape() as tape:
                loss = tf.add_n([tf.reduce_sum(v * g) for v, g in zip(variables, grads)])
            out = hvd.DistributedGradientTape(tape, **options).gradient(loss, variables)
            finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in out])
            tf.cond(finite, lambda: opt.apply_gradients(zip(out, variables)) is not None,
                    lambda: False)
            return finite
        state = lambda: hvd.compression_stats()  # noqa: E731
    else:
        opt, train_step = _keras_momentum_sgd(tf, variables, lr, options)
        state = opt.compression_stats
    finite = []
    for i in range(steps):
        grads = _fixed_grads(i, rank)
        if i == bad_step:
            if nan_rank is None:
                continue
            if rank == nan_rank:
                grads[0][3, 4] = np.nan
        finite.append(bool(train_step([tf.constant(g) for g in grads])))
    stats = state()
    stats = stats[-1] if isinstance(stats, list) else stats
    return variables, finite, stats, opt


def nonfinite_skips_the_step(kind="tape"):
    """Rank 1 has a NaN at step 3: every rank skips it, memory and step untouched, and
    the run ends where a run without step 3 ends, bit for bit."""
    tf = _tf()
    import hvd_dgc.tensorflow as hvd
    ref, _, ref_stats, ref_opt = _nonfinite_run(tf, kind, 3, None)
    got, finite, stats, opt = _nonfinite_run(tf, kind, 3, 1)
    return {"max_diff_vs_run_without_the_step": float(np.max(np.abs(
                (_flat(tf, ref) - _flat(tf, got)).numpy()))),
            "finite_returned": finite, "nonfinite_steps": stats["nonfinite_steps"],
            "ref_nonfinite_steps": ref_stats["nonfinite_steps"],
            "steps": stats["step"], "ref_steps": ref_stats["step"],
            "iterations": int(opt.iterations.numpy()),
            "ref_iterations": int(ref_opt.iterations.numpy()),
            "weights_finite": bool(np.all(np.isfinite(_flat(tf, got).numpy()))),
            "identical": _identical(tf, hvd, got, f"nf.{kind}"),
            **(_memory_control(tf, hvd) if kind == "tape" else {})}


def _memory_control(tf, hvd):
    """The tape's memories are finite after the skipped step; with skip_nonfinite=False
    the NaN enters rank 1's memory, where DGC's threshold never selects it (NaN >= t
    is false): it would stay there unseen."""
    def memory_finite():
        return all(bool(np.all(np.isfinite(v.numpy()))) for v in hvd.dgc_state.variables)
    with_skip = memory_finite()
    _, finite, _, _ = _nonfinite_run(tf, "tape", 3, 1, skip=False)
    return {"memory_finite_with_skip": with_skip, "memory_finite_without_skip": memory_finite(),
            "finite_returned_without_skip": finite}


def keras_nonfinite_skips_the_step():
    return nonfinite_skips_the_step("keras")


def delayed_nonfinite_is_dropped_on_its_rank(steps=6, delay=2, lr=0.05, kind="tape"):
    """delay=2: rank 1's NaN at step 3 (in tensor 0) is kept out of its memory, which
    does not move for that tensor (u and v as before the step: the PyTorch side's rule,
    tests/reference.py), and rank 1 sends zeros for it (the others applied their part of
    step 3 already); its other tensors go on. After the flush every rank holds the same
    finite weights. ``kind``: the tape (no momentum) or the Keras optimizer (SGD momentum
    0.9, taken over by the memory: u moves too)."""
    tf = _tf()
    import hvd_dgc.tensorflow as hvd
    rank = hvd.rank()
    variables = _init(tf, 7 if kind == "tape" else 8)
    options = dict(density=0.05, min_compress_size=64, delay=delay)
    if kind == "tape":
        opt = tf.keras.optimizers.SGD(lr)

        @tf.function
        def train_step(grads):
            with tf.GradientTape() as tape:
                loss = tf.add_n([tf.reduce_sum(v * g) for v, g in zip(variables, grads)])
            tape = hvd.DistributedGradientTape(tape, **options)
            opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
    else:
        opt, train_step = _keras_momentum_sgd(tf, variables, lr, options)

    def memory():
        if kind != "tape":
            return opt._hvd_dgc.memory
        from hvd_dgc.tensorflow.tape_exchanges import EXCHANGES as _EXCHANGES
        return list(_EXCHANGES.values())[-1].memory  # not the other scenarios' memories

    def tensor(i):  # tensor i's memory: v, and u where momentum is taken over
        mem = memory()
        return [mem.v[i].numpy().copy()] + ([mem.u[i].numpy().copy()] if mem.u else [])

    moved = {}
    for i in range(steps):
        grads = _fixed_grads(i, rank)
        if i == 3:
            before = [tensor(0), tensor(1)]
            if rank == 1:
                grads[0][3, 4] = np.nan
        train_step([tf.constant(g) for g in grads])
        if i == 3:
            after = [tensor(0), tensor(1)]
            moved = {f"tensor{j}": [not np.array_equal(x, y) for x, y in zip(b, a)]
                     for j, (b, a) in enumerate(zip(before, after))}
    if kind == "tape":
        hvd.flush(opt)
        stats = hvd.compression_stats()
        stats = stats[-1] if isinstance(stats, list) else stats  # this process's newest
    else:
        opt.flush()
        stats = opt.compression_stats()
    return {"nonfinite_steps": stats["nonfinite_steps"], "moved": moved,
            "momentum": bool(memory().u),
            "memory_finite": all(bool(np.all(np.isfinite(v.numpy())))
                                 for v in memory().variables),
            "weights_finite": bool(np.all(np.isfinite(_flat(tf, variables).numpy()))),
            "identical_after_flush": _identical(tf, hvd, variables, f"nfd.{kind}.flushed")}


def keras_delayed_nonfinite_is_dropped_on_its_rank():
    return delayed_nonfinite_is_dropped_on_its_rank(kind="keras")


# -- temporally sparse updates (period=p), against tests/reference.py -------------------
PERIODS = {
    # name: (kind, density or None, momentum, period, delay, steps)
    "keras_dense_p3": ("keras", None, 0.9, 3, 0, 8),
    "keras_topk_p2_delay1": ("keras", 0.05, 0.9, 2, 1, 9),
    "tape_dense_p2_delay3": ("tape", None, 0.0, 2, 3, 9),
}


def period_matches_reference():
    """``period=p`` (with ``delay=D``) in TensorFlow, step by step against the NumPy
    reference: Keras SGD with its momentum taken over (dense, and exact top-k at 5%,
    inside tf.function) and the tape (dense, eager); weights every step, steps in
    flight, collectives only on exchange steps, ranks identical after the flush."""
    tf = _tf()
    import hvd_dgc.tensorflow as hvd_tape
    import hvd_dgc.tensorflow.keras as hvd_keras
    rank, size = hvd_keras.rank(), hvd_keras.size()
    out = {}
    for n, (name, (kind, density, momentum, period, delay, steps)) in enumerate(
            PERIODS.items()):
        variables = _init(tf, 10 + n)
        w0 = [v.numpy() for v in variables]
        options = dict(period=period, delay=delay, aggregation="allgather" if density else
                       "auto", min_compress_size=0)
        # fp32 values: the reference sums the records exactly
        options.update(density=density, warmup=0, momentum_masking=True,
                       compression=hvd_keras.Compression.topk(value_bits=32)) \
            if density else options.update(density=1.0)
        if kind == "keras":
            opt = hvd_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.05, momentum),
                                                 **options)

            @tf.function
            def train_step(grads, opt=opt, variables=variables):
                opt.apply_gradients(zip(grads, variables))
            flush, in_flight = opt.flush, (lambda opt=opt: opt.in_flight)
            stats = opt.compression_stats
        else:
            opt = tf.keras.optimizers.SGD(0.05)
            tapes = []

            def train_step(grads, opt=opt, variables=variables, tapes=tapes):
                with tf.GradientTape() as tape:
                    loss = tf.add_n([tf.reduce_sum(v * g) for v, g in zip(variables, grads)])
                tape = hvd_tape.DistributedGradientTape(tape, **options)
                tapes.append(tape)
                opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
            flush, in_flight = (lambda opt=opt: hvd_tape.flush(opt)), hvd_tape.in_flight
            stats = None
        expected, flushed = _period_reference(w0, size, steps, density, momentum, period,
                                              delay)
        diffs, spread, waiting = [], [], []
        for i in range(steps):
            train_step([tf.constant(g) for g in _fixed_grads(i, rank)])
            diffs.append(_max_diff(tf, variables, expected[i][rank]))
            everyone = hvd_keras.allgather(tf.expand_dims(_flat(tf, variables), 0),
                                           name=f"per.{name}.{i}").numpy()
            spread.append(float(np.max(everyone.max(0) - everyone.min(0))))
            waiting.append(in_flight())
        summary = stats() if stats is not None else hvd_tape.compression_stats()
        if isinstance(summary, list):
            summary = summary[-1]
        done = flush()
        out[name] = {
            "max_diff_each_step": max(diffs), "spread": spread, "in_flight": waiting,
            "flushed": bool(done), "in_flight_after_flush": in_flight(),
            "max_diff_after_flush": _max_diff(tf, variables, flushed[rank]),
            "identical_after_flush": _identical(tf, hvd_keras, variables, f"per.{name}.f"),
            "paths": summary["paths"], "period": period, "delay": delay, "steps": steps,
            "tensors": len(variables),
            "moved": max(float(np.max(np.abs(v.numpy() - x))) for v, x in zip(variables, w0))}
    return out


def auto_delay_matches_reference(steps=16, momentum=0.9):
    """delay=AutoDelay(...) in Keras (SGD momentum taken over, dense, in tf.function): the
    D each step ran with, on every rank, and the weights at every step and after the
    flush against tests/reference.py fed that same sequence of D (as PyTorch's test)."""
    import time
    tf = _tf()
    import hvd_dgc.tensorflow.keras as hvd
    rank = hvd.rank()
    out = {}
    for n, (name, (start_d, idle, period, extra)) in enumerate(AUTO.items()):
        variables = _init(tf, 20 + n)
        w0 = [v.numpy() for v in variables]
        config = hvd.AutoDelay(max_delay=4, window=2, start=start_d, idle=idle)
        opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.05, momentum),
                                       density=1.0, delay=config, period=period)

        @tf.function
        def train_step(grads, opt=opt, variables=variables):
            opt.apply_gradients(zip(grads, variables))
        trace, weights = [], []
        for i in range(steps):
            time.sleep(extra)
            trace.append(opt.compression_stats()["delay"] if i else start_d)
            train_step([tf.constant(g) for g in _fixed_grads(i, rank)])
            weights.append([v.numpy() for v in variables])
        stats = opt.compression_stats()
        opt.flush()
        expected, flushed = _period_reference(w0, hvd.size(), steps, None, momentum, period,
                                              trace)
        everyone = hvd.allgather(tf.constant([trace], tf.int32),
                                 name=f"ad.trace.{name}").numpy().tolist()
        out[name] = {
            "trace": trace, "traces": everyone, "decisions": stats["delay_decisions"],
            "max_diff_each_step": max(max(float(np.max(np.abs(a - b))) for a, b in
                                          zip(weights[i], expected[i][rank]))
                                      for i in range(steps)),
            "max_diff_after_flush": _max_diff(tf, variables, flushed[rank]),
            "identical_after_flush": _identical(tf, hvd, variables, f"ad.flush.{name}"),
            "moved": max(float(np.max(np.abs(v.numpy() - x))) for v, x in zip(variables, w0))}
    return out


def period_bad_inputs():
    """period needs an update linear in the gradient and a one-round compressor: each
    refused with the fix; elastic Keras takes it (its commits flush)."""
    tf = _tf()
    import hvd_dgc.tensorflow as hvd
    import hvd_dgc.tensorflow.keras as hvd_keras
    out = {}
    for label, fn in (
            ("zero", lambda: hvd.DistributedGradientTape(tf.GradientTape(), period=0)),
            ("rmsprop", lambda: hvd_keras.DistributedOptimizer(
                tf.keras.optimizers.RMSprop(), period=3)),
            ("powersgd", lambda: hvd.DistributedGradientTape(
                tf.GradientTape(), period=2, compression=hvd.Compression.powersgd))):
        try:
            fn()
            out[label] = "NO EXCEPTION"
        except ValueError as exc:
            out[label] = str(exc)
    from hvd_dgc.tensorflow.exchange import GradientExchange
    out["elastic"] = GradientExchange(period=2, density=1.0).elastic_refusal()
    return out


def auto_delay_checkpoint(ckdir, steps=16):
    """delay="auto"'s D goes into the checkpoint with DGC's state: a run whose D climbed
    from 1 to 4 (the "up" measurements), flushed and saved, and a fresh optimizer with
    the same AutoDelay restored from it run their next steps at D = 4; a fresh one not
    restored starts again from 1 (as PyTorch's checkpoint keeps its D)."""
    import os
    tf = _tf()
    import hvd_dgc.tensorflow.keras as hvd
    rank = hvd.rank()
    path = os.path.join(ckdir, f"autodelay_rank{rank}")
    start_d, idle, period, _ = AUTO["up"]

    def build():
        variables = _init(tf, 40)
        opt = hvd.DistributedOptimizer(
            tf.keras.optimizers.SGD(0.05, 0.9), density=1.0, period=period,
            delay=hvd.AutoDelay(max_delay=4, window=2, start=start_d, idle=idle))

        @tf.function
        def train_step(grads):
            opt.apply_gradients(zip(grads, variables))
        return opt, variables, train_step

    opt, variables, train_step = build()
    for i in range(steps):
        train_step([tf.constant(g) for g in _fixed_grads(i, rank)])
    saved = opt.compression_stats()["delay"]
    opt.flush()
    tf.train.Checkpoint(dgc=opt.dgc_state).write(path)
    out = {"saved": saved}
    for tag, restore in (("restored", True), ("fresh", False)):
        opt, variables, train_step = build()
        if restore:
            tf.train.Checkpoint(dgc=opt.dgc_state).read(path).expect_partial()
        delays = []
        for i in range(steps, steps + 2):
            train_step([tf.constant(g) for g in _fixed_grads(i, rank)])
            delays.append(opt.compression_stats()["delay"])
        opt.flush()
        out[tag] = delays
    return out

