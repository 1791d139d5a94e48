"""MNIST with Keras `model.fit` and Horovod, in the shape of Horovod's
examples/tensorflow2/tensorflow2_keras_mnist.py, with DGC one flag away.

    horovodrun -np 2 -H localhost:2 python examples/keras_mnist.py           # Horovod
    horovodrun -np 2 -H localhost:2 python examples/keras_mnist.py --dgc     # hvd_dgc
    TF_USE_LEGACY_KERAS=1 horovodrun ...                                      # Keras 2

Keras 3 (TensorFlow's default) is not supported by Horovod 0.28.1's own Keras
optimizer (horovod #4290); there the dense run uses hvd_dgc's optimizer with
density=1.0, which averages like Horovod, and the script says so.
Data: keras.datasets.mnist when it can be loaded (downloaded once); otherwise
scikit-learn's digits (8x8, shipped with the package), and the script says so.
"""

import argparse
import importlib
import os
import time

import numpy as np
import tensorflow as tf

parser = argparse.ArgumentParser(description="Keras MNIST (Horovod / hvd_dgc)")
parser.add_argument("--batch-size", type=int, default=128)
parser.add_argument("--epochs", type=int, default=12)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--momentum", type=float, default=0.9)
parser.add_argument("--steps-per-epoch", type=int, default=0, help="0: the whole shard")
parser.add_argument("--verbose", type=int, default=1, help="Keras progress bar on rank 0")
dgc = parser.add_argument_group("hvd_dgc")
dgc.add_argument("--dgc", action="store_true", help="Deep Gradient Compression (hvd_dgc)")
dgc.add_argument("--density", type=float, default=0.001)
dgc.add_argument("--warmup-epochs", type=float, default=4)
dgc.add_argument("--stats", action="store_true", help="print compression statistics per epoch")
args = parser.parse_args()

KERAS2 = os.environ.get("TF_USE_LEGACY_KERAS") == "1"
keras = tf.keras
# The one-line switch: hvd_dgc.tensorflow.keras is horovod.tensorflow.keras plus DGC.
# (Horovod's own Keras optimizer needs Keras 2: under Keras 3 hvd_dgc is used for both.)
hvd = importlib.import_module("hvd_dgc.tensorflow.keras" if args.dgc or not KERAS2
                              else "horovod.tensorflow.keras")


def load_data():
    try:
        (x, y), (xt, yt) = keras.datasets.mnist.load_data()
        prep = lambda a: (a / 255.0).astype(np.float32)[..., None]  # noqa: E731
        return prep(x), y, prep(xt), yt, "MNIST (keras.datasets)"
    except Exception as exc:  # no data and no network
        from sklearn.datasets import load_digits
        x, y = load_digits(return_X_y=True)
        x = (x / 16.0).astype(np.float32).reshape(-1, 8, 8, 1)
        perm = np.random.RandomState(0).permutation(len(y))
        test, train = perm[:360], perm[360:]
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
        return (x[train], y[train], x[test], y[test],
                f"scikit-learn digits 8x8 (shipped with the package) - MNIST unavailable ({why})")


class Throughput(keras.callbacks.Callback):
    def __init__(self, samples_per_epoch):
        super().__init__()
        self.samples = samples_per_epoch

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        logs["samples_per_sec"] = self.samples / (time.perf_counter() - self.start)


def main():
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    x, y, xt, yt, source = load_data()
    x, y = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]
    mode = "hvd_dgc DGC" if args.dgc else (
        "Horovod dense" if KERAS2 else "dense via hvd_dgc density=1.0 (Keras 3)")
    if hvd.rank() == 0:
        print(f"data: {source}; {len(y)} train images per rank, {len(yt)} test, "
              f"{hvd.size()} ranks, Keras {'2' if KERAS2 else '3'}, {mode}", flush=True)

    keras.utils.set_random_seed(42)
    model = keras.Sequential([
        keras.layers.Input(x.shape[1:]),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2), keras.layers.Flatten(),
        keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)])
    # Scale the learning rate by the number of workers, as Horovod's example does.
    opt = keras.optimizers.SGD(args.lr * hvd.size(), momentum=args.momentum)
    if args.dgc:
        opt = hvd.DistributedOptimizer(opt, density=args.density, warmup=args.warmup_epochs)
    elif KERAS2:
        opt = hvd.DistributedOptimizer(opt)
    else:
        opt = hvd.DistributedOptimizer(opt, density=1.0)
    model.compile(optimizer=opt, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  **({} if KERAS2 else {"jit_compile": False}))  # Horovod ops: no XLA

    steps = args.steps_per_epoch or len(y) // args.batch_size
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                 Throughput(steps * args.batch_size * hvd.size())]
    if args.dgc:
        callbacks.append(hvd.callbacks.DGCCallback(verbose=int(args.stats)))
    history = model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs,
                        steps_per_epoch=steps, callbacks=callbacks,
                        verbose=args.verbose if hvd.rank() == 0 else 0)

    correct = np.sum(np.argmax(model.predict(xt, verbose=0), 1) == yt) / len(yt)
    accuracy = float(hvd.allreduce(tf.constant(correct, tf.float32), name="accuracy"))
    if hvd.rank() == 0:
        rate = np.mean(history.history["samples_per_sec"][1:] or
                       history.history["samples_per_sec"])
        print(f"test accuracy {accuracy:.4f}  {rate:,.0f} samples/s ({hvd.size()} ranks, "
              f"epochs after the first)", flush=True)
        if args.dgc:
            s = opt.compression_stats()
            print(f"whole run: sent {s['bytes_sent']:,} B of {s['dense_fp32_bytes']:,} B dense "
                  f"fp32 ({s['compression_ratio']:.1f}x), mean density {s['density']:.4f}",
                  flush=True)


if __name__ == "__main__":
    main()
