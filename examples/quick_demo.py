"""Helper of examples/quick_demo.sh: can the emulated slow link run here, and the
side-by-side summary of the two runs (Horovod dense, hvd_dgc by the one-line switch).

    python examples/quick_demo.py check                        # exit 0, or 1 and why
    python examples/quick_demo.py summary DENSE.log DGC.log    # the summary's lines

The link is the project's WAN emulator: two network namespaces joined by a user-space
bottleneck (harness/wan.py), each with a real sshd so that Horovod's own horovodrun
reaches them (harness/hosts.py). It needs root, /dev/net/tun, `ip` and openssh-server.

A log is what horovodrun printed for examples/pytorch_mnist.py. samples/s is over the
training steps of the whole run (each epoch's own rate, as the script prints it,
weighted by its time: evaluation and start-up not counted); test accuracy is the last
epoch's.
"""

import argparse
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LABELS = ("Horovod, dense allreduce", "hvd_dgc, one-line switch")
EPOCH = re.compile(r"epoch +(\d+) .*?test accuracy ([\d.]+) +([\d,]+) samples/s")
DATA = re.compile(r"data: (.*?);")


def emulator_available():
    """(ok, why): can two emulated hosts on a slow link, reached by ssh, run here?"""
    sys.path.insert(0, REPO)
    try:
        from harness.hosts import DEFAULT_SSHD, HostsError, _tools, available
    except ImportError as exc:  # a copy of examples/ without the repository around it
        return False, f"the emulator (harness/) is not here: {exc}"
    ok, why = available()
    if not ok:
        return False, why
    try:
        _tools(DEFAULT_SSHD)
    except HostsError as exc:
        return False, str(exc)
    return True, ""


def parse_run(text, name="run"):
    """{"epochs", "accuracy", "samples_per_s", "data"} from one run's log."""
    epochs = [(int(e), float(a), float(r.replace(",", ""))) for e, a, r in EPOCH.findall(text)]
    if not epochs:
        raise ValueError(f"{name}: no 'epoch N ... test accuracy A  R samples/s' line in its "
                         f"log: the run failed or printed nothing (see its output above)")
    if any(rate <= 0 for _, _, rate in epochs):
        raise ValueError(f"{name}: an epoch's rate is 0 samples/s in its log")
    data = DATA.search(text)
    # Equal samples each epoch: the whole run's rate is the harmonic mean of the epochs'.
    return {"epochs": len(epochs), "accuracy": epochs[-1][1],
            "samples_per_s": len(epochs) / sum(1.0 / rate for _, _, rate in epochs),
            "data": data.group(1) if data else None}


def summary_lines(dense_text, dgc_text):
    """The summary's last two lines: test accuracy and samples/s of each run, side by side."""
    dense, dgc = parse_run(dense_text, "Horovod run"), parse_run(dgc_text, "hvd_dgc run")
    if dense["epochs"] != dgc["epochs"]:
        raise ValueError(f"the runs differ in length: {dense['epochs']} and {dgc['epochs']} "
                         f"epochs; they are compared at equal steps")
    return [f"  {LABELS[0]}   test accuracy {dense['accuracy']:.3f}   "
            f"{dense['samples_per_s']:,.0f} samples/s",
            f"  {LABELS[1]}   test accuracy {dgc['accuracy']:.3f}   "
            f"{dgc['samples_per_s']:,.0f} samples/s "
            f"({dgc['samples_per_s'] / dense['samples_per_s']:.1f}x)"]


def _read(path):
    with open(path) as f:
        return f.read()


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python examples/quick_demo.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check", help="exit 0 if the emulated link can run here, else print why")
    s = sub.add_parser("summary", help="the side-by-side summary of two runs' logs")
    s.add_argument("dense_log")
    s.add_argument("dgc_log")
    args = ap.parse_args(argv)
    if args.cmd == "check":
        ok, why = emulator_available()
        if not ok:
            print(why.splitlines()[0])
        return 0 if ok else 1
    try:
        dense, dgc = _read(args.dense_log), _read(args.dgc_log)
        lines = summary_lines(dense, dgc)
    except (OSError, ValueError) as exc:
        print(f"quick demo: no summary: {exc}", file=sys.stderr)
        return 1
    run = parse_run(dense)
    data = run["data"] or "the data the script printed"
    if "scikit-learn digits" in data:  # said plainly: not MNIST
        data = "scikit-learn's digits (MNIST is not available here)"
    print(f"\nquick demo, side by side: the same script and seed, {run['epochs']} epochs each, "
          f"on {data};\ntest accuracy after the last epoch, samples/s over the training steps "
          f"(start-up and evaluation not counted):")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
