"""Bytes per step and local DGC work per step for ResNet-50's parameters (issue 3).

    python bench/dgc_compression.py [--density 0.001] [--repeats 5] [--device cpu]

1. Bytes one worker sends per step vs dense fp32, with hvd_dgc's real selection
   (sampled threshold), for fp32 and fp16 values. Tensors under
   min_compress_size go dense, as in the optimizer. (Paper: 277x for ResNet-50.)
2. Local work per step over all tensors, measured side by side in this run:
   hvd_dgc (memory + sampled select + pack + mask; the fused C++ memory update
   where built) vs the same with the eager update, with an exact torch.topk
   select, and vs a plain copy of the gradients. Ratios, not
   absolute times: these machines are noisy.
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness.shapes import numel, resnet50_shapes  # noqa: E402
from hvd_dgc.schedule import num_selected  # noqa: E402
from hvd_dgc.torch.compression import Compression  # noqa: E402
from hvd_dgc.torch.memory import FlatMemory, Run, fused_kernel_available  # noqa: E402


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bytes_per_step(grads, density, min_size, fp16):
    comp = Compression.dgc(fp16_values=fp16)
    dense_width = 2 if fp16 else 4
    sent = sparse_tensors = 0
    for g in grads:
        if g.numel() < min_size:
            sent += g.numel() * dense_width
        else:
            idx = comp.select(g, num_selected(g.numel(), density))
            sent += comp.pack(g.index_select(0, idx), idx).numel()
            sparse_tensors += 1
    return sent, sparse_tensors


class FlatStep:
    """What the optimizer's exchange does for one launch of every tensor (exchange.py): the
    gradients into one flat buffer, the memory's update, one selection of every sparse
    tensor, their records packed, the dense ones' values taken. ``fused=False`` runs the
    eager update and selection even where the C++ kernel library is built."""

    def __init__(self, comp, grads, density, min_size, fused=True):
        sparse = [i for i, g in enumerate(grads) if g.numel() >= min_size]
        dense = [i for i, g in enumerate(grads) if g.numel() < min_size]
        self.order = sparse + dense
        self.comp, self.fused, self.step = comp, fused, 0
        self.memory = FlatMemory()
        self.block = self.memory.block(self.order, [grads[i].numel() for i in self.order],
                                       len(sparse), grads[0].device)
        self.g = torch.zeros(self.block.total, device=grads[0].device)
        self.views = [self.block.slice_of(self.g, j) for j in range(len(self.order))]
        self.ks = [num_selected(grads[i].numel(), density) for i in sparse]
        self.sparse, self.runs = len(sparse), [Run(0, self.block.total, 0.9, False)]
        self.dense_lo = self.block.offsets[len(sparse)] if dense else self.block.total

    def __call__(self, grads):
        import hvd_dgc.torch.cpu_select as cpu_select
        import hvd_dgc.torch.memory as memory
        saved = memory._fused_memory, cpu_select._fused
        if not self.fused:
            memory._fused_memory, cpu_select._fused = None, (lambda *tensors: False)
        try:
            torch._foreach_copy_(self.views, [grads[i] for i in self.order])
            block = self.block
            self.memory.accumulate(block, self.g, self.runs,  # maxima where pick reads them
                                   with_block_max=self.comp.wants_block_max(self.g.device))
            n = self.sparse
            picked = self.comp.pick(block.v, block.block_max, block.offsets[:n],
                                    block.numels[:n], self.ks, self.order[:n], 0, self.step)
            values = picked.values if picked.values is not None else \
                self.memory.take(block, picked.positions, True)
            dense = block.v[self.dense_lo:].clone()
            block.v[self.dense_lo:].zero_()
            self.step += 1
            return self.comp.pack(values, picked.positions), dense
        finally:
            memory._fused_memory, cpu_select._fused = saved


def copy_step(grads, buffers):
    """The cheapest honest pass over the gradient: read it once, write it once
    (preallocated, so no allocator effects flatter or penalise it)."""
    for g, b in zip(grads, buffers):
        b.copy_(g)


def clone_step(grads):
    """What ``[g.clone() for g in grads]`` costs in a training step: fresh memory."""
    return [g.clone() for g in grads]


def timed_side_by_side(fns, device, repeats):
    """Median time of each function, run round-robin so that a noisy neighbour
    slows all of them alike instead of whichever ran at the time."""
    for fn in fns.values():
        fn()  # warm-up: allocations, first-call overheads
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync(device)
            t = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--density", type=float, default=0.001)
    ap.add_argument("--min-compress-size", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    shapes = resnet50_shapes()
    grads = [torch.randn(numel(s), generator=gen).to(args.device) for _, s in shapes]
    total = sum(g.numel() for g in grads)
    dense = 4 * total
    print(f"ResNet-50: {len(grads)} tensors, {total:,} parameters, dense fp32 "
          f"{dense / 1e6:.2f} MB per step; density {args.density}, "
          f"min_compress_size {args.min_compress_size}, device {args.device}")

    print("\n1. Bytes one worker sends per step")
    print(f"   {'values':<26}{'sent':>12}{'ratio vs fp32':>16}")
    for fp16 in (False, True):
        sent, n_sparse = bytes_per_step(grads, args.density, args.min_compress_size, fp16)
        label = ("fp16 values, fp16 dense" if fp16 else "fp32 values, fp32 dense")
        print(f"   {label:<26}{sent / 1e3:>9.1f} kB{dense / sent:>15.0f}x")
    print(f"   ({n_sparse} tensors sparse, {len(grads) - n_sparse} dense; paper: 277x)")

    print(f"\n2. Local work per step (median of {args.repeats}, measured side by side)")
    buffers = [torch.empty_like(g) for g in grads]
    steps = {"dgc": FlatStep(Compression.dgc, grads, args.density, args.min_compress_size),
             "eager": FlatStep(Compression.dgc, grads, args.density, args.min_compress_size,
                               fused=False),
             "topk": FlatStep(Compression.topk, grads, args.density, args.min_compress_size)}
    t = timed_side_by_side({
        "copy": lambda: copy_step(grads, buffers),
        "dgc": lambda: steps["dgc"](grads),
        "eager": lambda: steps["eager"](grads),
        "topk": lambda: steps["topk"](grads),
        "clone": lambda: clone_step(grads),
    }, args.device, args.repeats)
    t_copy, t_dgc, t_topk, t_clone = t["copy"], t["dgc"], t["topk"], t["clone"]
    kernel = (fused_kernel_available() and args.device == "cpu")
    print(f"   plain copy of the gradients         1.00 copies  ({t_copy * 1e3:7.1f} ms)")
    print(f"   clone of the gradients (new memory){t_clone / t_copy:6.2f} copies  "
          f"({t_clone * 1e3:7.1f} ms)")
    how = "fused C++ memory update" if kernel else "eager PyTorch: fused kernel not built/used"
    print(f"   hvd_dgc (sampled threshold)       {t_dgc / t_copy:6.2f} copies  "
          f"({t_dgc * 1e3:7.1f} ms)   goal <= 4   [{how}]")
    print(f"   same, eager memory update         {t['eager'] / t_copy:6.2f} copies  "
          f"({t['eager'] * 1e3:7.1f} ms)")
    print(f"   same with exact torch.topk        {t_topk / t_copy:6.2f} copies  "
          f"({t_topk * 1e3:7.1f} ms)")
    print(f"   hvd_dgc vs clone                  {t_dgc / t_clone:6.2f} clones")
    print(f"   sampled vs exact top-k speed-up   {t_topk / t_dgc:6.2f}x")

if __name__ == "__main__":
    main()
