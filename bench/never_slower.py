"""The one-line switch against stock Horovod on fast and slow links (issue 33).

    sudo python bench/never_slower.py                    # loopback + 3 emulated links
    python bench/never_slower.py --links loopback         # a part of it

The same script, examples/pytorch_synthetic_benchmark.py (Horovod's synthetic
benchmark, 2 ranks, one CPU thread each, the built-in 33.5M-parameter ``wide_mlp``),
run side by side in one go: stock Horovod, and the import switched (``--dgc``) with
hvd_dgc's default cost model, the link and DGC's own work measured at wrap time, at
the warm-up's first stage (density 0.25, where a fast link should run dense) and at
the final 0.001; and, for contrast, density 0.25 with the assumed 1 Gbit/s link
(``--assumed-link``) and density 1.0 (nothing compressed: what the switch itself
costs). ``--framework keras``: examples/keras_synthetic_benchmark.py instead (the same
model in ``model.fit``, Keras 2, stock Horovod's Keras optimizer against hvd_dgc's;
written to never_slower_keras.*). Over loopback (``horovodrun -np 2 -H localhost:2
--gloo``) and over the emulated links of harness/wan.py (rate in Mbit/s, round trip in
ms; one rank in each of two network namespaces). Prints and writes, from this one run:

    bench/results/never_slower.csv   every configuration: img/s (the median of --repeats
                                     runs over loopback, taking turns), ratio to stock
    bench/results/never_slower.md    the table, with what rank 0 said it measured and
                                     how many tensors it sent dense
"""

import argparse
import csv
import os
import re
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from hvd_dgc.overlap import DECIDED_BY_STEP  # noqa: E402

#: Each framework's Horovod-shaped example, and what its stock run needs: Horovod's own
#: Keras optimizer runs under Keras 2 (tf_keras), so the Keras runs all do.
SCRIPTS = {
    "torch": ([sys.executable, os.path.join(REPO, "examples", "pytorch_synthetic_benchmark.py"),
               "--model", "wide_mlp", "--batch-size", "32"], {}),
    "keras": ([sys.executable, os.path.join(REPO, "examples", "keras_synthetic_benchmark.py"),
               "--model", "wide_mlp", "--batch-size", "32"], {"TF_USE_LEGACY_KERAS": "1"}),
}
#: What the Keras example has no flag for.
TORCH_ONLY = ("--assumed-link",)
CONFIGS = {  # name: the example's flags
    "stock Horovod": [],
    "hvd_dgc 0.25 (measured)": ["--dgc", "--density", "0.25"],
    "hvd_dgc 0.001 (measured)": ["--dgc", "--density", "0.001"],
    "hvd_dgc 0.25 (assumed 1 Gbit/s)": ["--dgc", "--density", "0.25", "--assumed-link"],
    # the switch's own cost where nothing is compressed: hvd_dgc's dense path
    "hvd_dgc 1.0 (dense)": ["--dgc", "--density", "1.0"],
}
#: Asked for by name only (``--configs``): what Horovod's own tensor fusion costs each side
#: (it copies the tensors of a cycle into one buffer and out again; hvd_dgc's buckets are
#: flat already).
NO_FUSION = {"HOROVOD_FUSION_THRESHOLD": "0"}
EXTRA = {
    "stock Horovod, no fusion": ([], NO_FUSION),
    "hvd_dgc 0.25 (measured), no fusion": (["--dgc", "--density", "0.25"], NO_FUSION),
    "hvd_dgc 1.0 (dense), no fusion": (["--dgc", "--density", "1.0"], NO_FUSION),
}
ENV = {"HVD_DGC_COST_MODEL": "", "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "3"}


def steps(link):
    """Few steps where a dense step takes seconds (134 MB each way per step); the warm-up
    batches cover hvd_dgc's profile of the backward pass and its trial of two plans
    (hvd_dgc/overlap.py: decided by DECIDED_BY_STEP, 17), so the timed steps run on the
    paths a long job runs on."""
    if link == "loopback":
        timed = ["--num-batches-per-iter", "3", "--num-iters", "4"]
    else:
        timed = ["--num-batches-per-iter", "2", "--num-iters", "2"]
    return ["--num-warmup-batches", str(DECIDED_BY_STEP)] + timed


def run(link, flags, timeout, extra_env=None, framework="torch"):
    """Rank 0's output of one run of ``framework``'s example over ``link``."""
    script, script_env = SCRIPTS[framework]
    argv = script + steps(link) + flags
    job_env = dict(ENV, **script_env, **(extra_env or {}))
    if link == "loopback":
        env = dict(os.environ, **job_env, PYTHONPATH=REPO)
        proc = subprocess.run(["horovodrun", "-np", "2", "-H", "localhost:2", "--gloo"] + argv,
                              capture_output=True, text=True, env=env, timeout=timeout,
                              cwd=REPO)
        lines = [line.split(":", 1)[1] for line in proc.stdout.splitlines()
                 if line.startswith("[0]<stdout>:")]
        return proc.returncode, "\n".join(lines), proc.stderr
    from harness.launch import run_job
    from harness.wan import WanLink
    rate, rtt = link
    with WanLink(rate_mbit=rate, rtt_ms=rtt) as wan:
        (code, out, err), (code1, _, err1) = run_job(wan, argv, env=job_env, timeout=timeout)
    return code if code else code1, out, err + err1


def parse(out):
    rate = re.search(r"Total img/sec on 2 CPU\(s\): ([\d.]+)", out)
    measured = re.search(r"link measured: ([^;]*?\))", out)
    dense = re.search(r"dense where sparse would cost more: (.*?)(?:;|\. For )", out)
    sent = re.search(r"Compression: .*\((\d+)x\)", out)
    tried = re.search(r"both were tried at density [^:]+: ([\d.]+) ms a step on the "
                      r"timeline's paths .*?, ([\d.]+) ms on the sums': (the \w+) kept: "
                      r"(\d+ of \d+)", out)
    dense_tried = re.search(r"the cost model's plan \((\d+ of \d+) large tensors sparse at "
                            r"density [^)]+\) took ([\d.]+) ms a step and every tensor dense "
                            r"([\d.]+) ms: (dense|the cost model's plan) kept", out)
    if dense_tried:  # Keras' trial (hvd_dgc/tensorflow/plan_trial.py)
        tried_words = (f"{'all dense' if dense_tried.group(4) == 'dense' else 'sums'} kept "
                       f"({dense_tried.group(1)} sparse on the sums' plan): sums "
                       f"{dense_tried.group(2)} ms a step, all dense {dense_tried.group(3)}")
    else:
        tried_words = ""
    return {"img_s": float(rate.group(1)) if rate else None,
            "link_measured": measured.group(1) if measured else "",
            "dense_by_cost": dense.group(1) if dense else "",
            "compression": f"{sent.group(1)}x" if sent else "",
            "overlap": (f"{tried.group(3)} kept ({tried.group(4)} sparse): timeline "
                        f"{tried.group(1)} ms a step, sums {tried.group(2)}")
            if tried else tried_words}


def link_name(link):
    return "loopback" if link == "loopback" else f"{link[0]:g} Mbit/s, RTT {link[1]:g} ms"


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--links", nargs="*", default=["loopback", "1000:0", "100:0", "100:50"],
                    help="loopback, or RATE_MBIT:RTT_MS over the emulated link")
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs of each configuration over loopback (the median is kept)")
    ap.add_argument("--emulated-repeats", type=int, default=1,
                    help="runs of each configuration over an emulated link")
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS),
                    help=f"which of {list(CONFIGS)} (stock Horovod always runs), or of "
                         f"{list(EXTRA)} (by name only)")
    ap.add_argument("--framework", choices=sorted(SCRIPTS), default="torch",
                    help="torch: examples/pytorch_synthetic_benchmark.py; keras: "
                         "examples/keras_synthetic_benchmark.py (model.fit, Keras 2)")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results"))
    args = ap.parse_args()
    known = {**{name: (flags, None) for name, flags in CONFIGS.items()}, **EXTRA}
    unknown = sorted(set(args.configs) - set(known))
    if unknown:
        sys.exit(f"--configs: unknown {unknown}; choose among {list(known)}")
    if args.framework != "torch":
        torch_only = [name for name in args.configs
                      if any(flag in known[name][0] for flag in TORCH_ONLY)]
        if torch_only:
            sys.exit(f"--configs {torch_only} run in PyTorch's example only: leave them out "
                     f"with --framework {args.framework}")
    configs = {name: spec for name, spec in known.items()
               if name == "stock Horovod" or name in args.configs}
    links = []
    for spec in args.links:
        if spec == "loopback":
            links.append(spec)
        else:
            rate, rtt = spec.split(":")
            links.append((float(rate), float(rtt)))
    if any(link != "loopback" for link in links):
        from harness.wan import available
        ok, why = available()
        if not ok:
            sys.exit(f"the WAN emulator is unavailable here ({why}); run with --links "
                     f"loopback, or as root")
    rows = []
    for link in links:
        # loopback is noisy (both ranks share this machine's cores): the configurations
        # take turns, and each row is the median of its runs
        repeats = args.repeats if link == "loopback" else args.emulated_repeats
        runs = {name: [] for name in configs}
        for _ in range(repeats):
            for name, (flags, extra_env) in configs.items():
                code, out, err = run(link, flags, args.timeout, extra_env, args.framework)
                row = parse(out)
                if code != 0 or row["img_s"] is None:
                    sys.exit(f"{name} over {link_name(link)} failed (exit {code}):\n{out}\n"
                             f"{err[-3000:]}")
                runs[name].append(row)
        stock = statistics.median(r["img_s"] for r in runs["stock Horovod"])
        for name, parsed in runs.items():
            row = {"link": link_name(link), "config": name, **parsed[-1],
                   "img_s": statistics.median(r["img_s"] for r in parsed),
                   "runs": " ".join(f"{r['img_s']:.1f}" for r in parsed)}
            overlaps = sorted({r["overlap"] for r in parsed})
            if len(overlaps) > 1:
                row["overlap"] = "; ".join(f"{r['img_s']:.1f}: {r['overlap'] or 'none'}"
                                           for r in parsed)
            decided = sorted({r["dense_by_cost"] or "none" for r in parsed})
            if len(decided) > 1:  # (the measured numbers moved a path: each run's)
                row["dense_by_cost"] = "; ".join(
                    f"{r['img_s']:.1f}: {r['dense_by_cost'] or 'none'}" for r in parsed)
            row["vs_stock"] = round(row["img_s"] / stock, 3)
            rows.append(row)
            print(f"{row['link']:24s} {name:34s} {row['img_s']:8.1f} img/s  "
                  f"{row['vs_stock']:.2f}x stock  {row['compression']:>6s}  "
                  f"{row['dense_by_cost']}  {row['overlap']}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    fields = ["link", "config", "img_s", "runs", "vs_stock", "compression", "dense_by_cost",
              "overlap", "link_measured"]
    stem = "never_slower" if args.framework == "torch" else f"never_slower_{args.framework}"
    example = os.path.basename(SCRIPTS[args.framework][0][1])
    with open(os.path.join(args.out, f"{stem}.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    with open(os.path.join(args.out, f"{stem}.md"), "w") as f:
        f.write("# The one-line switch vs stock Horovod, fast and slow links\n\n"
                f"`python bench/never_slower.py --framework {args.framework}` (one run; 2 "
                f"ranks, one CPU thread each, examples/{example} `--model wide_mlp`, "
                "33.5M parameters; hvd_dgc with its default cost model: the link and DGC's "
                "own work measured at wrap time).\n\n"
                "| link | run | img/s (median of runs) | vs stock | sent less | large tensors "
                "sent dense (cost model) | "
                + ("the sums' plan tried against all dense (hvd_dgc/tensorflow/plan_trial.py)"
                   if args.framework == "keras" else
                   "the step's timeline tried against the sums (hvd_dgc/overlap.py)")
                + " | link measured |\n|---|---|---|---|---|---|---|---|\n")
        for r in rows:
            f.write(f"| {r['link']} | {r['config']} | {r['img_s']:.1f} ({r['runs']}) | "
                    f"{r['vs_stock']:.2f}x | "
                    f"{r['compression']} | {r['dense_by_cost']} | {r['overlap']} | "
                    f"{r['link_measured']} |\n")
    print(f"wrote {args.out}/{stem}.csv and {stem}.md")


if __name__ == "__main__":
    main()
