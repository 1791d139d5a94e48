"""Synthetic Keras training throughput (`model.fit` on random data), in the shape of
Horovod's examples/tensorflow2/tensorflow2_synthetic_benchmark.py, with DGC one
flag away.

    horovodrun -np 2 -H localhost:2 python examples/keras_synthetic_benchmark.py
    horovodrun -np 2 -H localhost:2 python examples/keras_synthetic_benchmark.py --dgc

--model: a keras.applications name (ResNet50, the default) or wide_mlp
(built in: ~25M parameters like ResNet-50, little compute per gradient byte).
Under Keras 3 the dense run uses hvd_dgc with density=1.0 (Horovod's own
Keras optimizer needs Keras 2, horovod #4290), as the output says.
"""

import argparse
import importlib
import os
import time

import numpy as np
import tensorflow as tf

parser = argparse.ArgumentParser(description="Keras synthetic benchmark (Horovod / hvd_dgc)")
parser.add_argument("--model", default="ResNet50", help="keras.applications name or wide_mlp")
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--num-warmup-batches", type=int, default=10)
parser.add_argument("--num-batches-per-iter", type=int, default=10)
parser.add_argument("--num-iters", type=int, default=10)
parser.add_argument("--fp16-allreduce", action="store_true")
dgc = parser.add_argument_group("hvd_dgc")
dgc.add_argument("--dgc", action="store_true", help="Deep Gradient Compression (hvd_dgc)")
dgc.add_argument("--density", type=float, default=0.001)
args = parser.parse_args()

KERAS2 = os.environ.get("TF_USE_LEGACY_KERAS") == "1"
keras = tf.keras
# The one-line switch: hvd_dgc.tensorflow.keras is horovod.tensorflow.keras plus DGC.
hvd = importlib.import_module("hvd_dgc.tensorflow.keras" if args.dgc or not KERAS2
                              else "horovod.tensorflow.keras")


def build_model():
    if args.model == "wide_mlp":
        return keras.Sequential([keras.layers.Input((32, 32, 3)), keras.layers.Flatten(),
                                 keras.layers.Dense(4096, activation="relu"),
                                 keras.layers.Dense(4096, activation="relu"),
                                 keras.layers.Dense(1000)]), (32, 32, 3)
    return getattr(keras.applications, args.model)(weights=None), (224, 224, 3)


class IterTimer(keras.callbacks.Callback):
    """img/sec over each group of --num-batches-per-iter batches after the warm-up."""

    def __init__(self):
        super().__init__()
        self.rates = []

    def on_train_batch_begin(self, batch, logs=None):
        b = batch - args.num_warmup_batches
        if b >= 0 and b % args.num_batches_per_iter == 0:
            self.start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        b = batch - args.num_warmup_batches
        if b >= 0 and b % args.num_batches_per_iter == args.num_batches_per_iter - 1:
            rate = args.batch_size * args.num_batches_per_iter / (time.perf_counter() - self.start)
            self.rates.append(rate)
            if hvd.rank() == 0:
                print(f"Iter #{len(self.rates) - 1}: {rate:.1f} img/sec per CPU", flush=True)


def main():
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    model, shape = build_model()
    opt = keras.optimizers.SGD(0.01 * hvd.size(), momentum=0.9)
    if args.dgc:
        opt = hvd.DistributedOptimizer(opt, density=args.density)
        mode = f"hvd_dgc DGC density {args.density:g}"
    else:
        compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
        # hvd_dgc (Keras 3) reads Horovod's compression as DGC: density=1.0 says dense.
        opt = hvd.DistributedOptimizer(opt, compression=compression,
                                       **({} if KERAS2 else {"density": 1.0}))
        mode = ("Horovod dense" if KERAS2 else "dense via hvd_dgc (Keras 3)") + (
            " fp16" if args.fp16_allreduce else "")
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  **({} if KERAS2 else {"jit_compile": False}))
    steps = args.num_warmup_batches + args.num_iters * args.num_batches_per_iter
    rng = np.random.RandomState(hvd.rank())
    data = tf.data.Dataset.from_tensors((rng.rand(args.batch_size, *shape).astype(np.float32),
                                         rng.randint(0, 1000, args.batch_size))).repeat()
    if hvd.rank() == 0:
        print(f"Model: {args.model}, {model.count_params() / 1e6:.1f}M parameters; batch size "
              f"{args.batch_size}; {hvd.size()} CPUs; Keras {'2' if KERAS2 else '3'}; {mode}",
              flush=True)
    timer = IterTimer()
    model.fit(data, steps_per_epoch=steps, epochs=1, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), timer])
    if hvd.rank() == 0:
        mean, conf = np.mean(timer.rates), 1.96 * np.std(timer.rates)
        print(f"Img/sec per CPU: {mean:.1f} +-{conf:.1f}")
        print(f"Total img/sec on {hvd.size()} CPU(s): {hvd.size() * mean:.1f} "
              f"+-{hvd.size() * conf:.1f}", flush=True)
        if args.dgc:
            s = opt.compression_stats()
            print(f"Compression: sent {s['bytes_sent'] / 1e6:.2f} MB of "
                  f"{s['dense_fp32_bytes'] / 1e6:.2f} MB dense fp32 "
                  f"({s['compression_ratio']:.0f}x) over {s['step']} steps", flush=True)


if __name__ == "__main__":
    main()
