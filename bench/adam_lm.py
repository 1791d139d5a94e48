"""AdamW on a real text corpus that ships with every machine: a byte-level transformer LM
on the Python standard library's sources (of the interpreter that runs this; read at run
time, nothing downloaded or committed), 2 ranks under horovodrun, dense Horovod against
hvd_dgc with the import switched.

    python bench/adam_lm.py --steps 3000 --seeds 0 1 2
    python bench/adam_lm.py --steps 600 --variants horovod default --out bench/results/adam_lm.md
    python bench/adam_lm.py --framework keras --variants horovod default "delay=4"

Each variant trains the same model from the same seed on the same batches (each rank
its own shard); validation loss (nats per byte) on held-out files every ``--eval``
steps, and bytes this rank sent (``compression_stats()``; dense Horovod: 4 bytes per
element per step). The table is the mean over seeds; read the ratios.
"""

import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from harness.stdlib_lm import Batches, byte_lm, corpus, keras_byte_lm, loss_of  # noqa: E402
from hvd_dgc.outer import OuterLoop  # noqa: E402
from hvd_dgc.schedule import DensitySchedule  # noqa: E402

#: variant -> hvd_dgc options (None: stock Horovod)
VARIANTS = {
    "horovod": None,
    "default": {},
    "0.1% after 200 steps": {"density": DensitySchedule(0.001, warmup=200, unit="step")},
    "freeze_variance=50, 0.1% after 200 steps": {
        "freeze_variance": 50, "density": DensitySchedule(0.001, warmup=200, unit="step")},
    "density=0.01": {"density": 0.01, "warmup": 150, "warmup_unit": "step"},
    "density=0.001": {"density": 0.001, "warmup": 300, "warmup_unit": "step"},
    "feedback (freeze_variance=False)": {"freeze_variance": False},
    "frozen, dense": {"min_compress_size": 10 ** 9},
    "delay=4": {"delay": 4},
    "period=4": {"period": 4},
    # the outer loop (DiLoCo): AdamW locally, the weights' change averaged every H steps
    "outer H=8": {"outer": OuterLoop(steps=8)},
    "outer H=32": {"outer": OuterLoop(steps=32)},
    "outer H=8, density 0.01": {"outer": OuterLoop(steps=8), "density": 0.01},
    "outer H=8, overlap": {"outer": OuterLoop(steps=8, overlap=True)},
}


def worker(variant, options, steps, seed, eval_every, context=128, batch=32):
    import torch
    import horovod.torch as stock

    torch.set_num_threads(1)
    if options is None:
        hvd = stock
    else:
        import hvd_dgc.torch as hvd
    hvd.init()
    rank = hvd.rank()
    data = Batches(context, seed, rank)
    torch.manual_seed(seed)
    model = byte_lm(context)
    numel = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    if options is None:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    else:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       **options)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    def validation():
        with torch.no_grad():
            return float(loss_of(model, *data.validation()))

    curve = []
    for step in range(steps):
        x, y = data.next(batch)
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            if hasattr(opt, "flush") and options and "outer" in options:
                opt.flush()  # (overlap: the weights every rank agrees on)
            curve.append((step + 1, validation()))
    if options is None:
        sent = 4.0 * numel * steps
    else:
        sent = float(opt.compression_stats()["bytes_sent"])
    return {"variant": variant, "curve": curve, "bytes": sent, "dense_bytes": 4.0 * numel * steps,
            "numel": numel}


def keras_worker(variant, options, steps, seed, eval_every, context=128, batch=32):
    """``worker`` in Keras 2 (tf_keras; its launch sets TF_USE_LEGACY_KERAS=1): the same
    model, batches and AdamW in a custom loop. Stock Horovod as its TF2 examples train
    a custom loop, ``hvd.DistributedGradientTape`` (its Keras DistributedOptimizer
    averages in ``model.fit``'s gradient computation: with tf_keras' current
    optimizers ``apply_gradients`` alone leaves each rank on its own gradient,
    measured with tf_keras 2.21; docs/tensorflow.md); hvd_dgc's Keras
    DistributedOptimizer, which averages in ``apply_gradients`` and takes AdamW over.
    ``sparse_as_dense=True`` for the embeddings in both (a dense gradient through DGC;
    Horovod's allgather of 4,096 looked-up rows would send more than the table)."""
    import tensorflow as tf
    import horovod.tensorflow as htf

    tf.config.threading.set_intra_op_parallelism_threads(1)  # as torch's one thread
    if options is None:
        hvd = htf
    else:
        import hvd_dgc.tensorflow.keras as hvd
    hvd.init()
    data = Batches(context, seed, hvd.rank(), as_numpy=True)
    keras = tf.keras
    keras.utils.set_random_seed(seed)
    model = keras_byte_lm(keras, context)
    numel = sum(int(tf.size(v)) for v in model.trainable_variables)
    opt = keras.optimizers.AdamW(2e-3, weight_decay=0.01)
    if options is not None:
        opt = hvd.DistributedOptimizer(opt, sparse_as_dense=True, **options)
    htf.broadcast_variables(model.variables, root_rank=0)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        if options is None:
            tape = htf.DistributedGradientTape(tape, sparse_as_dense=True)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))

    @tf.function
    def validation(x, y):
        return loss_fn(y, model(x, training=False))

    curve = []
    for step in range(steps):
        train(*data.next(batch))
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            if options is not None:
                opt.flush()  # delay, the outer loop: the weights every rank agrees on
            curve.append((step + 1, float(validation(*data.validation()))))
    sent = 4.0 * numel * steps if options is None else \
        float(opt.compression_stats()["bytes_sent"])
    return {"variant": variant, "curve": curve, "bytes": sent, "dense_bytes": 4.0 * numel * steps,
            "numel": numel}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--eval", type=int, default=100)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--framework", choices=("torch", "keras"), default="torch",
                        help="keras: the same model in Keras 2 (tf_keras), Horovod's and "
                             "hvd_dgc's Keras DistributedOptimizer")
    parser.add_argument("--out")
    args = parser.parse_args()
    from harness.hvdrun import run
    target, env = "bench.adam_lm:worker", {"HVD_DGC_COST_MODEL": "assumed"}
    if args.framework == "keras":
        target, env = "bench.adam_lm:keras_worker", dict(env, TF_USE_LEGACY_KERAS="1")

    rows = {}
    for variant in args.variants:
        for seed in args.seeds:
            # the assumed 1 Gbit/s link: over loopback the measured one would rightly send
            # this small model dense, and the point here is accuracy at a compression
            res = run(target, np=args.np, controller="gloo", env=env,
                      timeout=24 * 3600, kwargs=dict(variant=variant, options=VARIANTS[variant],
                                                     steps=args.steps, seed=seed,
                                                     eval_every=args.eval))[0]
            rows.setdefault(variant, []).append(res)
            print(variant, seed, res["curve"][-1], f"{res['dense_bytes'] / res['bytes']:.1f}x",
                  flush=True)
    base = statistics.mean(r["curve"][-1][1] for r in rows.get("horovod", rows[args.variants[0]]))
    _, _, root = corpus()
    keras = args.framework == "keras"
    lines = [f"# AdamW, byte-level transformer LM on the standard library ({root})"
             + (", Keras 2" if keras else ""), "",
             f"`python bench/adam_lm.py --steps {args.steps} --seeds "
             f"{' '.join(map(str, args.seeds))}" + (" --framework keras" if keras else "")
             + f"`: {args.np} ranks (horovodrun --gloo), "
             f"{rows[args.variants[0]][0]['numel']:,} parameters, batch 32 x 128 bytes per "
             f"rank, AdamW lr 2e-3, wd 0.01; validation loss in nats per byte, mean over "
             f"seeds.", "",
             "| variant | validation loss | vs Horovod | fewer bytes than dense |",
             "| --- | --- | --- | --- |"]
    for variant, results in rows.items():
        loss = statistics.mean(r["curve"][-1][1] for r in results)
        ratio = statistics.mean(r["dense_bytes"] / r["bytes"] for r in results)
        lines.append(f"| {variant} | {loss:.4f} | {100 * (loss / base - 1):+.2f}% | "
                     f"{ratio:.1f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
