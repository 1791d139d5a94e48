"""What a rank's DGC records of one step would weigh in each record format, side by side
on ResNet-50's 161 tensors and the stdlib byte LM's (bench/adam_lm.py's model), at one
density: today's records (an int32 position and an fp32 or fp16 value), and positions
coded near their information content (hvd_dgc/packing.py: Elias-Fano or a bitmap,
whichever is smaller) with values in 32, 16, 8, 4 or 2 bits. Tensors under
``min_compress_size`` (1,024) travel dense, in fp32, every step, as now; the last rows
fold them into one tensor selected at the same density instead. Bytes come from
the formats' own size formulas, k = ceil(n * density) records a tensor (DGC's threshold
selection sends within 0.8-1.3 k of it); tests/core/test_wire_code.py holds the formulas to the
NumPy reference's encoding, ResNet-50's tensors among them.

    python bench/record_sizes.py                 # the table, density 0.001
    python bench/record_sizes.py --density 0.01 --csv

A format is not a result: values in fewer bits keep their rounding in DGC's memory (error
feedback), and what that costs in accuracy is measured where the format runs.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness.shapes import lm_shapes, numel, resnet50_shapes  # noqa: E402
from hvd_dgc.packing import index_bytes  # noqa: E402
from hvd_dgc.schedule import num_selected  # noqa: E402

MIN_COMPRESS_SIZE = 1024  # DGCConfig's default
SCALE_BYTES = 8  # a tensor's smallest and largest sent magnitude (fp32), below 16 bits

#: (name, index code, value bits): today's two record formats, then the coded positions
FORMATS = [("int32 + fp32 (today)", "int32", 32), ("int32 + fp16 (today, fp16)", "int32", 16),
           ("coded + fp32", "coded", 32), ("coded + fp16", "coded", 16),
           ("coded + 8 bits", "coded", 8), ("coded + 4 bits", "coded", 4),
           ("coded + 2 bits", "coded", 2)]
#: the same, the small tensors folded into one selected tensor instead of sent dense
FOLDED = [("coded + fp16, small tensors folded", "coded", 16),
          ("coded + 4 bits, small tensors folded", "coded", 4)]


def record_bytes(n, k, index, value_bits):
    """One tensor's records: its positions and its values (and, below 16 bits, its two
    fp32 magnitudes)."""
    positions = 4 * k if index == "int32" else index_bytes(n, k)
    values = (k * value_bits + 7) // 8 + (SCALE_BYTES if value_bits < 16 else 0)
    return positions + values


def step_bytes(shapes, density, index, value_bits, fold=False):
    """(bytes a rank sends a step, of which the small tensors' bytes): the small tensors
    dense in fp32, or (``fold``) as one tensor of their elements, selected."""
    total = small = 0
    for _, shape in shapes:
        n = numel(shape)
        if n < MIN_COMPRESS_SIZE:
            small += n
        else:
            total += record_bytes(n, num_selected(n, density), index, value_bits)
    small = record_bytes(small, num_selected(small, density), index, value_bits) if fold \
        else 4 * small
    return total + small, small


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--density", type=float, default=0.001)
    parser.add_argument("--csv", action="store_true", help="one CSV row per (model, format)")
    args = parser.parse_args()
    if not 0 < args.density <= 1:
        parser.error(f"--density must be in (0, 1], got {args.density}")
    models = [("ResNet-50", resnet50_shapes()), ("stdlib byte LM", lm_shapes())]
    rows = []
    for model, shapes in models:
        dense = sum(4 * numel(s) for _, s in shapes)
        today = None
        for name, index, bits, fold in [f + (False,) for f in FORMATS] + \
                [f + (True,) for f in FOLDED]:
            sent, small = step_bytes(shapes, args.density, index, bits, fold)
            today = today or sent
            rows.append((model, name, sent, small, dense, dense / sent, today / sent))
    if args.csv:
        print("model,format,bytes_per_step,small_tensor_bytes,dense_fp32_bytes,"
              "fewer_than_dense,fewer_than_today")
        for r in rows:
            print(f"{r[0]},{r[1]},{r[2]},{r[3]},{r[4]},{r[5]:.1f},{r[6]:.2f}")
        return
    print(f"Bytes a rank sends a step at density {args.density:g}\n")
    print("| model | format | bytes a step | of which small tensors | fewer than "
          "dense fp32 | fewer than today |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:,} | {r[3]:,} | {r[5]:.0f}x | {r[6]:.2f}x |")


if __name__ == "__main__":
    main()
