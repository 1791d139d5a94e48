"""Predicted bytes per worker per step: dense vs sparse allgather vs region reduce (issue 15).

    python bench/sparse_aggregation_sim.py [--density 0.001] [--out-dir bench/results]

Framework-free: ResNet-50's parameter shapes (harness/shapes.py), k per
tensor as the optimizer computes it (hvd_dgc.schedule.num_selected), tensors
under min_compress_size dense in every method (as in the optimizer), and the
formulas of hvd_dgc/aggregation.py (bytes, balanced expectation) and
hvd_dgc/costmodel.py (alpha-beta time, default 1 Gbit/s and 50 us per message).
Time is the cost model's per-tensor sum: each tensor its own collective, so the
latency terms are an upper bound where Horovod fuses tensors. "auto" is the
cost model's choice among the three (``choose_aggregation``) per collective.
Two tables: one collective per tensor, and the tensors fused into one sparse
buffer (Ok-Topk's setting): per tensor, each owner keeps at least one record,
so the allgather part is at least (N-1) records per tensor and grows with N.

Writes ``sparse_aggregation_sim.{md,csv,png}`` to --out-dir. ``simulate`` lives in
harness/aggregation_sim.py (the tests check the formulas with it, and
bench/sparse_aggregation.py compares its rows with measured bytes).
"""

import argparse
import csv
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
from harness.aggregation_sim import DEFAULT_WORLDS, METHODS, simulate  # noqa: E402
from harness.shapes import numel, resnet50_shapes  # noqa: E402
from hvd_dgc.costmodel import CostModel  # noqa: E402

def markdown(rows, title):
    """One markdown table of ``simulate``'s rows (MB = 1e6 bytes)."""
    mb = 1e6
    out = [title, "",
           "| N | dense MB | allgather MB | region MB | auto MB | region/allgather | "
           "dense s | allgather s | region s | auto s | auto dense/allgather/region |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---|"]
    for r in rows:
        c = r["auto_counts"]
        ratio = r["region_bytes"] / r["allgather_bytes"] if r["allgather_bytes"] else float("nan")
        out.append(f"| {r['world']} | {r['dense_bytes'] / mb:.3f} | "
                   f"{r['allgather_bytes'] / mb:.3f} | {r['region_bytes'] / mb:.3f} | "
                   f"{r['auto_bytes'] / mb:.3f} | {ratio:.3f} | "
                   f"{r['dense_seconds']:.3f} | {r['allgather_seconds']:.3f} | "
                   f"{r['region_seconds']:.3f} | {r['auto_seconds']:.3f} | "
                   f"{c['dense']}/{c['allgather']}/{c['region']} |")
    return "\n".join(out) + "\n"


def write_csv(rows, path):
    keys = ["mode", "world", "k", "collectives"]
    keys += [f"{m}_{q}" for q in ("bytes", "seconds") for m in METHODS + ("auto",)]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(keys + [f"auto_{m}" for m in METHODS])
        for r in rows:
            w.writerow([r[k] for k in keys] + [r["auto_counts"][m] for m in METHODS])


def plot(per_tensor, fused, density, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = [r["world"] for r in per_tensor]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for m, style in zip(METHODS, ("s-", "o-", "^-")):
        ax.plot(worlds, [r[f"{m}_bytes"] for r in per_tensor], style,
                label="region, per tensor" if m == "region" else m)
    ax.plot([r["world"] for r in fused], [r["region_bytes"] for r in fused], "^--",
            color="C2", alpha=0.6, label="region, tensors fused")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("workers N")
    ax.set_ylabel("bytes received per worker per step")
    ax.set_title(f"ResNet-50 at density {density}: predicted (balanced regions)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--density", type=float, default=0.001)
    ap.add_argument("--worlds", type=int, nargs="+", default=list(DEFAULT_WORLDS))
    ap.add_argument("--min-compress-size", type=int, default=1024)
    ap.add_argument("--alpha", type=float, default=50e-6, help="seconds per message")
    ap.add_argument("--gbits", type=float, default=1.0, help="bandwidth, Gbit/s")
    ap.add_argument("--out-dir", default=os.path.join(REPO, "bench", "results"))
    args = ap.parse_args(argv)

    cm = CostModel(alpha=args.alpha, bandwidth=args.gbits * 1e9 / 8)
    shapes = resnet50_shapes()
    kw = dict(min_compress_size=args.min_compress_size, cost_model=cm)
    per_tensor = simulate(shapes, args.density, args.worlds, fused=False, **kw)
    fused = simulate(shapes, args.density, args.worlds, fused=True, **kw)
    n_total = sum(numel(s) for _, s in shapes)
    head = (f"ResNet-50 ({len(shapes)} tensors, {n_total:,} parameters), density "
            f"{args.density}, fp32 values + int32 indices, tensors under "
            f"{args.min_compress_size} elements dense; bytes received per worker per step "
            f"(balanced regions); alpha-beta time at {args.gbits:g} Gbit/s, "
            f"{args.alpha * 1e6:g} us per message. bench/sparse_aggregation_sim.py")
    text = (head + "\n\n"
            + markdown(per_tensor, f"**One collective per tensor** "
                                   f"({per_tensor[0]['collectives']} collectives)") + "\n"
            + markdown(fused, "**Tensors fused** (one dense buffer of the small tensors, "
                              "one sparse buffer of the rest, one quota)"))
    print(text)
    os.makedirs(args.out_dir, exist_ok=True)
    base = os.path.join(args.out_dir, "sparse_aggregation_sim")
    with open(base + ".md", "w") as f:
        f.write(text)
    write_csv(per_tensor + fused, base + ".csv")
    plot(per_tensor, fused, args.density, base + ".png")
    print(f"wrote {base}.md, .csv, .png")


if __name__ == "__main__":
    main()
