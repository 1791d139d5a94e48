#!/usr/bin/env bash
# Quick demo run by tools/install.sh: the same script (examples/pytorch_mnist.py, 2 ranks)
# under Horovod, dense, and switched by one line to hvd_dgc, over a slow link: two
# emulated hosts (network namespaces on this machine, each with its own sshd, joined by
# the project's link emulator at 50 Mbit/s, harness/hosts.py) that Horovod's horovodrun
# reaches over ssh, as it would two machines. Side by side: test accuracy and samples/s
# at equal steps. MNIST when torchvision and the data are there, else scikit-learn's
# digits (said in the output). Extra arguments go to both runs.
#
# Where the emulator cannot run (it needs root, /dev/net/tun, `ip` and openssh-server)
# the demo says so and shows the two runs over loopback instead: accuracy and bytes sent.
#
#   EPOCHS=30 (each at most 22 steps)   QUICK_DEMO_RATE_MBIT=50 (the link's rate)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$REPO/.venv}"
export PATH="$VENV/bin:$PATH" TF_CPP_MIN_LOG_LEVEL=3 OMP_NUM_THREADS=1 \
       OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
LOGS="$(mktemp -d)"
trap 'rm -rf "$LOGS"' EXIT
NOISE="cudart_stub\|absl::InitializeLog\|cpu_feature_guard\|oneDNN custom operations"
NOISE="$NOISE\|To enable the following instructions"  # TensorFlow, imported by horovodrun

emulated() {
  local rate="${QUICK_DEMO_RATE_MBIT:-50}" epochs="${EPOCHS:-30}" steps=22
  # hvd_dgc measures the link itself (its default): nothing assumed.
  unset HVD_DGC_COST_MODEL
  echo "quick demo: examples/pytorch_mnist.py on 2 emulated hosts joined by a $rate Mbit/s link"
  echo "  (network namespaces on this machine, one rank each; horovodrun reaches them over ssh)."
  echo "  The same script twice, $epochs epochs of at most $steps steps: Horovod's dense allreduce,"
  echo "  then switched by one line to hvd_dgc, which measures the link itself. hvd_dgc's default"
  echo "  warm-up counts steps and is sized for long runs (25% to step 160, 6.25% to step 640), so"
  echo "  this short run passes the example's --warmup-epochs 4: the paper's 4-epoch warm-up, 25%"
  echo "  to 0.4%, then 0.1% (DistributedOptimizer(warmup=4), optimizer.set_epoch each epoch)."
  run() {  # run NAME FLAGS...: train across the link, show rank 0's lines, keep them
    local name="$1"; shift
    local cmd=(python "$REPO/examples/pytorch_mnist.py" --epochs "$epochs" --max-steps "$steps"
               --batch-size 32 --no-progress "$@")
    echo "== $name: horovodrun -np 2 -H h1:1,h2:1 --gloo ${cmd[*]#"$REPO/"} =="
    python "$REPO/harness/hosts.py" run --hosts h1:1,h2:1 --rate-mbit "$rate" \
      -- -np 2 -H h1:1,h2:1 --gloo "${cmd[@]}" 2>&1 | grep -v "$NOISE" | tee "$LOGS/$name"
  }
  run "Horovod" "${@}"
  run "hvd_dgc" --dgc --warmup-epochs 4 "${@}"
  python "$REPO/examples/quick_demo.py" summary "$LOGS/Horovod" "$LOGS/hvd_dgc"
}

loopback() {  # the two ranks on this machine: bytes, not speed
  # Loopback is faster than any network DGC is for: measured, hvd_dgc would rightly send
  # dense. Here it assumes a 1 Gbit/s link between the ranks, as between two machines.
  export HVD_DGC_COST_MODEL="${HVD_DGC_COST_MODEL:-assumed}"
  echo "quick demo: 2 ranks on this machine, hvd_dgc's cost model assuming a 1 Gbit/s link" \
       "(HVD_DGC_COST_MODEL=$HVD_DGC_COST_MODEL)"
  run() {  # run NAME FLAGS...: train, show rank 0's lines, keep them for the summary
    local name="$1"; shift
    echo "== $name =="
    horovodrun -np 2 -H localhost:2 --gloo python "$REPO/examples/pytorch_mnist.py" \
      --epochs "${EPOCHS:-10}" --batch-size 32 --no-progress "$@" 2>&1 \
      | grep -v "$NOISE" | tee "$LOGS/$name"
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
  awk -v d="$dense_acc" -v c="$dgc_acc" \
    'BEGIN{printf "  accuracy difference: %+.1f points\n", (c-d)*100}'
}

if why="$(python "$REPO/examples/quick_demo.py" check)"; then
  emulated "$@"
else
  echo "quick demo: no emulated slow link here ($why): the two runs over loopback instead," \
       "which shows bytes sent, not speed"
  loopback "$@"
fi
