"""A link that changes under a running job: the paths re-decided (the link watch) or not
(issue 33, item 3).

    sudo python bench/link_change.py                     # both scenarios, ~12 minutes
    python bench/link_change.py --slow 50 --scenarios "fast to slow"

Two ranks, one CPU thread each, in two network namespaces joined by harness/wan.py's
link; the same training in every run (bench/wan/link_change_worker.py: an MLP of 2.1M
parameters, 8.4 MB of fp32 gradient, momentum SGD, synthetic data). Each run has two
phases; between them the driver changes the link's rate while the job waits (the
emulator's ``set_rate``): from the forwarder's full speed ("fast", about 4-6 Gbit/s
measured) to ``--slow`` Mbit/s, or the other way. Each phase is timed after its first
``--settle`` steps. Side by side in one run, per scenario:

    Horovod          stock DistributedOptimizer, fp32 allreduce every step
    measured once    hvd_dgc at ``--density`` (default 0.0625, the default warm-up's
                     second stage), the link measured at wrap time only
                     (``link_watch=False``)
    watched          the same with the link watch (the default): re-measured when the
                     steps' waits say the link changed, the paths chosen afresh

Each run ``--repeats`` times, taking turns. Writes bench/results/link_change.md (and
.csv): samples/s per phase (median of the runs), against Horovod's in the same phase,
the paths taken, and the step at which the watch re-decided.
"""

import argparse
import csv
import json
import os
import statistics
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from harness.launch import run_job  # noqa: E402
from harness.wan import WanLink, available  # noqa: E402

WORKER = [sys.executable, os.path.join(REPO, "bench", "wan", "link_change_worker.py")]
METHODS = {"dense": "Horovod", "once": "hvd_dgc, measured once", "watch": "hvd_dgc, watched"}


def run(rates, method, args):
    """One job through ``rates`` (Mbit/s; None: the emulator's full speed)."""
    results, directory = [], tempfile.mkdtemp(prefix="link_change.")
    argv = WORKER + ["--method", method, "--dir", directory, "--phases", str(len(rates)),
                     "--steps", str(args.steps), "--settle", str(args.settle),
                     "--density", str(args.density)]
    with WanLink(rate_mbit=rates[0]) as link:
        job = threading.Thread(target=lambda: results.extend(run_job(
            link, argv, env={"OMP_NUM_THREADS": "1", "HVD_DGC_COST_MODEL": ""},
            timeout=args.timeout)))
        job.start()
        for phase, rate in enumerate(rates[1:]):
            while not os.path.exists(os.path.join(directory, f"ready.{phase}")):
                if not job.is_alive():
                    break
                time.sleep(0.02)
            link.set_rate(rate)
            open(os.path.join(directory, f"changed.{phase}"), "w").close()
        job.join()
    code, out, err = results[0]
    if code != 0 or results[1][0] != 0:
        raise RuntimeError(f"{method} failed: rank 0 rc={code}, rank 1 rc={results[1][0]}\n"
                           f"{err[-2000:]}\n{results[1][2][-2000:]}")
    return json.loads(out.strip().splitlines()[-1])


def rate_words(rate):
    return "fast" if rate is None else f"{rate:g} Mbit/s"


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--slow", type=float, default=100.0, help="Mbit/s")
    ap.add_argument("--scenarios", nargs="*", default=["fast to slow", "slow to fast"],
                    choices=["fast to slow", "slow to fast"])
    ap.add_argument("--steps", type=int, default=30, help="timed steps per phase")
    ap.add_argument("--settle", type=int, default=20, help="untimed steps per phase")
    ap.add_argument("--density", type=float, default=0.0625)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each, taking turns")
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results"))
    args = ap.parse_args()
    ok, why = available()
    if not ok:
        sys.exit(f"link_change: the WAN emulator is unavailable here ({why}); run as root")
    started, rows = time.time(), []
    for scenario in args.scenarios:
        rates = [None, args.slow] if scenario == "fast to slow" else [args.slow, None]
        for repeat in range(args.repeats):  # the runs take turns: the machine drifts
            for method in METHODS:
                r = run(rates, method, args)
                for phase, (rate, p) in enumerate(zip(rates, r["phases"])):
                    rows.append({"scenario": scenario, "method": method, "repeat": repeat,
                                 "phase": phase + 1, "link": rate_words(rate),
                                 "samples_per_s": round(p["samples_per_s"], 1),
                                 "paths": " ".join(f"{k}:{v}"
                                                   for k, v in sorted(p["paths"].items())),
                                 "relinked_at": " ".join(map(str, r["relinked_at"] or [])),
                                 "link_probes": r["link_probes"]})
                print(f"{scenario:>12}  {METHODS[method]:<24} "
                      + "  ".join(f"{p['samples_per_s']:7.1f}" for p in r["phases"])
                      + f" samples/s  relinked at {r['relinked_at']}  "
                      f"{time.time() - started:4.0f} s so far", flush=True)
    write(rows, args)


def write(rows, args):
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "link_change.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    cells = {}  # (scenario, phase, method) -> the rows of its repeats
    for r in rows:
        cells.setdefault((r["scenario"], r["phase"], r["method"]), []).append(r)

    def median(key):
        return statistics.median(r["samples_per_s"] for r in cells[key])
    lines = ["# A link that changes under a running job", "",
             f"`python bench/link_change.py --slow {args.slow:g} --density {args.density:g} "
             f"--repeats {args.repeats}` (2 ranks, one CPU thread each; {args.steps} timed "
             f"steps a phase after {args.settle} untimed; samples/s the median of the runs, "
             f"each run's in brackets; paths: tensor-steps of the timed steps, per run).", "",
             "| scenario | phase: link | run | samples/s | vs Horovod | paths | "
             "re-decided at step (probes) |", "|---|---|---|---|---|---|---|"]
    for (scenario, phase, method), runs in cells.items():
        ratio = median((scenario, phase, method)) / median((scenario, phase, "dense"))
        each = " ".join(str(r["samples_per_s"]) for r in runs)
        paths = "; ".join(sorted({r["paths"] for r in runs})) if method != "dense" else ""
        watched = ", ".join(f"{r['relinked_at'] or '-'} ({r['link_probes']})" for r in runs)
        lines.append(f"| {scenario} | {phase}: {runs[0]['link']} | {METHODS[method]} "
                     f"| {median((scenario, phase, method)):.1f} ({each}) | {ratio:.2f}x "
                     f"| {paths} | " + (watched if method == "watch" else "") + " |")
    with open(os.path.join(args.out, "link_change.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
