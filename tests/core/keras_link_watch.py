"""tests/core/test_linkwatch.py's Keras job (``python -m tests.core.keras_link_watch DIR
CALLBACKS``), as tests/core/link_watch.py's for PyTorch: one rank in each namespace of
an emulated link whose rate the test drops half-way; Keras 3's ``model.fit`` with hvd_dgc's
optimizer and the default cost model (the link measured). CALLBACKS "horovod": the
``BroadcastGlobalVariablesCallback`` alone, as a Horovod script switched by one line has
it, drives the link watch between batches; "dgc": with ``DGCCallback`` beside it, which
drives it instead.

Rank 0 writes DIR/ready after ``BEFORE`` steps (a window or more later where a probe
had just moved the paths: link_seen.ready) and waits for DIR/changed (the test
changes the link in between; rank 1 waits in the next step's collective); then both
train ``AFTER`` steps more in the same ``fit``. Prints, last, a JSON line of what each
phase measured and how often ``fit`` traced its step; writes its weights to
DIR/weights.<rank>.npy."""

import json
import os
import sys

import numpy as np
import tensorflow as tf

import hvd_dgc.tensorflow.keras as hvd
from tests.core.link_seen import BACKOFF, FLOOR, POSTPONED, ready, seen, \
    wait_for_the_change

BEFORE, AFTER, WINDOW, DENSITY = 24, 24, 4, 0.0625


def _seen(opt, weight):
    """What link_seen records, and the whole plan the step is traced with (each stage's
    paths and the buckets: what GradientExchange._replanned compares)."""
    paths = opt._hvd_dgc.paths
    return dict(seen(opt._hvd_dgc.planner, weight, DENSITY, opt._hvd_dgc.stats()),
                plan=repr(([tuple(s) for s in paths.stages], paths.buckets)))


def main(directory, callbacks):
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    keras = tf.keras
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Input((128,)), keras.layers.Dense(128,
                              activation="tanh"), keras.layers.Dense(4)])
    watch = hvd.LinkWatch(window=WINDOW, floor=FLOOR, backoff=BACKOFF)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9),
                                   density=DENSITY, link_watch=watch,
                                   timeline=False)  # (the watch alone: no plan trial)
    model.compile(optimizer=opt, jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.RandomState(1 + hvd.rank())
    x = rng.randn(64, 128).astype(np.float32)
    y = rng.randint(0, 4, 64)
    out, traced, observed = {}, [], [0]

    class Phases(keras.callbacks.Callback):
        """After hvd_dgc's callbacks: the state before the drop; rank 0 waits for it
        there."""

        def on_train_batch_begin(self, batch, logs=None):
            traced.append(self.model.train_function)  # (held: ids stay apart)

        def on_train_batch_end(self, batch, logs=None):
            if batch == 0:  # the watch exists from the first step's build: count the
                state = opt._hvd_dgc.watcher.state  # steps it is given after this one
                given = state.observe

                def counted(seconds):
                    observed[0] += 1
                    given(seconds)
                state.observe = counted
            done = batch + 1
            if "before" in out or done < BEFORE or (done - BEFORE) % WINDOW or (
                    done < BEFORE + POSTPONED * WINDOW and
                    not ready(opt._hvd_dgc.stats()["relinked_at"], done, WINDOW)):
                return
            weight = max(opt._hvd_dgc.planner.tensors, key=lambda t: t.numel)
            out["before"], out["before_steps"] = _seen(opt, weight), done
            wait_for_the_change(directory, hvd.rank())

    data = tf.data.Dataset.from_tensors((x, y)).repeat()
    steps = BEFORE + POSTPONED * WINDOW + AFTER  # (AFTER or more after the drop)
    model.fit(data, steps_per_epoch=steps, epochs=1, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)] +
              ([hvd.callbacks.DGCCallback(verbose=0)] if callbacks == "dgc" else []) +
              [Phases()])
    weight = max(opt._hvd_dgc.planner.tensors, key=lambda t: t.numel)
    out["after"] = _seen(opt, weight)
    flat = np.concatenate([w.reshape(-1) for w in model.get_weights()])
    np.save(os.path.join(directory, f"weights.{hvd.rank()}.npy"), flat)
    out.update(window=WINDOW, density=DENSITY,
               observed_after_the_first=observed[0], steps=steps,
               train_functions=len({id(f) for f in traced}))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
