"""``python -m hvd_dgc.info``: versions, and what Horovod was built with.

Versions are read from the installed packages' metadata (nothing imported). Horovod's
TensorFlow extension is loaded in a child process that starts first and runs while
this one loads Horovod's PyTorch extension, so the two imports overlap; TensorFlow's
start-up log lines stay in the child (shown where it fails, or where the environment
sets ``TF_CPP_MIN_LOG_LEVEL=0``: then as TensorFlow prints them).
"""

import importlib
import importlib.metadata
import json
import os
import subprocess
import sys

#: The child's check: TensorFlow's version and whether Horovod's extension loads with it.
_TF_CHECK = ("import json, tensorflow as tf, horovod.tensorflow as h; "
             "print(json.dumps([tf.__version__, bool(h.mpi_built() or h.gloo_built())]))")

#: Distribution names to try for each module's version (TensorFlow has several builds).
_DISTRIBUTIONS = {"tensorflow": ("tensorflow", "tensorflow-cpu", "tensorflow-gpu",
                                 "tensorflow-intel"),
                  "tf_keras": ("tf-keras", "tf_keras")}


def _version(module):
    """The installed version of ``module``, from its package's metadata, else from the
    module itself (imported)."""
    for name in _DISTRIBUTIONS.get(module, (module,)):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    try:
        return importlib.import_module(module).__version__
    except Exception as exc:  # report, don't fail: info is for diagnosing installs
        return f"not available ({type(exc).__name__}: {exc})"


def _start_tf_check():
    """The child that loads TensorFlow and Horovod's extension for it; its log lines are
    kept (the last one said where it fails) unless ``TF_CPP_MIN_LOG_LEVEL=0``."""
    quiet = os.environ.get("TF_CPP_MIN_LOG_LEVEL", "").strip() != "0"  # 0: show them all
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "3"))
    try:
        return subprocess.Popen([sys.executable, "-c", _TF_CHECK], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE if quiet else None, text=True,
                                env=env)
    except OSError as exc:
        return exc


def _tf_result(child):
    """``(tensorflow version or None, what to say of Horovod's TensorFlow extension)``."""
    if isinstance(child, Exception):
        return None, f"no (could not start the check: {child})"
    out, err = child.communicate()
    if child.returncode == 0:
        try:
            version, built = json.loads(out.strip().splitlines()[-1])
            return version, bool(built)
        except (ValueError, IndexError):
            pass
    lines = [line for line in (err or "").splitlines() if line.strip()]
    why = lines[-1] if lines else f"exit code {child.returncode}"
    return None, f"no ({why})"


def collect():
    child = _start_tf_check()
    import hvd_dgc
    info = {
        "hvd_dgc": hvd_dgc.__version__,
        "python": sys.version.split()[0],
        "horovod": _version("horovod"),
        "torch": _version("torch"),
        "tensorflow": _version("tensorflow"),
        "tf_keras": _version("tf_keras"),
        "numpy": _version("numpy"),
    }
    built = {}
    try:
        import horovod.torch as hvd_torch
        built["frameworks.pytorch"] = True
        built["controllers.mpi"] = bool(hvd_torch.mpi_built())
        built["controllers.gloo"] = bool(hvd_torch.gloo_built())
        built["ops.nccl"] = bool(hvd_torch.nccl_built())
        built["cuda"] = bool(hvd_torch.cuda_built())
    except Exception as exc:
        built["frameworks.pytorch"] = f"no ({type(exc).__name__}: {exc})"
    try:
        from hvd_dgc.torch.memory import fused_kernel_available
        kernel = ("built" if fused_kernel_available() else
                  "not built (eager PyTorch; build it with "
                  "`python setup.py build_ext --inplace`)")
    except Exception as exc:
        kernel = f"not available ({type(exc).__name__}: {exc})"
    version, built["frameworks.tensorflow"] = _tf_result(child)
    if version is not None:
        info["tensorflow"] = version  # the one that loaded
    info["horovod_built_with"] = built
    info["hvd_dgc fused kernel"] = kernel
    return info


def main():
    info = collect()
    width = max(len(k) for k in info)
    for key, value in info.items():
        if isinstance(value, dict):
            print(f"{key}:")
            for k, v in value.items():
                print(f"  {k:<22} {v}")
        else:
            print(f"{key:<{width}}  {value}")


if __name__ == "__main__":
    main()
