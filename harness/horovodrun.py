"""``horovodrun`` for the test suite: Horovod's own launcher with its build checks asked once.

Each ``horovodrun`` asks what Horovod was built with (Gloo, MPI, NCCL: the functions of
``horovod.common.util`` that ``horovod.runner.launch`` imports) by loading each framework's
extension in a forked process, TensorFlow's first: about 6 s of CPU on every launch (the
import of TensorFlow), a fifth of the suite's time on 2 cores, for answers that change only
when Horovod is built again. Here they are asked once and kept in a file named by the
installed extensions (their paths, sizes and times: a new build asks again); the launch
itself is ``horovod.runner.launch.run_commandline``, unchanged.

    python -m harness.horovodrun -np 2 -H localhost:2 --gloo python train.py
"""

import glob
import hashlib
import json
import os
import sys

CHECKS = ("gloo_built", "mpi_built", "nccl_built", "ddl_built", "ccl_built")


def cache_path():
    import horovod
    root = os.path.dirname(horovod.__file__)
    stamp = hashlib.sha256()
    for lib in sorted(glob.glob(os.path.join(root, "*", "mpi_lib*.so"))):
        st = os.stat(lib)
        stamp.update(f"{lib}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    base = os.environ.get("HVD_DGC_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "hvd_dgc")
    return os.path.join(base, f"horovodrun_checks_{horovod.__version__}_"
                              f"{stamp.hexdigest()[:16]}.json")


def _load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _store(path, answers):
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(answers, f)
        os.replace(tmp, path)  # (launches in parallel: whole files only)
    except OSError:
        pass  # a read-only home: asked again next time, as horovodrun does


def ask_once(launch):
    """Replace ``launch``'s build checks with ones that answer from the file, asking
    Horovod's own check (and keeping its answer) the first time."""
    path = cache_path()
    answers = _load(path)

    def cached(name, check):
        def answer(verbose=False):
            if name not in answers:
                answers[name] = check(verbose=verbose)
                _store(path, answers)
            return answers[name]
        return answer

    for name in CHECKS:
        setattr(launch, name, cached(name, getattr(launch, name)))


def main():
    from horovod.runner import launch
    ask_once(launch)
    sys.argv[0] = "horovodrun"
    sys.exit(launch.run_commandline())


if __name__ == "__main__":
    main()
