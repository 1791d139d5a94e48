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
    --keras 2|3      tf_keras (TF_USE_LEGACY_KERAS=1) or Keras 3
    --outer-steps H  bench/outer_wan.py --framework keras: the outer loop (DiLoCo) on
                     harness/stdlib_lm.py's Keras LM with AdamW, the weights' change sent
                     whole or at --outer-density, --overlap; --outer-steps 0: Horovod's
                     own tape every step (dense AdamW); each rank prints its JSON line"""

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
    ap.add_argument("--outer-steps", type=int, default=None)
    ap.add_argument("--outer-density", type=float, default=1.0)
    ap.add_argument("--overlap", action="store_true")
    args = ap.parse_args()
    if args.keras is not None:
        os.environ["TF_USE_LEGACY_KERAS"] = "1" if args.keras == "2" else "0"
    if args.fit:
        return fit(args)
    if args.outer_steps is not None:
        return outer_lm(args)
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


def outer_lm(args):
    """The stdlib LM in Keras (bench/adam_lm.py's keras_worker: AdamW lr 2e-3, batch
    --batch x 128 bytes, real batches), a tf.function of the optimizer's apply_gradients:
    the outer loop, or (--outer-steps 0) Horovod's own tape every step."""
    import sys
    import tensorflow as tf
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
    from harness.stdlib_lm import Batches, keras_byte_lm
    tf.config.threading.set_inter_op_parallelism_threads(2)  # overlap's worker thread
    tf.config.threading.set_intra_op_parallelism_threads(1)
    import horovod.tensorflow as hvd_stock
    import hvd_dgc.tensorflow.keras as hvd
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    keras = tf.keras
    keras.utils.set_random_seed(0)
    data = Batches(128, 0, rank, as_numpy=True)
    model = keras_byte_lm(keras, 128)
    opt = keras.optimizers.AdamW(2e-3, weight_decay=0.01)
    dense = args.outer_steps == 0
    if not dense:
        opt = hvd.DistributedOptimizer(
            opt, sparse_as_dense=True, density=args.outer_density,
            outer=hvd.OuterLoop(steps=args.outer_steps, overlap=args.overlap))
    hvd_stock.broadcast_variables(model.variables, root_rank=0)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        if dense:
            tape = hvd_stock.DistributedGradientTape(tape, sparse_as_dense=True)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))
        return loss

    for _ in range(args.warmup_steps):
        step(*data.next(args.batch))
    stats = getattr(opt, "compression_stats", dict)
    waited = stats().get("waited_seconds")
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step(*data.next(args.batch))
    float(loss)
    elapsed = time.perf_counter() - start
    if waited is not None:
        waited = stats()["waited_seconds"] - waited
    start = time.perf_counter()
    if not dense:
        opt.flush()
    flush = time.perf_counter() - start
    out = stats()
    print(json.dumps({"method": "dense" if dense else "outer", "steps": args.steps,
                      "seconds": elapsed,
                      "samples_per_s": args.steps * args.batch * size / elapsed,
                      "workers": size, "params": int(sum(
                          np.prod(v.shape) for v in model.trainable_variables)),
                      "flush_seconds": flush, "outer_rounds": out.get("rounds"),
                      "waited_seconds": waited, "outer_bytes_sent": out.get("bytes_sent")}),
          flush=True)


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
