"""Entry point of one rank started by harness/hvdrun.py: import, call, save the result.

``HVD_DGC_RANK_SETUP=module:function``, when set, names a function each rank calls
first, before the target is imported (the tests set it: tests/conftest.py)."""

import importlib
import os
import pickle
import sys

SETUP = "HVD_DGC_RANK_SETUP"


def _call(target, **kwargs):
    module, func = target.split(":")
    return getattr(importlib.import_module(module), func)(**kwargs)


def main():
    target, outdir = sys.argv[1], sys.argv[2]
    with open(os.path.join(outdir, "kwargs.pkl"), "rb") as f:
        kwargs = pickle.load(f)
    if os.environ.get(SETUP):
        _call(os.environ[SETUP])
    result = _call(target, **kwargs)
    rank = int(os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    with open(os.path.join(outdir, f"rank{rank}.pkl.tmp"), "wb") as f:
        pickle.dump(result, f)
    os.replace(os.path.join(outdir, f"rank{rank}.pkl.tmp"), os.path.join(outdir, f"rank{rank}.pkl"))


if __name__ == "__main__":
    main()
