"""How fast Horovod's allgather moves bytes against its ring allreduce (issue 33).

    sudo python bench/collective_rates.py                  # 1 Gbit/s and 100 Mbit/s
    python bench/collective_rates.py --links 1000:0        # one link

The cost model (hvd_dgc/costmodel.py) prices a sparse allgather and a dense ring
allreduce at one measured bandwidth: at N = 2 each rank sends n*w bytes in the allreduce
and k*(w+i) in the allgather, so records of half the dense bytes (density 0.25) should
take half the time. bench/never_slower.py found no such gain at 100 Mbit/s. This times
the two collectives side by side on 2 ranks over the emulated link (harness/wan.py, one
rank in each of two network namespaces; Gloo): an allreduce of ``--mib`` MiB of float32,
an allgather of half as many bytes from each rank (density 0.25's records) and one of as
many bytes as the allreduce's. Each is the median of ``--repeats`` timings, all ranks
lined up by a small allreduce first. Prints a table and writes
bench/results/collective_rates.md.
"""

import argparse
import os
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def worker(mib, repeats):
    """On each rank: the three collectives, taking turns; rank 0 prints the medians."""
    import time
    import torch
    import horovod.torch as hvd
    hvd.init()
    n = mib << 18  # float32 elements in mib MiB
    shapes = {"allreduce": (torch.float32, n), "allgather, half the bytes": (torch.uint8, 2 * n),
              "allgather, the same bytes": (torch.uint8, 4 * n)}
    times = {name: [] for name in shapes}
    for rep in range(repeats + 1):  # the first round warms Horovod's buffers up, untimed
        for name, (dtype, count) in shapes.items():
            x = torch.zeros(count, dtype=dtype)
            hvd.allreduce(torch.zeros(1), name=f"line.{rep}.{name}")
            start = time.perf_counter()
            if name == "allreduce":
                hvd.allreduce(x, name=f"ar.{rep}")
            else:
                hvd.allgather(x, name=f"ag.{rep}.{count}")
            if rep:
                times[name].append(time.perf_counter() - start)
    if hvd.rank() == 0:
        for name, ts in times.items():
            print(f"RESULT\t{name}\t{statistics.median(ts):.4f}\t"
                  + " ".join(f"{t:.3f}" for t in ts), flush=True)


def run(link, mib, repeats, timeout):
    from harness.launch import run_job
    from harness.wan import WanLink
    rate, rtt = link
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--mib", str(mib),
            "--repeats", str(repeats)]
    with WanLink(rate_mbit=rate, rtt_ms=rtt) as wan:
        (code, out, err), (code1, _, err1) = run_job(wan, argv, env={"OMP_NUM_THREADS": "1"},
                                                     timeout=timeout)
    if code or code1:
        sys.exit(f"the job over {rate:g} Mbit/s failed:\n{out}\n{err[-2000:]}\n{err1[-2000:]}")
    rows = {}
    for line in out.splitlines():
        if line.startswith("RESULT\t"):
            _, name, median, runs = line.split("\t")
            rows[name] = (float(median), runs)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--links", nargs="*", default=["1000:0", "100:0"],
                    help="RATE_MBIT:RTT_MS over the emulated link")
    ap.add_argument("--mib", type=int, default=32, help="the allreduce's MiB")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results",
                                                  "collective_rates.md"))
    args = ap.parse_args()
    if args.worker:
        return worker(args.mib, args.repeats)
    from harness.wan import available
    ok, why = available()
    if not ok:
        sys.exit(f"the WAN emulator is unavailable here ({why}): run as root")
    lines = ["# Horovod's allgather against its ring allreduce, 2 ranks (Gloo)", "",
             f"`python bench/collective_rates.py` (one run; the allreduce moves {args.mib} MiB "
             f"of float32; each row the median of {args.repeats} timings after a warm-up, "
             "the timings after it; seconds per collective).", "",
             "| link | collective | seconds (median) | runs | vs the allreduce |",
             "| --- | --- | --- | --- | --- |"]
    for spec in args.links:
        rate, rtt = (float(x) for x in spec.split(":"))
        rows = run((rate, rtt), args.mib, args.repeats, args.timeout)
        base = rows["allreduce"][0]
        for name, (median, runs) in rows.items():
            line = f"| {rate:g} Mbit/s, RTT {rtt:g} ms | {name} | {median:.3f} | {runs} | " \
                   f"{median / base:.2f}x |"
            print(line)
            lines.append(line)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
