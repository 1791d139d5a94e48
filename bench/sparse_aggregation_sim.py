"""Predicted bytes per worker per step: dense vs sparse allgather vs region reduce (issue 15).

    python bench/sparse_aggregation_sim.py [--density 0.001] [--out-dir bench/results]

Framework-free: ResNet-50's parameter shapes (bench/resnet50_shapes.py), k per
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

Writes ``sparse_aggregation_sim.{md,csv,png}`` to --out-dir. ``simulate`` is
importable, so a benchmark can compare its rows with measured bytes.
"""

import argparse
import csv
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
from bench.resnet50_shapes import numel, resnet50_shapes  # noqa: E402
from hvd_dgc.aggregation import bytes_per_worker  # noqa: E402
from hvd_dgc.costmodel import DENSE, REGION, SPARSE, CostModel  # noqa: E402
from hvd_dgc.schedule import num_selected  # noqa: E402

METHODS = ("dense", "allgather", "region")
_COST_NAME = {"dense": DENSE, "allgather": SPARSE, "region": REGION}
_BYTES_NAME = {DENSE: "dense", SPARSE: "allgather", REGION: "region"}
DEFAULT_WORLDS = tuple(2 ** p for p in range(1, 11))  # 2, 4, ..., 1024


def _seconds(cm, method, n, k, world, value_bytes, index_bytes, dense_value_bytes):
    if method == DENSE:
        return cm.dense_seconds(n, world, dense_value_bytes)
    if method == SPARSE:
        return cm.sparse_seconds(k, world, value_bytes, index_bytes)
    return cm.region_seconds(k, world, value_bytes, index_bytes)


def _buffers(sizes, density, min_compress_size, fused):
    """(n, k, dense_only) per collective: one per tensor, or with ``fused`` one
    dense buffer of the small tensors and one sparse buffer of the rest."""
    per_tensor = [(n, num_selected(n, density), n < min_compress_size) for n in sizes]
    if not fused:
        return per_tensor
    out = []
    for dense_only in (True, False):
        group = [(n, k) for n, k, d in per_tensor if d == dense_only]
        if group:
            out.append((sum(n for n, _ in group), sum(k for _, k in group), dense_only))
    return out


def simulate(shapes, density, worlds=DEFAULT_WORLDS, value_bytes=4, index_bytes=4,
             dense_value_bytes=4, min_compress_size=1024, cost_model=None, fused=False):
    """One row (dict) per world size N: bytes received per worker per step and
    alpha-beta seconds, for every method and for the cost model's choice.

    ``shapes``: tensor shapes, or (name, shape) pairs (resnet50_shapes()). Tensors
    under ``min_compress_size`` are dense in every method. ``fused=False``: one
    collective per tensor (each with its own k, quota and latency); ``fused=True``:
    the sparse tensors as one buffer (k = the sum of their k, one quota) and the
    small ones as one dense buffer, as Ok-Topk treats the whole model.
    Keys: mode, world, k (records one rank selects per step), collectives,
    {dense,allgather,region,auto}_bytes, {...}_seconds, auto_counts ({method: buffers}).
    """
    cm = cost_model or CostModel()
    sizes = [numel(s[1] if len(s) == 2 and isinstance(s[0], str) else s) for s in shapes]
    buffers = _buffers(sizes, density, min_compress_size, fused)
    rows = []
    for world in worlds:
        row = {"mode": "fused" if fused else "per-tensor", "world": world,
               "k": sum(k for _, k, d in buffers if not d), "collectives": len(buffers),
               "auto_counts": {m: 0 for m in METHODS}}
        for m in METHODS + ("auto",):
            row[f"{m}_bytes"] = 0.0
            row[f"{m}_seconds"] = 0.0
        for n, k, dense_only in buffers:
            choice = DENSE if dense_only else cm.choose_aggregation(
                n, k, world, dense_value_bytes, value_bytes, index_bytes)
            row["auto_counts"][_BYTES_NAME[choice]] += 1
            for m in METHODS + ("auto",):
                name = DENSE if dense_only else (choice if m == "auto" else _COST_NAME[m])
                row[f"{m}_bytes"] += bytes_per_worker(_BYTES_NAME[name], n, k, world,
                                                      value_bytes, index_bytes,
                                                      dense_value_bytes)
                row[f"{m}_seconds"] += _seconds(cm, name, n, k, world, value_bytes,
                                                index_bytes, dense_value_bytes)
        rows.append(row)
    return rows


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
