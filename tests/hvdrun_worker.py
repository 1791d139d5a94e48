"""Entry point of one rank started by tests/hvdrun.py: import, call, save the result."""

import importlib
import os
import pickle
import sys


def main():
    target, outdir = sys.argv[1], sys.argv[2]
    module, func = target.split(":")
    with open(os.path.join(outdir, "kwargs.pkl"), "rb") as f:
        kwargs = pickle.load(f)
    if os.environ.get("HVD_DGC_TEST_DEVICE", "cpu") != "cpu":
        from tests.workers.device import prepare_process
        prepare_process()
    result = getattr(importlib.import_module(module), func)(**kwargs)
    rank = int(os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    with open(os.path.join(outdir, f"rank{rank}.pkl.tmp"), "wb") as f:
        pickle.dump(result, f)
    os.replace(os.path.join(outdir, f"rank{rank}.pkl.tmp"), os.path.join(outdir, f"rank{rank}.pkl"))


if __name__ == "__main__":
    main()
