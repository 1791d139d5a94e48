#!/usr/bin/env bash
# Quick demo run by tools/install.sh: 2 ranks, DGC at 99.9% sparsity with warm-up,
# on MNIST when torchvision and the data are there, else scikit-learn's digits.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$REPO/.venv}"
export PATH="$VENV/bin:$PATH" TF_CPP_MIN_LOG_LEVEL=3 OMP_NUM_THREADS=1 \
       OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
horovodrun -np 2 -H localhost:2 --gloo python "$REPO/examples/pytorch_mnist.py" --dgc --stats \
  --epochs "${EPOCHS:-10}" --batch-size 32 --warmup-epochs 2 --no-progress "$@" 2>&1 \
  | grep -v "cudart_stub\|absl::InitializeLog"
