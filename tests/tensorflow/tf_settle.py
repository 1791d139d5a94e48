"""Body of tests/tensorflow/test_settle.py, run on 2 ranks: the dense path's shortcut in
TensorFlow (hvd_dgc/tensorflow/paths.py ``DensePath.shortcut``, memory.py ``settle``).

A Keras SGD with momentum 0.9 wrapped by hvd_dgc's DistributedOptimizer, DGC 5% with
momentum masking off, on a loss whose gradient is a known array per rank and step
(``sum(w * c)``: the gradient is ``c``), so every step can be held to the maths with no
model in between. Tensor ``w`` (4096) travels sparse on an assumed slow link, then the
link is "measured" fast and DGC's own work dear (``relink``: as the link watch does),
which sends it dense: its residual must be delivered and its momentum become the ranks'
average, after which its dense steps send the gradient itself. Tensor ``b`` (8, below
min_compress_size) is dense from the start. One settled step has a NaN on rank 1:
every rank skips it, with no copy of the settled memory taken.

Without masking, the average of the ranks' velocities follows ``U_t = m U_(t-1) + G_t``
(G_t the average gradient) and every unit of it is applied once: sparse steps apply
part and keep the rest in ``v`` (error feedback), the first dense step applies what was
kept. So after the dense steps the applied updates add up to sum U_t, and each settled
step applies U_t itself."""

import numpy as np

from tests.tensorflow.tf_dgc import _identical, _tf

N, SMALL, LR, MOMENTUM = 4096, 8, 0.5, 0.9
SPARSE, DENSE, NAN_AT = 5, 6, 3  # steps before the relink, after it; the NaN's dense step


def _c(step, rank, n, salt):
    return np.random.RandomState(1000 * salt + 10 * step + rank).randn(n).astype(np.float32)


def shortcut(dense_steps=DENSE):
    tf = _tf()
    import hvd_dgc.tensorflow.keras as hvd
    from hvd_dgc.costmodel import CostModel
    from hvd_dgc.linkprobe import LinkMeasurement
    from hvd_dgc.localcost import LocalCost
    hvd.init()
    rank, world = hvd.rank(), hvd.size()
    w = tf.Variable(tf.zeros([N]), name="w")
    b = tf.Variable(tf.zeros([SMALL]), name="b")
    opt = hvd.DistributedOptimizer(
        tf.keras.optimizers.SGD(LR, momentum=MOMENTUM), density=0.05, warmup=0,
        momentum_masking=False, min_compress_size=64,
        # a slow link of no latency whose allgather is slower still: b keeps its own
        # allreduce (never folded into w's allgather, in 8 bits), so it can take the
        # shortcut; w goes sparse
        cost_model=CostModel(bandwidth=1e5, alpha=0.0, gather_bandwidth=2e4))

    def make_step():
        @tf.function
        def step(cw, cb):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(w * cw) + tf.reduce_sum(b * cb)
            grads = tape.gradient(loss, [w, b])
            opt.apply_gradients(zip(grads, [w, b]))
        return step

    def state():
        e = opt._hvd_dgc
        return {"paths": [[k.value for k in s] for s in e.paths.stages],
                "apart": e.memory.apart.numpy().tolist()}

    step, seen, applied, means = make_step(), [], [], []
    before = [w.numpy(), b.numpy()]
    total = SPARSE + dense_steps
    for t in range(total):
        if t == SPARSE:  # the link measured fast, DGC's selection dear: w goes dense
            seen.append(state())
            e = opt._hvd_dgc
            e.planner.local = LocalCost(1e-3, 1e-3, 1e-3)
            e.relink(LinkMeasurement(1e-6, 1.25e10, 0.01, 1 << 20, 1.25e10))
            seen.append(state())
            step = make_step()  # as fit traces its step again
        cw, cb = _c(t, rank, N, 1), _c(t, rank, SMALL, 2)
        nan = t == SPARSE + NAN_AT
        if nan and rank == 1:
            cw[7] = np.nan
        step(tf.constant(cw), tf.constant(cb))
        now = [w.numpy(), b.numpy()]
        applied.append([((x - y) / LR).tolist() for x, y in zip(before, now)])
        before = now
        means.append([None if nan else np.mean([_c(t, r, n, s) for r in range(world)],
                                               axis=0).tolist()
                      for n, s in ((N, 1), (SMALL, 2))])
    seen.append(state())
    e = opt._hvd_dgc
    return {"seen": seen, "applied": applied, "means": means, "sparse": SPARSE,
            "nan_at": SPARSE + NAN_AT, "u": [u.numpy().tolist() for u in e.memory.u],
            "v_norm": [float(np.abs(v.numpy()).sum()) for v in e.memory.v],
            "stats": e.stats(), "identical": _identical(tf, hvd, [w, b], "settle.id"),
            "u_identical": _identical(tf, hvd, list(e.memory.u), "settle.u")}
