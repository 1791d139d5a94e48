#!/usr/bin/env bash
# Quick demo run by tools/install.sh: the same script (examples/pytorch_mnist.py, 2 ranks)
# under Horovod, dense, and under hvd_dgc with the one-line switch and its defaults, side
# by side: test accuracy and bytes sent. MNIST when torchvision and the data are there,
# else scikit-learn's digits (said in the output). Extra arguments go to both runs.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$REPO/.venv}"
export PATH="$VENV/bin:$PATH" TF_CPP_MIN_LOG_LEVEL=3 OMP_NUM_THREADS=1 \
       OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# The two ranks share this machine, whose loopback is faster than any network DGC is
# for: measured, it would rightly send dense. The demo assumes a 1 Gbit/s link between
# them instead, as between two machines (HVD_DGC_COST_MODEL=measure to see the other).
export HVD_DGC_COST_MODEL="${HVD_DGC_COST_MODEL:-assumed}"
echo "quick demo: 2 ranks on this machine, hvd_dgc's cost model assuming a 1 Gbit/s link" \
     "(HVD_DGC_COST_MODEL=$HVD_DGC_COST_MODEL)"
LOGS="$(mktemp -d)"
trap 'rm -rf "$LOGS"' EXIT

run() {  # run NAME FLAGS...: train, show rank 0's lines, keep them for the summary
  local name="$1"; shift
  echo "== $name =="
  horovodrun -np 2 -H localhost:2 --gloo python "$REPO/examples/pytorch_mnist.py" \
    --epochs "${EPOCHS:-10}" --batch-size 32 --no-progress "$@" 2>&1 \
    | grep -v "cudart_stub\|absl::InitializeLog" | tee "$LOGS/$name"
}
run dense "$@"
run dgc --dgc --stats "$@"

accuracy() { grep -o "test accuracy [0-9.]*" "$LOGS/$1" | tail -1 | awk '{print $3}'; }
sent() { grep -o "whole run: sent [0-9,]* B" "$LOGS/$1" | awk '{print $4}' | tr -d ,; }
dense_acc="$(accuracy dense)"; dgc_acc="$(accuracy dgc)"
dense_bytes="$(sent dense)"; dgc_bytes="$(sent dgc)"
echo
echo "quick demo, side by side (same script, same seed; only the import line differs):"
printf "  %-30s test accuracy %s   sent %'d B\n" "Horovod, dense allreduce" \
  "$dense_acc" "$dense_bytes"
printf "  %-30s test accuracy %s   sent %'d B (%.1fx less)\n" "hvd_dgc, one-line switch" \
  "$dgc_acc" "$dgc_bytes" "$(awk -v d="$dense_bytes" -v c="$dgc_bytes" 'BEGIN{print d/c}')"
awk -v d="$dense_acc" -v c="$dgc_acc" 'BEGIN{printf "  accuracy difference: %+.1f points\n", (c-d)*100}'
