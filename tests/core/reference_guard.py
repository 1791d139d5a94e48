"""skip_nonfinite through the real optimizer / exchange, one process (world 1), for
tests/core/test_reference.py: a NaN gradient at one step, with delay 0 and delay 2.

Run as ``python -m tests.core.reference_guard {torch|tf} OUT.pkl``: the test runs it
in a subprocess because it calls ``hvd.init()``, which the pytest process must not do.
Each run records, per step, the memory (u, v) after the step, the update applied and the
step counter, for the test to compare with tests/reference.py.
"""

import pickle
import sys
import warnings

import numpy as np

NUMEL, DENSITY, MOMENTUM, LR = 64, 0.0625, 0.9, 1.0  # k = 4 of 64
BAD_STEP, STEPS, DELAYS = 2, 5, (0, 2)


def grads():
    """The gradients every run sees (the test feeds the same ones to the reference)."""
    rng = np.random.RandomState(7)
    out = [rng.randn(NUMEL).astype(np.float32) for _ in range(STEPS)]
    out[BAD_STEP][5] = np.nan
    return out


def torch_run():
    import torch
    import horovod.torch as hvd
    import hvd_dgc.torch as dgc
    hvd.init()
    runs = {}
    for delay in DELAYS:
        p = torch.nn.Parameter(torch.zeros(NUMEL))
        opt = dgc.DistributedOptimizer(
            torch.optim.SGD([p], lr=LR, momentum=MOMENTUM), named_parameters=[(f"w{delay}", p)],
            compression=dgc.Compression.topk(value_bits=32), density=DENSITY,
            min_compress_size=16, momentum_masking=True, aggregation="allgather",
            delay=delay)  # (fp32 values, as the reference sums them)
        steps = []
        for g in grads():
            before = p.detach().clone()
            opt.zero_grad()
            p.grad = torch.tensor(g)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # the skip's warning
                opt.step()
            (buf,) = opt.dgc_memory().values()
            steps.append({"u": buf["u"].numpy().copy(), "v": buf["v"].numpy().copy(),
                          "update": ((before - p.detach()) / LR).numpy(),
                          "step": opt.compression_stats()["step"]})
        runs[delay] = steps
    return runs


def tf_run():
    import tensorflow as tf
    import horovod.tensorflow as hvd
    from hvd_dgc.tensorflow.compression import Compression
    from hvd_dgc.tensorflow.exchange import GradientExchange
    hvd.init()
    runs = {}
    for delay in DELAYS:
        var = tf.Variable(tf.zeros([NUMEL]))
        ex = GradientExchange(compression=Compression.topk(value_bits=32), density=DENSITY,
                              min_compress_size=16, momentum=MOMENTUM, momentum_masking=True,
                              aggregation="allgather", delay=delay,
                              name=f"ref{delay}")  # (fp32 values, as the reference)
        ex.build([var])
        steps = []
        for g in grads():
            out, _ = ex.exchange([tf.constant(g)])
            steps.append({"u": ex.memory.u[0].numpy().copy(), "v": ex.memory.v[0].numpy().copy(),
                          "update": out[0].numpy(), "step": int(ex.step.numpy())})
        runs[delay] = steps
    return runs


if __name__ == "__main__":
    framework, path = sys.argv[1], sys.argv[2]
    result = {"torch": torch_run, "tf": tf_run}[framework]()
    with open(path, "wb") as f:
        pickle.dump(result, f)
