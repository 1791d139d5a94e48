"""Refuse to let Horovod's allreduce-based code sum a sparse payload.

Horovod's stock DistributedOptimizer (and ``hvd.allreduce(..., compression=)``)
sums whatever ``compress`` returns. A top-k payload holds different indices
on every rank, so a sum of payloads is meaningless (and of different lengths,
so Horovod would fail later with an opaque shape mismatch). We recognise the
caller by its module and stop at the first call, with the fix in the message.
"""

import sys

_ALLREDUCE_CALLERS = (
    "horovod.torch.optimizer", "horovod.torch.mpi_ops",
    "horovod.tensorflow", "horovod._keras", "horovod.keras",
)


def called_from_horovod_allreduce(depth=2):
    """True when the function ``depth`` frames up was called by Horovod's allreduce code."""
    try:
        module = sys._getframe(depth).f_globals.get("__name__", "")
    except ValueError:
        return False
    return any(module == m or module.startswith(m + ".") for m in _ALLREDUCE_CALLERS)


def _ours(framework):
    """hvd_dgc's optimizer and module for ``framework``, for the messages."""
    if framework == "torch":
        return "hvd_dgc.torch.DistributedOptimizer", "hvd_dgc.torch"
    return ("hvd_dgc.tensorflow.DistributedGradientTape / "
            "hvd_dgc.tensorflow.keras.DistributedOptimizer"), "hvd_dgc.tensorflow"


def sparse_under_allreduce_error(compressor_name, framework):
    opt, mod = _ours(framework)
    return TypeError(
        f"{compressor_name} is a sparse compressor: each rank sends different "
        f"(index, value) pairs, which Horovod's allreduce cannot sum. Horovod's own "
        f"DistributedOptimizer/allreduce was given it. Use {opt} with "
        f"compression={compressor_name} (or `import {mod} as hvd`), which sends it "
        f"with allgather.")


def not_summable_error(compressor_name, why, framework="torch"):
    """The same refusal for compressors whose payload Horovod's compress -> allreduce ->
    decompress contract cannot carry (``why`` says what it would need)."""
    opt, mod = _ours(framework)
    return TypeError(
        f"{compressor_name} cannot run inside Horovod's own DistributedOptimizer/allreduce: "
        f"{why}. Use {opt} with compression={compressor_name} "
        f"(or `import {mod} as hvd`), which runs its collectives.")
