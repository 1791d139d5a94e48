"""The README's picture: samples/s of dense Horovod against hvd_dgc over an emulated link,
drawn from two committed results files (nothing is measured here).

    python bench/front_page_plot.py        # writes bench/results/front_page.png

Left: against the link's rate at RTT 0 (bench/results/wan_throughput.csv). Right: against
the round trip at 100 Mbit/s (bench/results/wan_latency.csv), with delayed averaging and
an exchange every 8th step beside synchronous DGC. Both: bench/wan_throughput.py's
6.3M-parameter MLP, 2 workers x 1 CPU thread, DGC at density 0.001; each point one
measurement. The two files are separate runs, so compare within a panel.
"""

import argparse
import csv
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "bench", "results")
RATES_CSV = os.path.join(RESULTS, "wan_throughput.csv")
RTTS_CSV = os.path.join(RESULTS, "wan_latency.csv")
OUT = os.path.join(RESULTS, "front_page.png")

HOROVOD = ("dense", "Horovod (dense fp32 allreduce)", "#1f77b4", "o")
DGC = ("dgc", "hvd_dgc, DGC at density 0.001", "#2ca02c", "s")
DTS = ("dts", "hvd_dgc, delay=8, period=8", "#d62728", "^")


def read(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def series(rows, method, x_key, **fixed):
    """``[(x, samples/s)]`` of one method, the rows matching ``fixed``, sorted by x."""
    out = []
    for row in rows:
        if row["method"] != method:
            continue
        if any(float(row[k]) != float(v) for k, v in fixed.items()):
            continue
        out.append((float(row[x_key]), float(row["samples_per_s"])))
    return sorted(out)


def panel(ax, rows, x_key, methods, fixed, xlabel, title):
    dense = dict(series(rows, HOROVOD[0], x_key, **fixed))
    for method, label, color, marker in methods:
        points = series(rows, method, x_key, **fixed)
        xs = [x for x, _ in points]
        ys = [y for _, y in points]
        ax.plot(xs, ys, marker=marker, color=color, label=label, linewidth=2)
        if method == HOROVOD[0]:
            continue
        for x, y in points:
            if x in dense:
                ratio = y / dense[x]
                text = f"{ratio:.0f}x" if ratio >= 10 else f"{ratio:.1f}x"
                below = method == DGC[0]
                ax.annotate(text, (x, y), textcoords="offset points",
                            xytext=(0, -15 if below else 7), ha="center", color=color,
                            fontsize=9)
    ax.set_yscale("log")
    ax.set_ylim(8, 6000)
    ax.margins(x=0.07)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=11)
    ax.grid(True, which="both", alpha=0.3)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = read(RATES_CSV)
    rtts = read(RTTS_CSV)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)

    panel(left, rates, "rate_mbit", [HOROVOD, DGC], {"rtt_ms": 0},
          "link rate (Mbit/s), RTT 0", "Slower link")
    left.set_xscale("log")
    left.set_xticks([10, 100, 1000], ["10", "100", "1,000"])
    left.set_ylabel("samples/s, 2 workers (log scale)")

    panel(right, rtts, "rtt_ms", [HOROVOD, DGC, DTS], {"rate_mbit": 100},
          "round trip (ms), 100 Mbit/s", "Longer round trip")
    right.set_xscale("symlog", linthresh=50)
    right.set_xticks([0, 50, 200, 700], ["0", "50", "200", "700"])

    handles, labels = right.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, frameon=False, fontsize=9)
    fig.suptitle("Samples/s over an emulated link: 6.3M-parameter MLP, 2 workers "
                 "(labels: times Horovod's)", fontsize=11)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(args.out, dpi=100)
    print(f"wrote {os.path.relpath(args.out, REPO)}")


if __name__ == "__main__":
    main()
