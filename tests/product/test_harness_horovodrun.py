"""The suite's launcher (harness/horovodrun.py): Horovod's horovodrun with its build checks
asked once and kept, so it must answer them as Horovod's own checks do."""

import json
import os
import subprocess
import sys

import horovod.torch as hvd

from harness.hvdrun import REPO, horovodrun_command, worker_env


def _launch(controller, cache):
    return subprocess.run([*horovodrun_command(), "-np", "1", "-H", "localhost:1",
                           f"--{controller}", sys.executable, "-c", "print('ran')"],
                          env=worker_env({"HVD_DGC_CACHE": str(cache)}), cwd=REPO,
                          capture_output=True, text=True, timeout=180)


def test_the_kept_answers_are_horovods_own_and_launches_read_them(tmp_path):
    for controller in ("gloo", "mpi"):
        for _ in range(2):  # asked, then read from the file
            done = _launch(controller, tmp_path)
            assert done.returncode == 0 and "ran" in done.stdout, done.stderr[-3000:]
    kept = [f for f in os.listdir(tmp_path) if f.startswith("horovodrun_checks_")]
    assert len(kept) == 1, kept
    with open(tmp_path / kept[0]) as f:
        answers = json.load(f)
    assert answers == {"gloo_built": bool(hvd.gloo_built()), "mpi_built": bool(hvd.mpi_built())}
