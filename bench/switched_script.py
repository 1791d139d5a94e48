"""Horovod's own PyTorch synthetic benchmark, stock against its import line switched.

    python bench/switched_script.py --script HOROVOD/examples/pytorch/pytorch_synthetic_benchmark.py
    python bench/switched_script.py --script ... --pairs 5 -- --model resnet18 --batch-size 16

The script comes from a Horovod checkout or its sdist (``git clone
https://github.com/horovod/horovod``); this project does not ship Horovod's code. Its
switched copy differs in one line: ``import horovod.torch as hvd`` becomes ``import
hvd_dgc.torch as hvd``. Both run under ``horovodrun -np 2 -H localhost:2 --gloo``,
taking turns (stock, switched, stock, ...: this machine's speed drifts, so each pair is
compared within itself), with the arguments after ``--`` (default: ResNet-18, batch 16,
3 warm-up batches, 5 iterations of 5 batches, CPU). Where torchvision is not installed,
``models.resnet18`` is examples/pytorch_synthetic_benchmark.py's built-in (torchvision's
ResNet-18 layer for layer), and the output says so.

Over loopback the link is fast: hvd_dgc's cost model sends every tensor dense, and
Horovod's script uses SGD without momentum, so nothing of DGC's is pending and the
gradients go as stock Horovod sends them (torch/paths.py ``InPlacePath``). Prints each
run's img/s, each pair's ratio, and their median.
"""

import argparse
import importlib.util
import os
import re
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_ARGS = ["--model", "resnet18", "--batch-size", "16", "--num-warmup-batches", "3",
                "--num-batches-per-iter", "5", "--num-iters", "5", "--no-cuda"]
STOCK_IMPORT = "import horovod.torch as hvd"


def switched_copy(script, folder):
    """``script`` and its copy with the import line switched, in ``folder``."""
    with open(script) as f:
        text = f.read()
    if text.count(STOCK_IMPORT) != 1:
        raise SystemExit(f"{script}: expected one line '{STOCK_IMPORT}' to switch")
    paths = {}
    for tag, body in (("stock", text), ("switched", text.replace(
            STOCK_IMPORT, "import hvd_dgc.torch as hvd"))):
        paths[tag] = os.path.join(folder, f"{tag}_{os.path.basename(script)}")
        with open(paths[tag], "w") as f:
            f.write(body)
    return paths


def torchvision_stand_in(folder):
    """A ``torchvision`` package in ``folder`` whose ``models.resnet18`` is the example's
    built-in; None where torchvision is installed."""
    if importlib.util.find_spec("torchvision") is not None:
        return None
    package = os.path.join(folder, "torchvision")
    os.makedirs(package, exist_ok=True)
    with open(os.path.join(package, "__init__.py"), "w") as f:
        f.write("from . import models  # noqa: F401\n")
    with open(os.path.join(package, "models.py"), "w") as f:
        f.write(f'''"""Stand-in for torchvision.models (not installed here)."""
with open({os.path.join(REPO, "examples", "pytorch_synthetic_benchmark.py")!r}) as _f:
    _source = _f.read()
_scope = {{}}
exec("import torch.nn as nn\\nimport torch.nn.functional as F\\n" +
     _source[_source.index("class BasicBlock"):_source.index("def build_model")], _scope)
resnet18 = _scope["resnet18_builtin"]
''')
    return folder


def run_once(script, args, pythonpath):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in pythonpath if p))
    cmd = [os.path.join(os.path.dirname(sys.executable), "horovodrun"), "-np", "2", "-H",
           "localhost:2", "--gloo", sys.executable, script] + args
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    found = re.findall(r"Total img/sec on \d+ \w+\(s\): ([0-9.]+)", out.stdout)
    if out.returncode or not found:
        raise SystemExit(f"{' '.join(cmd)} failed ({out.returncode}):\n"
                         f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    said = [line.split(":", 1)[1] for line in out.stdout.splitlines()
            if line.startswith("[0]<stdout>:[hvd_dgc]")]
    return float(found[-1]), said


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--script", required=True,
                        help="Horovod's examples/pytorch/pytorch_synthetic_benchmark.py")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("args", nargs="*", help="the script's arguments (after --)")
    opts = parser.parse_args()
    args = opts.args or DEFAULT_ARGS
    with tempfile.TemporaryDirectory() as folder:
        paths = switched_copy(opts.script, folder)
        stand_in = torchvision_stand_in(folder)
        if stand_in:
            print("torchvision is not installed: models.resnet18 is "
                  "examples/pytorch_synthetic_benchmark.py's built-in (torchvision's layer "
                  "for layer)")
        pythonpath = [stand_in, REPO, os.environ.get("PYTHONPATH")]
        print(f"{os.path.basename(opts.script)} {' '.join(args)}; 2 ranks, horovodrun "
              f"--gloo over loopback; {opts.pairs} pairs, taking turns")
        ratios = []
        for i in range(opts.pairs):
            stock, _ = run_once(paths["stock"], args, pythonpath)
            switched, said = run_once(paths["switched"], args, pythonpath)
            ratios.append(switched / stock)
            print(f"pair {i + 1}: stock {stock:.1f} img/s, switched {switched:.1f} img/s, "
                  f"{ratios[-1]:.3f}x", flush=True)
            if i == 0:
                for line in said:
                    print("  rank 0 said:" + line)
        print(f"median of the pairs' ratios: {statistics.median(ratios):.3f}x "
              f"(from {min(ratios):.3f}x to {max(ratios):.3f}x)")


if __name__ == "__main__":
    main()
