#!/usr/bin/env bash
# hvd_dgc's GPU tests: tests/torch/test_cuda.py (host synchronisations per step, DGC's
# fixed-size GPU selection, GradScaler) at np=1 and np=2, then the PyTorch suites again
# with every model and batch on CUDA (HVD_DGC_TEST_DEVICE=cuda), over Horovod's NCCL
# operations: DGC, DGA (delay, period), compressors, the flat engine, buckets and the
# fold, region reduce, hierarchical DGC, the Adam-family mode and the outer loop. Needs a GPU and Horovod built with NCCL
# (tools/build_horovod_gpu.sh). Two ranks may share one GPU (tests/device.py).
# Extra arguments go to pytest.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
cd "$REPO"
"$PYTHON" - <<'PY'
import sys
import torch
try:
    import horovod.torch as hvd
except ImportError:
    sys.exit("Horovod is not installed: run tools/build_horovod_gpu.sh")
if not torch.cuda.is_available():
    sys.exit("no CUDA GPU visible to torch")
if not hvd.nccl_built():
    sys.exit("this Horovod has no NCCL operations: run tools/build_horovod_gpu.sh")
PY
export HVD_DGC_TEST_DEVICE=cuda TF_CPP_MIN_LOG_LEVEL=3 PYTHONDONTWRITEBYTECODE=1
# The MPI controller's tests need mpirun; Gloo runs everywhere.
exec "$PYTHON" -m pytest -ra --timeout=900 -k "not mpi" "$@" tests/torch/test_cuda.py \
  tests/torch/test_optimizer.py tests/torch/test_dga.py tests/torch/test_compressors.py \
  tests/torch/test_flat_engine.py tests/torch/test_fusion.py tests/torch/test_region_reduce.py \
  tests/torch/test_hierarchical.py tests/torch/test_adam.py tests/torch/test_outer.py
