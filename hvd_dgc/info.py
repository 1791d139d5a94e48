"""``python -m hvd_dgc.info``: versions, and what Horovod was built with."""

import importlib
import os
import sys


def _version(module):
    try:
        return importlib.import_module(module).__version__
    except Exception as exc:  # report, don't fail: info is for diagnosing installs
        return f"not available ({type(exc).__name__}: {exc})"


def collect():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
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
        import horovod.tensorflow as hvd_tf
        built["frameworks.tensorflow"] = bool(hvd_tf.mpi_built() or hvd_tf.gloo_built())
    except Exception as exc:
        built["frameworks.tensorflow"] = f"no ({type(exc).__name__}: {exc})"
    info["horovod_built_with"] = built
    try:
        from hvd_dgc.torch.memory import fused_kernel_available
        info["hvd_dgc fused kernel"] = ("built" if fused_kernel_available() else
                                        "not built (eager PyTorch; build it with "
                                        "`python setup.py build_ext --inplace`)")
    except Exception as exc:
        info["hvd_dgc fused kernel"] = f"not available ({type(exc).__name__}: {exc})"
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
