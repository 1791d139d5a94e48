"""The sign's compressed allreduce in TensorFlow (hvd_dgc/tensorflow/quantize.py
SignCompressor ``exchange``) on every rank under horovodrun, for
tests/core/test_sign_reduce.py: the same inputs as the PyTorch run, against the same NumPy
reference (tests/reference.py ``sign_reduce``)."""

import numpy as np

from tests.reference import SIGN_NUMELS, SIGN_STEPS, sign_inputs


def steps(collective="allreduce"):
    """SIGN_STEPS exchanges of SIGN_NUMELS' tensors together (``exchange_group``, as a
    step's), the memory keeping what was not sent: per step the averages, what this rank
    sent, its server errors (its chunk's part of each slot: ``{tensor: (start,
    error)}``) and each tensor's bytes."""
    import tensorflow as tf
    tf.config.threading.set_inter_op_parallelism_threads(2)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    import hvd_dgc.tensorflow as hvd
    from horovod.tensorflow.mpi_ops import global_process_set
    from hvd_dgc.aggregation import chunk_spans
    from hvd_dgc.tensorflow.collective import Comm
    hvd.init()
    rank, world = hvd.rank(), hvd.size()
    comp = hvd.Compression.sign(collective=collective)
    slots = [comp.slot((n,), f"t{t}", world) for t, n in enumerate(SIGN_NUMELS)]
    residuals = [np.zeros(n, np.float32) for n in SIGN_NUMELS]
    spans = chunk_spans(SIGN_NUMELS, world)[rank]
    out = []
    for step in range(SIGN_STEPS):
        vs = [r + x for r, x in zip(residuals, sign_inputs(world, step)[rank])]
        res = comp.exchange_group([tf.constant(v) for v in vs], [(n,) for n in SIGN_NUMELS],
                                  slots, Comm(global_process_set, f"sr.{step}"), None)
        residuals = [v - r.sent.numpy() for v, r in zip(vs, res)]
        out.append({"averages": [r.mean.numpy() for r in res],
                    "sent": [r.sent.numpy() for r in res],
                    "errors": {t: (lo, slots[t].error.numpy()[lo:hi]) for t, lo, hi in spans},
                    "bytes": [int(r.bytes) for r in res]})
    # where delay's or period's threads carry the exchange, the sign is allgathered, and
    # priced so: AdamW's default (0/1 Adam, period 4) and 1-bit Adam (every step)
    from hvd_dgc.tensorflow.exchange import GradientExchange
    collectives = [GradientExchange(optimizer=(False, "AdamW", True), name=f"sr{i}",
                                    **options).compression.collective
                   for i, options in enumerate(({}, {"period": 1}))]
    return {"steps": out, "collectives": collectives}


def tape_group(steps=3, shapes=((200, 100), (100, 50)), delay=0):
    """A tape's step with ``Compression.sign(collective="allreduce")`` (eager, no
    momentum) on every rank: its weights' signs in one compressed allreduce a step
    (tensorflow/paths.py ``ExchangePaths``; with ``delay``, on delayed averaging's
    threads), a small bias dense beside them. Per step each weight's v (residual +
    gradient), its residual after, and what the tape returned (the average; with a
    delay, this rank's own plus a correction); the paths and bytes counted."""
    import tensorflow as tf
    import hvd_dgc.tensorflow as hvd
    from hvd_dgc.tensorflow.tape_exchanges import EXCHANGES
    hvd.init()
    rank = hvd.rank()
    ws = [tf.Variable(tf.zeros(shape), name=f"sg{j}") for j, shape in enumerate(shapes)]
    b = tf.Variable(tf.zeros([8]), name="sgb")
    comp = hvd.Compression.sign(collective="allreduce")
    rows = []
    exchange = None
    for step in range(steps):
        gs = [np.random.RandomState(50 * step + 7 * j + rank).randn(*shape).astype(np.float32)
              for j, shape in enumerate(shapes)]
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(w * g) for w, g in zip(ws, gs)]) + tf.reduce_sum(b)
        tape = hvd.DistributedGradientTape(tape, compression=comp, delay=delay,
                                           cost_model=hvd.CostModel())
        before = [exchange.memory.v[j].numpy() for j in range(len(ws))] if exchange \
            else [np.zeros(int(np.prod(s)), np.float32) for s in shapes]
        *avgs, _ = tape.gradient(loss, ws + [b])
        exchange = next(e for e in EXCHANGES.values()
                        if e.memory is not None and e.names[0].startswith("sg0"))
        rows.append({"v": [bf + g.reshape(-1) for bf, g in zip(before, gs)],
                     "residual": [exchange.memory.v[j].numpy() for j in range(len(ws))],
                     "avg": [a.numpy().reshape(-1) for a in avgs]})
        for w, a in zip(ws, avgs):
            w.assign_sub(0.1 * a)
    stats = exchange.stats()
    return {"steps": rows, "paths": stats["paths"], "bytes": stats["bytes_sent"]}


def keras_adamw_default():
    """tests/tensorflow/tf_adam.py ``zero_one_fit`` (Keras' AdamW with no option in
    model.fit) on its own launch."""
    import hvd_dgc.tensorflow.keras as hvd
    from tests.tensorflow.tf_adam import zero_one_fit
    hvd.init()
    return zero_one_fit()
