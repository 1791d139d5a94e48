"""tests/core/test_linkprobe.py's Keras plan trial (``python -m tests.core.keras_plan_trial``):
one rank in each namespace of the emulated 100 Mbit/s link (where the cost model's sums
send the 65k-element kernel sparse at density 0.001 whatever this machine's speed), Keras 3's
``model.fit`` switched by one line: hvd_dgc's optimizer and its
``BroadcastGlobalVariablesCallback``, the link measured. Where the sums' plan sends the
kernel sparse, it and every tensor dense run 5 steps each (hvd_dgc/tensorflow/
plan_trial.py). Rank 1 alone is made slow (0.5 s a step) on one plan, so its times
decide: "dense" slows the dense plan (the sums' must be kept), "sparse" the sums' (dense
kept). Prints, last, a JSON line of what each fit did."""

import contextlib
import io
import json
import time

import numpy as np
import tensorflow as tf

import hvd_dgc.tensorflow.keras as hvd
from hvd_dgc.overlap import sums_send_sparse
from tests.tensorflow.tf_dgc import _identical

DENSITY, BATCHES, SLEEP = 0.001, 20, 0.5


def fit(slow):
    keras = tf.keras
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Input((256,)), keras.layers.Dense(256),
                              keras.layers.Dense(4)])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01, momentum=0.9), density=DENSITY)
    model.compile(optimizer=opt, jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    traced, planned = [], []

    class Slow(keras.callbacks.Callback):
        """After hvd_dgc's callback: rank 1 waits on the plan ``slow`` names."""

        def on_train_batch_begin(self, batch, logs=None):
            traced.append(self.model.train_function)  # (held: ids stay apart)
            planner = getattr(opt._hvd_dgc, "planner", None)
            if planner is None:
                return  # (built in the first step)
            dense = bool(planner.forced_dense)
            planned.append("dense" if dense else "sums")
            if hvd.rank() == 1 and dense == (slow == "dense"):
                time.sleep(SLEEP)

    rng = np.random.RandomState(hvd.rank())
    x = rng.randn(16 * BATCHES, 256).astype(np.float32)
    y = rng.randint(0, 4, 16 * BATCHES)
    line = io.StringIO()
    with contextlib.redirect_stdout(line):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), Slow()])
    exchange = opt._hvd_dgc
    planner = exchange.planner
    weight = max(planner.tensors, key=lambda t: t.numel)
    return {"line": line.getvalue(), "trials": exchange.stats()["plan_trials"],
            "planned": planned, "forced": sorted(planner.forced_dense),
            "path": str(planner.path(weight, DENSITY)),
            "sums_sparse": sums_send_sparse(planner, DENSITY),
            "train_functions": len({id(f) for f in traced}),
            "identical": _identical(tf, hvd, model.trainable_variables, f"trial.{slow}")}


def main():
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    print(json.dumps({slow: fit(slow) for slow in ("dense", "sparse")}), flush=True)


if __name__ == "__main__":
    main()
