"""AdamW on a real text corpus that ships with every machine: a byte-level transformer LM
on the Python standard library's sources (of the interpreter that runs this; read at run
time, nothing downloaded or committed), 2 ranks under horovodrun, dense Horovod against
hvd_dgc with the import switched.

    python bench/adam_lm.py --steps 3000 --seeds 0 1 2 --variants horovod default
    python bench/adam_lm.py --framework keras --variants horovod default "delay=4"
    python bench/adam_lm.py --report --steps 3000 --out bench/results/adam_lm_3000.md
    python bench/adam_lm.py --lr-schedule cosine --seeds 0 1 2 --variants horovod default

Each variant trains the same model from the same seed on the same batches (each rank
its own shard); validation loss (nats per byte) on held-out files every ``--eval``
steps, and bytes this rank sent (``compression_stats()``; dense Horovod: 4 bytes per
element per step). The table is the mean over seeds; read the ratios. ``--lr-schedule
cosine``: the learning rate an LM script would give AdamW (a linear warm-up over the
first 5% of the steps, then a cosine to 10% of the peak), the same in every variant,
recorded in a CSV of its own (``RUNS_COSINE``). ``--width``: the model's width other
than 128 (64: 141,184 parameters, 256: 1,743,616; 0.1% of each is a different number of
coordinates a step), its runs in a CSV of their own (``runs_of``).
"""

import argparse
import math
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from harness.stdlib_lm import (Batches, byte_lm, corpus, keras_byte_lm,  # noqa: E402
                               loss_of, lr_factor)
from hvd_dgc.outer import OuterLoop  # noqa: E402
from hvd_dgc.schedule import DensitySchedule  # noqa: E402

#: the model's width (harness/stdlib_lm.py byte_lm: 478,720 parameters at 128)
WIDTH = 128

#: AdamW's learning rate in every variant (with --lr-schedule cosine, its peak)
BASE_LR = 2e-3

#: stock Horovod at a larger learning rate: variant -> factor on BASE_LR. Is a variant's
#: margin over Horovod its steps' size? (the refreshed variance's estimate reads ~0.85x
#: exact Adam's v, so its steps are ~1.1x Adam's: hvd_dgc/adam.py)
LR_SCALE = {"horovod, lr x1.1": 1.1, "horovod, lr x1.2": 1.2}

#: variant -> hvd_dgc options (None: stock Horovod)
VARIANTS = {
    "horovod": None,
    **{name: None for name in LR_SCALE},
    # the one-line switch: 0/1 Adam (adam.py ZERO_ONE_PERIOD), the same run as "sign (1-bit
    # Adam), period=4"; runs recorded before 2026-12-01 as "default" were synchronous
    # top-k, exact Adam to step 20, refreshed: renamed "frozen at 20, refreshed"
    "default": {},
    "default, period=1": {"period": 1},  # (1-bit Adam: the sign at every step)
    # 0/1 Adam at 100x: an exchange every 8th step, and with Horovod's fp16 the dense
    # steps (exact Adam's, the small tensors) in 16 bits
    "fp16, period=8": {"compression": "fp16", "period": 8},
    # DGC's top-k take-over (compression="dgc": what Adam's default was before 2026-12-01;
    # the labels of runs recorded before keep their meaning)
    "frozen once at 200 (former default)": {"compression": "dgc", "refresh_variance": False},
    "0.1% after 200 steps": {"density": DensitySchedule(0.001, warmup=200, unit="step")},
    "freeze_variance=50, 0.1% after 200 steps": {
        "freeze_variance": 50, "density": DensitySchedule(0.001, warmup=200, unit="step")},
    "density=0.01": {"density": 0.01, "warmup": 150, "warmup_unit": "step"},
    "density=0.001": {"density": 0.001, "warmup": 300, "warmup_unit": "step"},
    "density=0.001, period=4": {"density": 0.001, "warmup": 300, "warmup_unit": "step",
                                "period": 4},
    "density=0.001, period=4, ramp 0.01-0.004": {
        "density": 0.001, "warmup": 200, "warmup_unit": "step",
        "warmup_densities": (0.01, 0.004), "period": 4},
    # top-k at 25% from the freeze, no stages: what error feedback costs at a high density
    # (beside "frozen at 20, refreshed, dense", the same take-over sent dense)
    "top-k 25% throughout": {"compression": "dgc", "density": 0.25, "warmup": 0},
    "top-k 25% throughout, masked": {"compression": "dgc", "density": 0.25, "warmup": 0,
                                     "momentum_masking": True},
    # momentum factor masking off (masking.py "auto" masks at densities <= 1.1%): a
    # coordinate top-k sends often loses ~m/(1-m) steps of its momentum at every send
    "density=0.001, unmasked": {"density": 0.001, "warmup": 300, "warmup_unit": "step",
                                "momentum_masking": False},
    "density=0.01, unmasked": {"density": 0.01, "warmup": 150, "warmup_unit": "step",
                               "momentum_masking": False},
    # 16 bits where it is dense (exact Adam's steps, the refreshes, the small tensors) and
    # for the records' values: Horovod's Compression.fp16 with a density
    "density=0.001, fp16": {"density": 0.001, "warmup": 300, "warmup_unit": "step",
                            "compression": "fp16"},
    "feedback (freeze_variance=False)": {"freeze_variance": False},
    "frozen, dense": {"compression": "dgc", "min_compress_size": 10 ** 9},
    "frozen at 20, dense": {"compression": "dgc", "freeze_variance": 20,
                            "min_compress_size": 10 ** 9},
    "frozen at 50, dense": {"compression": "dgc", "freeze_variance": 50,
                            "min_compress_size": 10 ** 9},
    "frozen at 20, refreshed, dense": {"compression": "dgc", "freeze_variance": 20,
                                       "refresh_variance": "auto",
                                       "min_compress_size": 10 ** 9},
    "frozen at 20, refreshed every 100, dense": {
        "compression": "dgc", "freeze_variance": 20, "refresh_variance": 100,
        "min_compress_size": 10 ** 9},
    "frozen at 20, refreshed": {"compression": "dgc", "freeze_variance": 20,
                                "refresh_variance": "auto"},
    "refreshed, 0.1% after 200 steps": {
        "freeze_variance": 20, "refresh_variance": "auto",
        "density": DensitySchedule(0.001, warmup=200, unit="step")},
    "refreshed, density=0.01": {"freeze_variance": 20, "refresh_variance": "auto",
                                "density": 0.01, "warmup": 150, "warmup_unit": "step"},
    "top-k, delay=4": {"compression": "dgc", "delay": 4},
    "top-k, period=4": {"compression": "dgc", "period": 4},
    # what a script's delay=4 or period=4 alone runs now: the sign at that pace
    "delay=4": {"delay": 4},
    "period=4": {"period": 4},
    # 1-bit Adam (Tang et al.): the sign of the error-compensated momentum after the freeze
    "sign (1-bit Adam)": {"compression": "sign"},
    # 0/1 Adam (Lu et al.): 1-bit Adam with local steps, an exchange every 4th step
    "sign (1-bit Adam), period=4": {"compression": "sign", "period": 4},
    "sign (1-bit Adam), delay=4": {"compression": "sign", "delay": 4},
    "powersgd r=1": {"compression": ("powersgd", {"rank": 1, "start_iter": 0})},
    # the outer loop (DiLoCo): AdamW locally, the weights' change averaged every H steps
    "outer H=8": {"outer": OuterLoop(steps=8)},
    "outer H=32": {"outer": OuterLoop(steps=32)},
    "outer H=8, density 0.01": {"outer": OuterLoop(steps=8), "density": 0.01},
    "outer H=8, overlap": {"outer": OuterLoop(steps=8, overlap=True)},
    # bench/outer_wan.py's settings that keep the compute busy at 200 and 700 ms
    "outer H=32, density 0.01, overlap": {"outer": OuterLoop(steps=32, overlap=True),
                                          "density": 0.01},
    "outer H=128, density 0.01, overlap": {"outer": OuterLoop(steps=128, overlap=True),
                                           "density": 0.01},
    "outer H=128, density 0.1, overlap": {"outer": OuterLoop(steps=128, overlap=True),
                                          "density": 0.1},
    "outer H=128, overlap": {"outer": OuterLoop(steps=128, overlap=True)},
    # the average applied as it is (local SGD, FedAvg): no outer momentum, lr 1
    "outer H=128, overlap, averaged": {
        "outer": OuterLoop(steps=128, overlap=True, lr=1.0, momentum=0.0, nesterov=False)},
    "outer H=128, averaged": {
        "outer": OuterLoop(steps=128, lr=1.0, momentum=0.0, nesterov=False)},
    "outer H=128": {"outer": OuterLoop(steps=128)},  # (DiLoCo's, its exchange waited for)
    "outer H=32, overlap, averaged": {
        "outer": OuterLoop(steps=32, overlap=True, lr=1.0, momentum=0.0, nesterov=False)},
    "outer H=8, overlap, averaged": {
        "outer": OuterLoop(steps=8, overlap=True, lr=1.0, momentum=0.0, nesterov=False)},
    "outer H=128, density 0.1, overlap, averaged": {
        "outer": OuterLoop(steps=128, overlap=True, lr=1.0, momentum=0.0, nesterov=False),
        "density": 0.1},
    "outer H=128, density 0.03, overlap, averaged": {
        "outer": OuterLoop(steps=128, overlap=True, lr=1.0, momentum=0.0, nesterov=False),
        "density": 0.03},
    "outer H=128, density 0.03, 2-bit values, overlap, averaged": {
        "outer": OuterLoop(steps=128, overlap=True, lr=1.0, momentum=0.0, nesterov=False,
                           value_bits=2), "density": 0.03},
    # SparseLoCo's recipe: no outer momentum (outer SGD, lr 1); the residual, decayed by
    # 0.95 a round, is the momentum
    "outer H=128, density 0.01, overlap, SparseLoCo": {
        "outer": OuterLoop(steps=128, overlap=True, lr=1.0, momentum=0.0, nesterov=False,
                           residual_decay=0.95), "density": 0.01},
    "outer H=128, density 0.03, overlap, SparseLoCo": {
        "outer": OuterLoop(steps=128, overlap=True, lr=1.0, momentum=0.0, nesterov=False,
                           residual_decay=0.95), "density": 0.03},
}


def learning_rate(variant):
    """AdamW's rate (the cosine's peak) in ``variant``'s run."""
    return BASE_LR * LR_SCALE.get(variant, 1.0)


def _built(options, compressions):
    """A variant's options with ``compression=(name, kwargs)`` made by the framework's
    ``Compression`` namespace (VARIANTS is shared by both frameworks; a plain name such as
    "dgc" or "fp16" is resolved by the wrapper, switch.py ``resolve_compression``)."""
    spec = options.get("compression")
    if not isinstance(spec, tuple):
        return options
    return dict(options, compression=getattr(compressions, spec[0])(**spec[1]))


def worker(variant, options, steps, seed, eval_every, context=128, batch=32,
           lr_schedule="constant", width=WIDTH):
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
    model = byte_lm(context, width)
    numel = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=learning_rate(variant), weight_decay=0.01)
    if options is None:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    else:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       **_built(options, hvd.Compression))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    schedule = None if lr_schedule == "constant" else \
        torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, steps))

    def validation():
        with torch.no_grad():
            return float(loss_of(model, *data.validation()))

    curve = []
    for step in range(steps):
        x, y = data.next(batch)
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()
        if schedule is not None:
            schedule.step()
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            if hasattr(opt, "flush") and options and "outer" in options:
                opt.flush()  # (overlap: the weights every rank agrees on)
            sent = 4.0 * numel * (step + 1) if options is None else \
                float(opt.compression_stats()["bytes_sent"])
            curve.append((step + 1, validation(), sent))
    sent = curve[-1][2]
    return {"variant": variant, "curve": curve, "bytes": sent, "dense_bytes": 4.0 * numel * steps,
            "numel": numel}


def keras_worker(variant, options, steps, seed, eval_every, context=128, batch=32,
                 lr_schedule="constant", width=WIDTH):
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
    model = keras_byte_lm(keras, context, width)
    numel = sum(int(tf.size(v)) for v in model.trainable_variables)
    peak = learning_rate(variant)
    rate = peak if lr_schedule == "constant" else _keras_schedule(keras, steps, peak)
    opt = keras.optimizers.AdamW(rate, weight_decay=0.01)
    if options is not None:
        from hvd_dgc.tensorflow import Compression
        opt = hvd.DistributedOptimizer(opt, sparse_as_dense=True,
                                       **_built(options, Compression))
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
            sent = 4.0 * numel * (step + 1) if options is None else \
                float(opt.compression_stats()["bytes_sent"])
            curve.append((step + 1, float(validation(*data.validation())), sent))
    sent = curve[-1][2]
    return {"variant": variant, "curve": curve, "bytes": sent, "dense_bytes": 4.0 * numel * steps,
            "numel": numel}


def _keras_schedule(keras, steps, peak=BASE_LR):
    """``lr_factor`` as a Keras schedule (its step: ``iterations``, 0-based)."""
    import tensorflow as tf

    class WarmUpCosine(keras.optimizers.schedules.LearningRateSchedule):
        def __call__(self, step):
            step = tf.cast(step, tf.float32)
            warmup = float(max(1, steps // 20))
            done = tf.minimum(1.0, (step - warmup) / float(max(1, steps - 1 - warmup)))
            cosine = 0.1 + 0.45 * (1.0 + tf.cos(math.pi * done))
            return peak * tf.where(step < warmup, (step + 1.0) / warmup, cosine)

        def get_config(self):
            return {}
    return WarmUpCosine()


RUNS = os.path.join(HERE, "results", "adam_lm_runs.csv")
RUNS_COSINE = os.path.join(HERE, "results", "adam_lm_cosine_runs.csv")


def runs_of(lr_schedule="constant", width=WIDTH):
    """The CSV a run is recorded in: one per schedule and width (a variant's name says its
    options, not the model or the schedule, and ``load`` reads every row of a file)."""
    if width == WIDTH:
        return RUNS if lr_schedule == "constant" else RUNS_COSINE
    schedule = "" if lr_schedule == "constant" else f"_{lr_schedule}"
    return os.path.join(HERE, "results", f"adam_lm_width{width}{schedule}_runs.csv")


FIELDS = ("framework", "np", "steps", "variant", "seed", "step", "val_loss", "bytes",
          "dense_bytes")


def record(path, framework, np_, steps, res, seed):
    """Append one run's curve to ``path`` (one row per evaluation): long matrices run in
    pieces, across launches, and the report reads them all."""
    import csv
    new = not os.path.exists(path)
    with open(path, "a", newline="") as f:
        out = csv.writer(f)
        if new:
            out.writerow(FIELDS)
        per_step = res["dense_bytes"] / res["curve"][-1][0]
        for step, loss, sent in res["curve"]:
            out.writerow((framework, np_, steps, res["variant"], seed, step, f"{loss:.6f}",
                          f"{sent:.0f}", f"{per_step * step:.0f}"))


def load(path, framework, np_, steps):
    """{variant: {seed: [(step, val_loss, bytes, dense_bytes)]}} of the runs that match;
    a variant and seed run twice keep the last."""
    import csv
    runs = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if (row["framework"], int(row["np"]), int(row["steps"])) != (framework, np_, steps):
                continue
            curve = runs.setdefault(row["variant"], {}).setdefault(int(row["seed"]), [])
            point = (int(row["step"]), float(row["val_loss"]), float(row["bytes"]),
                     float(row["dense_bytes"]))
            if curve and point[0] <= curve[-1][0]:  # a rerun starts again
                curve.clear()
            curve.append(point)
    return runs


def shown(path):
    """``path`` from the repository's root when it lies inside it."""
    root = os.path.dirname(HERE)
    inside = os.path.abspath(path).startswith(root + os.sep)
    return os.path.relpath(path, root) if inside else path


def report(path, framework, np_, steps, out=None, lr_schedule="constant", width=WIDTH):
    """The table (mean and spread over seeds at the last step) and the plot of the runs
    in ``path`` for one framework, world size and length."""
    runs = load(path, framework, np_, steps)
    if not runs:
        raise SystemExit(f"no {framework} runs of {steps} steps on {np_} ranks in {path}")
    finals = {v: [c[-1] for c in seeds.values() if c[-1][0] == steps]
              for v, seeds in runs.items()}
    finals = {v: f for v, f in finals.items() if f}
    _, _, root = corpus()
    lines = [f"# AdamW, byte-level transformer LM on the standard library ({root})"
             + (", Keras 2" if framework == "keras" else ""), "",
             f"`python bench/adam_lm.py --report --framework {framework} --np {np_} --steps "
             f"{steps}" + ("" if lr_schedule == "constant" else f" --lr-schedule {lr_schedule}")
             + ("" if width == WIDTH else f" --width {width}")
             + f"` (runs recorded in {shown(path)}): "
             f"{np_} ranks (horovodrun --gloo), "
             + ("" if width == WIDTH else f"the model {width} wide (not {WIDTH}), ")
             + "batch 32 x 128 bytes per rank, AdamW lr "
             + ("2e-3" if lr_schedule == "constant" else
                "2e-3 after a linear warm-up over the first 5% of the steps, then a cosine "
                "to 2e-4 (--lr-schedule cosine)")
             + f", wd 0.01; validation loss in nats per byte at step {steps}, mean over the "
             f"seeds run (min-max in brackets), against dense Horovod's mean over the same "
             f"seeds, and the mean of the last three evaluations; bytes this rank sent "
             f"over the whole run.", "",
             "| variant | seeds | validation loss | vs Horovod | last 3 evaluations vs "
             "Horovod's | fewer bytes than dense |",
             "| --- | --- | --- | --- | --- | --- |"]
    order = [v for v in VARIANTS if v in finals] + sorted(set(finals) - set(VARIANTS))
    for variant in order:
        points = finals[variant]
        losses = [p[1] for p in points]
        loss = statistics.mean(losses)
        spread = f" ({min(losses):.4f}-{max(losses):.4f})" if len(losses) > 1 else ""
        ratio = statistics.mean(p[3] / p[2] for p in points)
        done = [s for s, c in sorted(runs[variant].items()) if c[-1][0] == steps]
        same = [runs["horovod"][s][-1][1] for s in done
                if s in runs.get("horovod", {}) and runs["horovod"][s][-1][0] == steps]
        # against Horovod on the same seeds only: seeds differ by more than the variants
        against = statistics.mean(same) if same and len(same) == len(done) else None
        versus = f"{100 * (loss / against - 1):+.2f}%" if against else \
            "n/a (Horovod not run on these seeds)"
        seeds = ", ".join(str(s) for s in done)
        lines.append(f"| {variant} | {seeds} | {loss:.4f}{spread} | {versus} | "
                     f"{_late(runs, variant, done)} | {ratio:.1f}x |")
    text = "\n".join(lines) + "\n"
    if out:
        with open(out, "w") as f:
            f.write(text)
        plot(runs, order, os.path.splitext(out)[0] + ".png", framework, np_)
    return text


def _late(runs, variant, seeds, last=3):
    """The mean validation loss of the last ``last`` evaluations against Horovod's on the
    same seeds (the end of one evaluation is noisy under sparse updates), or "n/a"."""
    base = runs.get("horovod", {})
    if not seeds or any(s not in base for s in seeds):
        return "n/a"
    ours = statistics.mean(p[1] for s in seeds for p in runs[variant][s][-last:])
    theirs = statistics.mean(p[1] for s in seeds for p in base[s][-last:])
    return f"{100 * (ours / theirs - 1):+.2f}%"


def plot(runs, order, path, framework, np_):
    """Validation loss against steps and against bytes sent (means over seeds)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (by_step, by_bytes) = plt.subplots(1, 2, figsize=(12, 4.5))
    colours = plt.get_cmap("tab20").colors  # (tab10's ten repeat past ten variants)
    for number, variant in enumerate(order):
        curves = [c for c in runs[variant].values()]
        length = min(len(c) for c in curves)
        steps = [curves[0][i][0] for i in range(length)]
        loss = [statistics.mean(c[i][1] for c in curves) for i in range(length)]
        sent = [statistics.mean(c[i][2] for c in curves) / 2 ** 20 for i in range(length)]
        label = f"{variant} ({len(curves)} seed{'s' if len(curves) > 1 else ''})"
        style = dict(label=label, color=colours[(2 * number) % 20 + (2 * number) // 20 % 2],
                     linewidth=2.2 if variant in ("horovod", "default") else 1.2,
                     linestyle="--" if variant == "horovod" else "-")
        by_step.plot(steps, loss, **style)
        by_bytes.plot(sent, loss, **style)
    by_step.set_xlabel("step")
    by_bytes.set_xlabel("MiB sent by one rank")
    by_bytes.set_xscale("log")
    for ax in (by_step, by_bytes):
        ax.set_ylabel("validation loss (nats per byte)")
        ax.grid(alpha=0.3)
    by_step.legend(fontsize=7)
    fig.suptitle(f"AdamW byte-level LM on the standard library, {framework}, {np_} ranks",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--eval", type=int, default=250)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--framework", choices=("torch", "keras"), default="torch",
                        help="keras: the same model in Keras 2 (tf_keras), Horovod's and "
                             "hvd_dgc's Keras DistributedOptimizer")
    parser.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant",
                        help="cosine: a linear warm-up over 5%% of the steps, then a cosine "
                             "to 10%% of the peak, in every variant (lr_factor)")
    parser.add_argument("--width", type=int, default=WIDTH,
                        help="the model's width (64: 141,184 parameters, 256: 1,743,616)")
    parser.add_argument("--runs", help="the CSV each run's curve is appended to (default "
                        "bench/results/adam_lm_runs.csv; with --lr-schedule cosine "
                        "adam_lm_cosine_runs.csv; with --width W other than 128 "
                        "adam_lm_widthW_runs.csv, adam_lm_widthW_cosine_runs.csv)")
    parser.add_argument("--report", action="store_true",
                        help="run nothing: the table and plot of the runs already recorded")
    parser.add_argument("--out", help="where the report goes (markdown; the plot beside it)")
    args = parser.parse_args()
    if args.runs is None:
        args.runs = runs_of(args.lr_schedule, args.width)
    if not args.report:
        from harness.hvdrun import run
        target, env = "bench.adam_lm:worker", {"HVD_DGC_COST_MODEL": "assumed"}
        if args.framework == "keras":
            target, env = "bench.adam_lm:keras_worker", dict(env, TF_USE_LEGACY_KERAS="1")
        for variant in args.variants:
            for seed in args.seeds:
                # the assumed 1 Gbit/s link: over loopback the measured one would rightly
                # send this small model dense, and the point here is accuracy at a compression
                res = run(target, np=args.np, controller="gloo", env=env, timeout=24 * 3600,
                          kwargs=dict(variant=variant, options=VARIANTS[variant],
                                      steps=args.steps, seed=seed, eval_every=args.eval,
                                      lr_schedule=args.lr_schedule, width=args.width))[0]
                record(args.runs, args.framework, args.np, args.steps, res, seed)
                print(variant, seed, res["curve"][-1],
                      f"{res['dense_bytes'] / res['bytes']:.1f}x", flush=True)
    print(report(args.runs, args.framework, args.np, args.steps, args.out, args.lr_schedule,
                 args.width))


if __name__ == "__main__":
    main()
