"""The sign's compressed allreduce in TensorFlow (hvd_dgc/tensorflow/quantize.py
SignCompressor ``exchange``) on every rank under horovodrun, for
tests/test_sign_reduce.py: the same inputs as the PyTorch run, against the same NumPy
reference (tests/reference.py ``sign_reduce``)."""

import numpy as np

from tests.reference import SIGN_NUMELS, SIGN_STEPS, sign_inputs


def steps(collective="allreduce"):
    """SIGN_STEPS exchanges of each of SIGN_NUMELS' tensors, the memory keeping what was
    not sent: per step the averages, what this rank sent, its server errors (its chunk's
    share of each slot) and its bytes."""
    import tensorflow as tf
    tf.config.threading.set_inter_op_parallelism_threads(2)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    import hvd_dgc.tensorflow as hvd
    from horovod.tensorflow.mpi_ops import global_process_set
    from hvd_dgc.aggregation import slices
    from hvd_dgc.tensorflow.collective import Comm
    hvd.init()
    rank, world = hvd.rank(), hvd.size()
    comp = hvd.Compression.sign(collective=collective)
    slots = [comp.slot((n,), f"t{t}", world) for t, n in enumerate(SIGN_NUMELS)]
    residuals = [np.zeros(n, np.float32) for n in SIGN_NUMELS]
    out = []
    for step in range(SIGN_STEPS):
        record = {"averages": [], "sent": [], "errors": [], "bytes": []}
        for t, (n, x) in enumerate(zip(SIGN_NUMELS, sign_inputs(world, step)[rank])):
            v = residuals[t] + x
            res = comp.exchange(tf.constant(v), (n,), slots[t],
                                Comm(global_process_set, f"sr.{step}.{t}"), None)
            residuals[t] = v - res.sent.numpy()
            lo, hi = slices(n, world)[rank]
            record["averages"].append(res.mean.numpy())
            record["sent"].append(res.sent.numpy())
            record["errors"].append(slots[t].error.numpy()[lo:hi])
            record["bytes"].append(int(res.bytes))
        out.append(record)
    # where delay's or period's threads carry the exchange, the sign is allgathered, and
    # priced so: AdamW's default (0/1 Adam, period 4) and 1-bit Adam (every step)
    from hvd_dgc.tensorflow.exchange import GradientExchange
    collectives = [GradientExchange(optimizer=(False, "AdamW", True), name=f"sr{i}",
                                    **options).compression.collective
                   for i, options in enumerate(({}, {"period": 1}))]
    return {"steps": out, "collectives": collectives}
