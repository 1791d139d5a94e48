"""Run a function on N real Horovod ranks under ``horovodrun`` and collect each rank's result.

    results = run("tests.workers.torch_basics:collectives", np=2, controller="gloo")
    results[0], results[1]   # whatever the function returned on rank 0 and rank 1

The function is imported by name in every rank (so it lives in a module, not
in the test), calls ``hvd.init()`` itself, and returns picklable data. A rank
that raises fails the run, and the error carries both ranks' output.
"""

import os
import pickle
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def horovodrun_path():
    exe = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    return exe if os.path.exists(exe) else shutil.which("horovodrun")


def worker_env(extra=None):
    env = dict(os.environ)
    env.update({
        "PYTHONPATH": REPO + os.pathsep + env.get("PYTHONPATH", ""),
        # Open MPI refuses root unless told; CI runs as root.
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        # Containers often forbid the ptrace-based single-copy shared memory path.
        "OMPI_MCA_btl_vader_single_copy_mechanism": "none",
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    })
    env.update(extra or {})
    return env


def run(target, np=2, controller="gloo", kwargs=None, timeout=300, env=None, extra_args=()):
    """Run ``module:function(**kwargs)`` on ``np`` ranks; return the list of results by rank."""
    if controller not in ("gloo", "mpi"):
        raise ValueError(controller)
    outdir = tempfile.mkdtemp(prefix="hvd_dgc_test_")
    try:
        with open(os.path.join(outdir, "kwargs.pkl"), "wb") as f:
            pickle.dump(kwargs or {}, f)
        cmd = [horovodrun_path(), "-np", str(np), "-H", f"localhost:{np}", f"--{controller}",
               *extra_args, sys.executable, "-m", "tests.hvdrun_worker", target, outdir]
        proc = subprocess.run(cmd, cwd=REPO, env=worker_env(env), capture_output=True,
                              text=True, timeout=timeout)
        results = []
        for rank in range(np):
            path = os.path.join(outdir, f"rank{rank}.pkl")
            if proc.returncode != 0 or not os.path.exists(path):
                raise RuntimeError(
                    f"horovodrun {target} (np={np}, {controller}) failed with exit code "
                    f"{proc.returncode}; rank {rank} wrote no result.\n--- stdout ---\n"
                    f"{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}")
            with open(path, "rb") as f:
                results.append(pickle.load(f))
        return results
    finally:
        shutil.rmtree(outdir, ignore_errors=True)
