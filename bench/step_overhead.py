"""hvd_dgc's local work per step against stock Horovod's, at np=1 on ResNet-50's shapes.

On a GPU every ATen operation is a kernel launch, and per-tensor work is what made a
ResNet-50 step 1.6-2.2x slower on one H100 (bench/results/gpu_dgc.md). This counts the
operations one training step dispatches on the CPU (a ``TorchDispatchMode`` that counts
every ATen call: what a GPU would launch), and times the same step side by side with
stock Horovod's optimizer, interleaved, over several rounds (this machine is noisy: read
the ratios, not the milliseconds).

The model is ResNet-50's 161 parameter tensors (25.6 M elements, torchvision's shapes)
under a synthetic loss ``sum_i (p_i * w_i).sum()``: its backward is one multiply per
tensor, the same for every optimizer, so what differs is the optimizer's own work.
SGD with momentum 0.9, as the paper trains ResNet-50.

    python bench/step_overhead.py                      # counts and times, markdown
    python bench/step_overhead.py --out bench/results/step_overhead.md

Rows: stock Horovod (``horovod.torch.DistributedOptimizer``; at np=1 it registers no
hooks: its step is the base SGD's), hvd_dgc at the final density 0.001 (as it runs; with
its positions coded by ATen's operations instead of the C++ kernel, as on a GPU; with
fp32 values instead of 8-bit ones), and hvd_dgc in
the default warm-up's dense-ish stages (density 0.25 and 0.0625, fixed); then AdamW
(lr 1e-3, weight decay 0.01) through stock Horovod and through hvd_dgc with its
variance frozen (the take-over's long phase, hvd_dgc/adam.py) at density 0.001, each
against stock Horovod with the same optimizer.
"""

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from harness.shapes import numel, resnet50_shapes  # noqa: E402


class CountOps(TorchDispatchMode):
    """Counts ATen operations (each a kernel launch on a GPU), by name."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.names = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        name = str(func.overloadpacket)
        self.names[name] = self.names.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


class Setup:
    """One optimizer over its own copy of the parameters (hooks fire for every backward
    of the parameters they are registered on, so each row owns its tensors)."""

    def __init__(self, label, make_optimizer, shapes, seed=0, kernel_coding=True):
        gen = torch.Generator().manual_seed(seed)
        self.label, self.kernel_coding = label, kernel_coding
        self.params = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.01)
                       for _, s in shapes]
        self.weights = [torch.randn(s, generator=gen) for _, s in shapes]
        named = [(name, p) for (name, _), p in zip(shapes, self.params)]
        self.opt = make_optimizer(named)

    def step(self):
        from hvd_dgc.torch import positions
        positions.KERNEL = self.kernel_coding  # (False: ATen's coding, as on a GPU)
        self.opt.zero_grad()
        loss = sum((p * w).sum() for p, w in zip(self.params, self.weights))
        loss.backward()
        self.opt.step()


def optimizers():
    import horovod.torch as stock
    import hvd_dgc.torch as hvd

    def sgd(named):
        return torch.optim.SGD([p for _, p in named], lr=0.01, momentum=0.9)

    def horovod(named):
        return stock.DistributedOptimizer(sgd(named), named_parameters=named)

    def dgc(density, **options):
        def make(named):
            return hvd.DistributedOptimizer(sgd(named), named_parameters=named,
                                            density=density, warmup=0, **options)
        return make

    def adamw(named):
        return torch.optim.AdamW([p for _, p in named], lr=1e-3, weight_decay=0.01)

    def horovod_adamw(named):
        return stock.DistributedOptimizer(adamw(named), named_parameters=named)

    def dgc_adamw(named):  # the variance frozen after the untimed steps (--warmup)
        return hvd.DistributedOptimizer(adamw(named), named_parameters=named,
                                        density=0.001, warmup=0, freeze_variance=1)

    return [("stock Horovod", horovod), ("hvd_dgc, density 0.001", dgc(0.001)),
            ("hvd_dgc, density 0.001, positions coded by ATen", dgc(0.001)),
            ("hvd_dgc, density 0.001, fp32 values", dgc(
                0.001, compression=hvd.Compression.dgc(value_bits=32))),
            ("hvd_dgc, density 0.0625 (warm-up)", dgc(0.0625)),
            ("hvd_dgc, density 0.25 (warm-up)", dgc(0.25)),
            ("stock Horovod, AdamW", horovod_adamw),
            ("hvd_dgc, AdamW (variance frozen), density 0.001", dgc_adamw)]


def count_step(setup):
    """ATen operations of one step: zero_grad, the loss, backward and step."""
    with CountOps() as counter:
        setup.step()
    return counter


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per row")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--top", type=int, default=0,
                        help="also list each row's N most frequent operations")
    parser.add_argument("--out", help="also write the markdown here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import horovod.torch as stock
    stock.init()
    if stock.size() != 1:
        raise SystemExit("run at np=1 (python bench/step_overhead.py): the counts are local")

    shapes = resnet50_shapes()
    setups = [Setup(label, make, shapes, kernel_coding="by ATen" not in label)
              for label, make in optimizers()]
    for s in setups:
        for _ in range(args.warmup):
            s.step()
    counts = {s.label: count_step(s) for s in setups}
    times = {s.label: [] for s in setups}
    for _ in range(args.rounds):  # interleaved: the rows share the machine's moods
        for s in setups:
            start = time.perf_counter()
            s.step()
            times[s.label].append(time.perf_counter() - start)

    def stock_of(label):  # each optimizer against stock Horovod with the same one
        return next(s.label for s in setups if s.label == (
            "stock Horovod, AdamW" if "AdamW" in label else "stock Horovod"))
    lines = [
        f"# hvd_dgc's local work per step, np=1, ResNet-50's shapes (CPU)",
        "",
        f"Measured by `python bench/step_overhead.py`: {len(shapes)} tensors, "
        f"{sum(numel(s) for _, s in shapes):,} parameters, SGD momentum 0.9, torch "
        f"{torch.__version__}, {torch.get_num_threads()} thread(s); ATen operations of "
        f"one step (zero_grad, loss, backward, step) counted with a TorchDispatchMode; "
        f"step time the median of {args.rounds} interleaved steps.",
        "",
        "| optimizer | ATen ops / step | more than stock | step ms (median) | x stock |",
        "| --- | --- | --- | --- | --- |",
    ]
    for s in setups:
        base = stock_of(s.label)
        c, ms = counts[s.label].count, statistics.median(times[s.label]) * 1e3
        stock_ms = statistics.median(times[base]) * 1e3
        lines.append(f"| {s.label} | {c} | {c - counts[base].count:+d} | {ms:.1f} | "
                     f"{ms / stock_ms:.2f} |")
    if args.top:
        for s in setups:
            top = sorted(counts[s.label].names.items(), key=lambda kv: -kv[1])[:args.top]
            lines += ["", f"{s.label}: " + ", ".join(f"{n} {c}" for n, c in top)]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
