"""Every compressor on ResNet-50's parameters, one table, one run (issue 7).

    python bench/compressors.py [--repeats 5] [--threads 1]

Per step of one worker: the bytes it puts into the collectives (what
``compression_stats`` counts), the ratio to dense fp32, and the local
compress + decompress time over all 161 tensors at world size 1 (no network;
round-robin repeats, medians: these machines are noisy). As in the optimizer,
tensors under min_compress_size (1024) go dense fp32, and so do those a
compressor declines (PowerSGD's rule (n+m) r * 2 < n m). Sparse: density 0.001
records (select + pack, then scatter). Exchange compressors: launch, advance,
collect through ``LocalComm``.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.dgc_compression import timed_side_by_side  # noqa: E402
from harness.shapes import numel, resnet50_shapes  # noqa: E402
from hvd_dgc.schedule import num_selected  # noqa: E402
from hvd_dgc.torch.collective import LocalComm, is_exchange  # noqa: E402
from hvd_dgc.torch.compression import Compression, is_sparse  # noqa: E402

MIN_COMPRESS_SIZE = 1024
DENSITY = 0.001


def compressors():
    return {
        "dgc 0.1%": Compression.dgc, "topk 0.1%": Compression.topk,
        "fp16": Compression.fp16, "bf16": Compression.bf16(),
        "powersgd r=1": Compression.powersgd(rank=1, start_iter=0),
        "powersgd r=4": Compression.powersgd(rank=4, start_iter=0),
        "sign": Compression.sign(), "terngrad": Compression.terngrad(),
        "qsgd 7 lv/128": Compression.qsgd(),
    }


def takes(comp, shape):
    if numel(shape) < MIN_COMPRESS_SIZE:
        return False
    return comp.compressible(shape, 0) if is_exchange(comp) else True


def bytes_per_step(comp, shapes):
    total = 0
    for shape in shapes:
        n = numel(shape)
        if not takes(comp, shape):
            total += 4 * n
        elif is_sparse(comp):
            total += num_selected(n, DENSITY) * comp.record_bytes
        elif is_exchange(comp):
            total += comp.wire_bytes(shape)
        else:  # Horovod's fp16
            total += 2 * n
    return total


def round_trip(comp, grads, comm):
    """What one step costs locally: compress, then decompress (world of one)."""
    taken = [g for g in grads if takes(comp, g.shape)]
    if is_exchange(comp):
        residuals = [g.clone() for g in taken]
        ex = comp.launch(residuals, [str(i) for i in range(len(taken))], "bench", comm)
        comp.advance(ex)
        return comp.collect(ex)
    if is_sparse(comp):
        out = []
        for g in taken:
            flat = g.reshape(-1)
            idx = comp.select(flat, num_selected(flat.numel(), DENSITY))
            out.append(comp.scatter_sum(comp.pack(flat.index_select(0, idx), idx), flat.numel()))
        return out
    return [comp.decompress(*comp.compress(g)) for g in taken]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    shapes = [s for _, s in resnet50_shapes()]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    dense = 4 * sum(numel(s) for s in shapes)
    comps, comm = compressors(), LocalComm()
    t = timed_side_by_side({name: (lambda c=c: round_trip(c, grads, comm))
                            for name, c in comps.items()}, "cpu", args.repeats)
    print(f"ResNet-50, {len(shapes)} tensors, dense fp32 {dense / 1e6:.2f} MB per step; "
          f"{args.threads} thread(s), median of {args.repeats}")
    print(f"| compressor | bytes/step | ratio vs fp32 | compress+decompress (ms) |")
    print(f"| --- | --- | --- | --- |")
    for name, comp in comps.items():
        sent = bytes_per_step(comp, shapes)
        print(f"| {name} | {sent / 1e6:.3f} MB | {dense / sent:.1f}x | {t[name] * 1e3:.0f} |")


if __name__ == "__main__":
    main()
