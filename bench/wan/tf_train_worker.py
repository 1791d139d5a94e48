"""One rank of bench/tf_dga_wan.py and bench/round_trips.py --framework tf: Keras SGD with
momentum through hvd_dgc.tensorflow.keras.DistributedOptimizer, DGC at --density, delayed
averaging with --delay (0 = synchronous). Prints one JSON line on rank 0.

    --method dgc     hvd_dgc (the default; --cost-alpha 0 keeps dense tensors apart,
                     --fusion-threshold 0 leaves each tensor alone)
             dense   Horovod's own DistributedGradientTape (its allreduce, tensor fusion);
                     with --fit, Horovod's Keras DistributedOptimizer (Keras 2 only)
             floor   the local step, then one Horovod allreduce of one number: the least
                     a synchronous step waits under Horovod's controller
    --fit            the same MLP as a Keras model trained by ``model.fit`` (the step
                     Keras traces), not a tf.function of the optimizer's apply_gradients
    --keras 2|3      tf_keras (TF_USE_LEGACY_KERAS=1) or Keras 3"""

import argparse
import json
import os
import time

import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--delay", type=int, default=0)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup-steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--density", type=float, default=0.001)
    ap.add_argument("--method", choices=["dgc", "dense", "floor"], default="dgc")
    ap.add_argument("--cost-alpha", type=float, default=None,
                    help="latency of the cost model (s); 0 keeps dense tensors apart")
    ap.add_argument("--fusion-threshold", type=int, default=None,
                    help="hvd_dgc's fusion_threshold (bytes; 0: each tensor alone)")
    ap.add_argument("--fit", action="store_true", help="train with model.fit")
    ap.add_argument("--keras", choices=["2", "3"], default=None,
                    help="Keras version (default: as TF_USE_LEGACY_KERAS says)")
    args = ap.parse_args()
    if args.keras is not None:
        os.environ["TF_USE_LEGACY_KERAS"] = "1" if args.keras == "2" else "0"
    if args.fit:
        return fit(args)
    import tensorflow as tf
    tf.config.threading.set_inter_op_parallelism_threads(2)  # delay=D needs 2 (delayed.py)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    import horovod.tensorflow as hvd_stock
    import hvd_dgc.tensorflow.keras as hvd
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    rng = np.random.RandomState(0)
    shapes = [(1024, args.width), (args.width,), (args.width, args.width), (args.width,),
              (args.width, 10), (10,)]
    variables = [tf.Variable(rng.randn(*s).astype(np.float32) * 0.02) for s in shapes]
    base = tf.keras.optimizers.SGD(0.01, momentum=0.9)
    opt = _wrapped(hvd, base, args) if args.method == "dgc" else base
    data = np.random.RandomState(rank)
    x = tf.constant(data.randn(args.batch, 1024).astype(np.float32))
    y = tf.constant(data.randint(0, 10, args.batch))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            h = x
            for i in range(0, len(variables) - 2, 2):
                h = tf.nn.relu(h @ variables[i] + variables[i + 1])
            logits = h @ variables[-2] + variables[-1]
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
        if args.method == "dense":
            tape = hvd_stock.DistributedGradientTape(tape)
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
        if args.method == "floor":
            with tf.control_dependencies([v.value() for v in variables]):
                # of a number the step computes (a constant's would be folded away)
                loss += hvd_stock.allreduce(tf.reshape(0.0 * loss, [1]), name="floor")[0]
        return loss

    for _ in range(args.warmup_steps):
        step()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    float(loss)
    elapsed = time.perf_counter() - start
    start = time.perf_counter()
    if hasattr(opt, "flush"):
        opt.flush()
    flush = time.perf_counter() - start
    if rank == 0:
        print(json.dumps({"method": args.method, "delay": args.delay, "steps": args.steps,
                          "seconds": elapsed,
                          "samples_per_s": args.steps * args.batch * size / elapsed,
                          "params": int(sum(np.prod(s) for s in shapes)),
                          "flush_seconds": flush}), flush=True)


def _wrapped(hvd, base, args):
    """hvd_dgc's Keras optimizer with the benchmark's options."""
    extra = {} if args.cost_alpha is None else {"cost_model": hvd.CostModel(
        alpha=args.cost_alpha)}
    if args.fusion_threshold is not None:
        extra["fusion_threshold"] = args.fusion_threshold
    return hvd.DistributedOptimizer(base, density=args.density, delay=args.delay, **extra)


def fit(args):
    """The same MLP, SGD momentum and data through ``model.fit``: a warm-up fit of
    --warmup-steps batches, then a timed fit of --steps."""
    import tensorflow as tf
    tf.config.threading.set_inter_op_parallelism_threads(2)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    import hvd_dgc.tensorflow.keras as hvd
    keras = tf.keras
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if args.method == "floor":
        raise SystemExit("--fit has no floor setting: the tape loop's is the link's")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1024,)),
                              keras.layers.Dense(args.width, activation="relu"),
                              keras.layers.Dense(args.width, activation="relu"),
                              keras.layers.Dense(10)])
    base = keras.optimizers.SGD(0.01, momentum=0.9)
    if args.method == "dense":
        import horovod.tensorflow.keras as hvd_stock
        opt = hvd_stock.DistributedOptimizer(base)
    else:
        opt = _wrapped(hvd, base, args)
    model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
    data = np.random.RandomState(rank)
    n = args.batch * max(args.steps, args.warmup_steps)
    x = data.randn(n, 1024).astype(np.float32)
    y = data.randint(0, 10, n)
    model.fit(x[:args.batch * args.warmup_steps], y[:args.batch * args.warmup_steps],
              batch_size=args.batch, epochs=1, verbose=0, shuffle=False)
    start = time.perf_counter()
    model.fit(x[:args.batch * args.steps], y[:args.batch * args.steps],
              batch_size=args.batch, epochs=1, verbose=0, shuffle=False)
    elapsed = time.perf_counter() - start
    if rank == 0:
        print(json.dumps({"method": args.method, "fit": True, "keras": args.keras or "",
                          "steps": args.steps, "seconds": elapsed,
                          "samples_per_s": args.steps * args.batch * size / elapsed}),
              flush=True)


if __name__ == "__main__":
    main()
