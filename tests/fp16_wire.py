"""fp16 on the dense wire with a gradient beyond fp16's range (hvd_dgc/fp16wire.py), the
same steps through the PyTorch optimizer and the TF tape, 2 ranks: every step's weights
go back to the test, which compares them with the NumPy reference
(tests/torch/test_optimizer.py, tests/tensorflow/test_tf.py).
"""

import warnings

import numpy as np

#: per step, per rank: the gradient of a 4-element weight (dense: below min_compress_size).
#: Step 0 carries values beyond fp16's range (65504) on both ranks and beyond what two
#: ranks may sum in fp16; the zeros after it let the residual drain.
GRADS = [
    [[1e5, 1.0, -7e4, 0.5], [3.0, 2.0, -7e4, 0.25]],
    [[0.0, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.125]],
    [[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]],
    [[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]],
    [[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]],
]


def torch_outlier():
    """SGD(lr=1), no momentum: the weight is minus the sum of the averages applied."""
    import torch
    import hvd_dgc.torch as hvd
    rank = hvd.rank()
    w = torch.nn.Parameter(torch.zeros(4))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("fw", w)],
                                   compression=hvd.Compression.fp16)
    weights = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for grads in GRADS:
            opt.zero_grad()
            (w * torch.tensor(grads[rank])).sum().backward()
            opt.step()
            weights.append(w.detach().numpy().copy())
    stats = opt.compression_stats()
    return {"weights": np.stack(weights), "clipped": stats["fp16_clipped"],
            "skipped": stats["nonfinite_steps"],
            "warnings": [str(x.message) for x in caught if "fp16" in str(x.message)]}


def tf_outlier():
    """The same steps through hvd_dgc's DistributedGradientTape inside tf.function."""
    import tensorflow as tf
    import hvd_dgc.tensorflow as hvd
    from hvd_dgc.tensorflow.tape_exchanges import EXCHANGES as _EXCHANGES
    rank = hvd.rank()
    w = tf.Variable(tf.zeros([4]), name="fw")
    before = set(_EXCHANGES)

    @tf.function
    def step(g):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * g)
        grad = hvd.DistributedGradientTape(tape, compression=hvd.Compression.fp16).gradient(
            loss, [w])[0]
        w.assign_sub(grad)

    weights = []
    for grads in GRADS:
        step(tf.constant(grads[rank], tf.float32))
        weights.append(w.numpy().copy())
    exchange, = [e for key, e in _EXCHANGES.items() if key not in before]
    stats = exchange.stats()
    return {"weights": np.stack(weights), "clipped": stats["fp16_clipped"],
            "skipped": stats["nonfinite_steps"]}


def reference(world=2):
    """The weights after every step of GRADS, and the values rank r clipped, from
    hvd_dgc/fp16wire.py's NumPy reference: each rank's payload and residual; Horovod's
    fp16 allreduce adds the payloads in fp16 and halves (Average: exact in fp16)."""
    from hvd_dgc.fp16wire import fp16_payload
    residual = [np.zeros(4, np.float32) for _ in range(world)]
    w, weights, clipped = np.zeros(4, np.float32), [], [0] * world
    for grads in GRADS:
        payloads = []
        for r in range(world):
            payload, residual[r], count = fp16_payload(residual[r] + np.float32(grads[r]), world)
            payloads.append(payload)
            clipped[r] += count
        total = payloads[0]
        for payload in payloads[1:]:
            total = (total.astype(np.float32) + payload.astype(np.float32)).astype(np.float16)
        w = w - (total.astype(np.float32) / world).astype(np.float16).astype(np.float32)
        weights.append(w)
    return np.stack(weights), clipped


#: fp16 values in sparse records (TF): a 4096-element weight, top-k 1%, 3 steps.
RECORD_NUMEL, RECORD_K, RECORD_STEPS = 4096, 41, 3


def record_grads(step, rank):
    """Random magnitudes (no top-k ties, also in the residual's sums), most of them
    values fp16 does not hold exactly."""
    rng = np.random.RandomState(100 * step + rank)
    return rng.uniform(1.0, 4000.0, RECORD_NUMEL).astype(np.float32)


def record_reference(world=2, steps=RECORD_STEPS):
    """Per step the average a tape returns with top-k and fp16 values, no momentum: each
    rank's residual v accumulates g, sends fp16(v) at its top-k (the rounding is lost
    with the sent coordinates, as in PyTorch), and the average is the float32 sum of
    everyone's fp16 values over N."""
    residual = [np.zeros(RECORD_NUMEL, np.float32) for _ in range(world)]
    averages = []
    for step in range(steps):
        total = np.zeros(RECORD_NUMEL, np.float32)
        for rank in range(world):
            v = residual[rank] + record_grads(step, rank)
            top = np.argsort(-np.abs(v), kind="stable")[:RECORD_K]
            total[top] += v[top].astype(np.float16).astype(np.float32)
            v[top] = 0.0
            residual[rank] = v
        averages.append(total * np.float32(1.0 / world))
    return np.stack(averages)


def tf_sparse_records():
    """The tape with fp16 records (``Compression.topk(fp16_values=True, value_bits=16)``;
    8 bits, the default, are held to the reference in tests/core/test_wire_code.py):
    every step's average, the bytes per record, and delay=1 + flush against the
    synchronous run (equal only if the delayed path's own is what the others read: the
    fp16 value). Also:
    Horovod's Compression.fp16 turns fp16 records on, as in PyTorch."""
    import tensorflow as tf
    tf.config.threading.set_inter_op_parallelism_threads(2)
    import hvd_dgc.tensorflow as hvd
    rank = hvd.rank()
    comp = hvd.Compression.topk(fp16_values=True, value_bits=16)
    density = RECORD_K / RECORD_NUMEL
    out = {}
    for delay in (0, 1):
        w = tf.Variable(tf.zeros([RECORD_NUMEL]), name=f"rec{delay}")
        averages = []
        for step in range(RECORD_STEPS):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(w * tf.constant(record_grads(step, rank)))
            tape = hvd.DistributedGradientTape(tape, compression=comp, density=density,
                                               warmup=0, delay=delay)
            (g,) = tape.gradient(loss, [w])
            averages.append(g.numpy())
            w.assign_sub(g)
        opt = tf.keras.optimizers.SGD(1.0)
        hvd.flush(opt)
        stats = hvd.compression_stats()
        stats = stats[-1] if isinstance(stats, list) else stats
        out[delay] = {"averages": np.stack(averages), "weights": w.numpy(),
                      "record_bytes": stats["bytes_sent"] / (RECORD_K * RECORD_STEPS)}
    from hvd_dgc.tensorflow.exchange import GradientExchange
    switched = GradientExchange(compression=hvd.Compression.fp16).compression
    return {"averages": out[0]["averages"], "record_bytes": out[0]["record_bytes"],
            "delayed_record_bytes": out[1]["record_bytes"],
            "delayed_vs_sync": float(np.abs(out[1]["weights"] - out[0]["weights"]).max()),
            "weights_scale": float(np.abs(out[0]["weights"]).max()),
            "switch_fp16_values": switched.fp16_values, "switch_name": switched.name}
