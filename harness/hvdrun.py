"""Run a function on N real Horovod ranks under ``horovodrun`` and collect each rank's result.

    results = run("tests.product.smoke:torch_collectives", np=2, controller="gloo")
    results[0], results[1]   # whatever the function returned on rank 0 and rank 1

The function is imported by name in every rank (so it lives in a module, not
in the test), calls ``hvd.init()`` itself, and returns picklable data. A rank
that raises fails the run, and the error carries both ranks' output. Each rank runs
harness/hvdrun_worker.py (``python -m harness.hvdrun_worker``), which can first call a
setup function named in the environment (HVD_DGC_RANK_SETUP: the tests' device set-up).
"""

import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def horovodrun_command():
    """How the suite starts ``horovodrun``: Horovod's own launcher with its build checks
    asked once, not at every launch (harness/horovodrun.py: 6 s of CPU a launch)."""
    return [sys.executable, "-m", "harness.horovodrun"]


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


def run(target, np=2, controller="gloo", kwargs=None, timeout=300, env=None, extra_args=(),
        hosts=None):
    """Run ``module:function(**kwargs)`` on ``np`` ranks; return the list of results by rank.

    ``hosts``: an open harness.hosts.EmulatedHosts; horovodrun then starts on its first
    host and reaches the others over ssh, its ranks spread by the hosts' slots."""
    job = launch(target, np, controller, kwargs, timeout, env, extra_args, hosts=hosts)
    for rank in range(np):
        if job.returncode != 0 or rank not in job.results:
            raise RuntimeError(
                f"horovodrun {target} (np={np}, {controller}) failed with exit code "
                f"{job.returncode}; rank {rank} wrote no result.\n{job.output()}")
    return [job.results[rank] for rank in range(np)]


class Job:
    """What one horovodrun launch left: exit status, wall time, output, results by rank."""

    def __init__(self, returncode, elapsed, stdout, stderr, results):
        self.returncode, self.elapsed = returncode, elapsed
        self.stdout, self.stderr, self.results = stdout, stderr, results

    def output(self):
        return (f"--- stdout ---\n{self.stdout[-6000:]}\n"
                f"--- stderr ---\n{self.stderr[-6000:]}")


def launch(target, np=2, controller="gloo", kwargs=None, timeout=300, env=None, extra_args=(),
           launcher_args=None, hosts=None):
    """Like ``run`` but never raises on a failed job: returns a ``Job`` whose ``results``
    holds the ranks that finished (for jobs that are meant to die: kill/resume, faults).

    ``launcher_args`` replaces ``-np N -H localhost:N --controller`` (elastic runs)."""
    if controller not in ("gloo", "mpi"):
        raise ValueError(controller)
    outdir = tempfile.mkdtemp(prefix="hvd_dgc_test_")
    try:
        with open(os.path.join(outdir, "kwargs.pkl"), "wb") as f:
            pickle.dump(kwargs or {}, f)
        if launcher_args is None:
            launcher_args = ["-np", str(np), f"--{controller}"] + \
                ([] if hosts else ["-H", f"localhost:{np}"])
        worker = [*launcher_args, *extra_args, sys.executable, "-m", "harness.hvdrun_worker",
                  target, outdir]
        start = time.monotonic()
        if hosts:
            out, err, code = _on_hosts(hosts, worker, env, timeout)
        else:
            out, err, code = _here([*horovodrun_command(), *worker], env, timeout)
        elapsed = time.monotonic() - start
        results = {}
        for name in os.listdir(outdir):
            if name.startswith("rank") and name.endswith(".pkl"):
                with open(os.path.join(outdir, name), "rb") as f:
                    results[int(name[4:-4])] = pickle.load(f)
        return Job(code, elapsed, out, err, results)
    finally:
        shutil.rmtree(outdir, ignore_errors=True)


def _here(cmd, env, timeout):
    # A session of its own: a job past its timeout is stopped with all it started.
    proc = subprocess.Popen(cmd, cwd=REPO, env=worker_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return out, err, proc.returncode
    except subprocess.TimeoutExpired:
        proc.terminate()  # horovodrun stops its ranks (they run in sessions of their own)
        try:
            out, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        return out, err, None


def _on_hosts(hosts, args, env, timeout):
    try:
        done = hosts.horovodrun(args, env=worker_env(env), cwd=REPO, timeout=timeout)
        return done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as stopped:  # hosts stopped the job on every host
        return stopped.stdout or "", stopped.stderr or "", None


def elastic_launch(target, tmp_path, np, slots_before, slots_after, max_np=2, env=None,
                   timeout=240):
    """``target`` under horovodrun's elastic mode (``--min-np 1 --max-np max_np``) with a
    discovery script offering the hosts ``slots_before`` (``"localhost:2"``, or several
    host lines) until the worker writes the file it gets as ``flag``, then
    ``slots_after``. ``--network-interface lo``: with one machine Horovod cannot probe
    interfaces between hosts and would wait (its own message). Gloo's rendezvous waits
    120 s, not Horovod's 30, unless ``env`` says: a joining worker that imports
    TensorFlow on a loaded 2-core machine took longer, and the world it joins aborted
    ("Wait timeout after 30 seconds for key(s)"); a crash still fails a collective at
    once (its peer's socket closes)."""
    env = {"HOROVOD_GLOO_TIMEOUT_SECONDS": "120", **(env or {})}
    flag = tmp_path / "flag"
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\nif [ -f {flag} ]; then printf '{slots_after}\\n'; "
                      f"else printf '{slots_before}\\n'; fi\n")
    script.chmod(0o755)
    return launch(target, kwargs={"flag": str(flag)}, timeout=timeout, env=env,
                  launcher_args=["-np", str(np), "--min-np", "1", "--max-np", str(max_np),
                                 "--host-discovery-script", str(script), "--gloo",
                                 "--network-interface", "lo"])
