#!/usr/bin/env bash
# One-command set-up of hvd_dgc on a fresh Debian 12 machine (run as root or
# with sudo available):
#   system packages -> virtual environment -> torch (CPU) + TensorFlow (CPU)
#   -> Horovod 0.28.1 built from its sdist (patched for torch 2.x / TF 2.21),
#   cached as a wheel -> hvd_dgc (editable) -> build check -> quick demo.
#
# Environment knobs:
#   VENV=path            virtual environment (default: <repo>/.venv)
#   HVD_DGC_CACHE=path   where the built Horovod wheel is cached
#                        (default: ~/.cache/hvd_dgc); a second run reuses it.
#   HVD_DGC_SKIP_DEMO=1  do not run the 2-rank demo at the end (examples/quick_demo.sh).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$REPO/.venv}"
CACHE="${HVD_DGC_CACHE:-$HOME/.cache/hvd_dgc}"
PYTHON="${PYTHON:-python3}"

TORCH_VERSION=2.13.0
# Newest TensorFlow with which the Horovod 0.28.1 TF build was verified to work
# (needs the three build changes below); tf-keras gives the Keras 2 path.
TF_VERSION=2.21.0
TF_KERAS_VERSION=2.21.0
HOROVOD_VERSION=0.28.1
# Bump when the patch applied to the Horovod sdist changes: it is part of the
# cache key, so a stale wheel is never reused.
PATCH_REV=1

STEP="start"
step() { STEP="$*"; printf '\n==> [install] %s\n' "$*"; }
trap 'rc=$?; [ $rc -ne 0 ] && printf "\n!!! [install] FAILED at step: %s (exit %d)\n" "$STEP" "$rc" >&2' EXIT

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

step "Debian packages (Open MPI, build tools, TF headers Horovod needs, ssh for emulated hosts)"
APT_PKGS=(openmpi-bin libopenmpi-dev g++ make cmake python3-dev python3-venv
          libhighwayhash-dev libfarmhash-dev iproute2 procps openssh-server openssh-client)
missing=()
for p in "${APT_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
else
  echo "all present: ${APT_PKGS[*]}"
fi

step "virtual environment at $VENV"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check)
"$PY" --version

step "Python packages: torch==$TORCH_VERSION (CPU), tensorflow-cpu==$TF_VERSION, tf-keras, test/demo deps"
# Pin torch exactly: a bare 'torch' resolves to a multi-GB CUDA build.
"${PIP[@]}" install -q \
  "torch==$TORCH_VERSION" "tensorflow-cpu==$TF_VERSION" "tf-keras==$TF_KERAS_VERSION" \
  "numpy" "mpi4py" "pytest" "pytest-timeout" "scikit-learn" "matplotlib" "pyyaml" \
  "tqdm" "psutil" "cloudpickle" "packaging" "setuptools" "wheel" "cffi"

PYTAG="$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
KEY="horovod-${HOROVOD_VERSION}_torch-${TORCH_VERSION}_tf-${TF_VERSION}_${PYTAG}_$(uname -m)_patch${PATCH_REV}"
WHEEL_DIR="$CACHE/$KEY"

if ! compgen -G "$WHEEL_DIR/horovod-*.whl" >/dev/null; then
  step "build Horovod $HOROVOD_VERSION wheel (PyTorch + TensorFlow + Gloo + MPI; ~5 min) -> $WHEEL_DIR"
  BUILD="$(mktemp -d)"
  "${PIP[@]}" download -q --no-deps --no-binary :all: -d "$BUILD" "horovod==$HOROVOD_VERSION"
  tar -xzf "$BUILD/horovod-$HOROVOD_VERSION.tar.gz" -C "$BUILD"
  SRC="$BUILD/horovod-$HOROVOD_VERSION"
  # 1. torch >= 2.1 headers need C++17; gloo and the torch glue must agree,
  #    so both the top-level and the torch CMakeLists change.
  sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
    "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"
  grep -q 'set(CMAKE_CXX_STANDARD 17)' "$SRC/CMakeLists.txt"
  grep -q 'set(CMAKE_CXX_STANDARD 17)' "$SRC/horovod/torch/CMakeLists.txt"
  # 2. XLA ops include tensorflow/compiler/xla headers that moved in new TF;
  #    they only matter for GPU XLA.
  sed -i '/xla_mpi_ops.cc/d' "$SRC/horovod/tensorflow/CMakeLists.txt"
  ! grep -q 'xla_mpi_ops.cc' "$SRC/horovod/tensorflow/CMakeLists.txt"
  mkdir -p "$WHEEL_DIR.tmp"
  HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 \
  HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_MXNET=1 \
  MAKEFLAGS="-j$(nproc)" \
    "${PIP[@]}" wheel --no-build-isolation --no-deps --no-cache-dir \
      -w "$WHEEL_DIR.tmp" "$SRC"
  rm -rf "$WHEEL_DIR"; mv "$WHEEL_DIR.tmp" "$WHEEL_DIR"
  rm -rf "$BUILD"
else
  step "Horovod wheel found in cache: $WHEEL_DIR"
fi

step "install Horovod wheel"
"${PIP[@]}" install -q --no-deps --force-reinstall "$WHEEL_DIR"/horovod-*.whl
# Horovod's own runtime deps (not pulled above because of --no-deps).
"${PIP[@]}" install -q cloudpickle psutil pyyaml packaging cffi

step "install hvd_dgc (editable)"
"${PIP[@]}" install -q --no-deps --no-build-isolation -e "$REPO"
# The optional fused C++ kernel (hvd_dgc/torch/csrc) is built in place against the
# installed torch; setuptools' editable install builds in isolation, without torch.
(cd "$REPO" && "$PY" setup.py -q build_ext --inplace)

step "horovodrun --check-build"
TF_CPP_MIN_LOG_LEVEL=3 "$VENV/bin/horovodrun" --check-build | tee /tmp/hvd_dgc_check_build.txt
for fw in TensorFlow PyTorch; do
  grep -q "\[X\] $fw" /tmp/hvd_dgc_check_build.txt || { echo "Horovod lacks $fw" >&2; exit 1; }
done
for c in MPI Gloo; do
  grep -q "\[X\] $c" /tmp/hvd_dgc_check_build.txt || { echo "Horovod lacks controller $c" >&2; exit 1; }
done

step "python -m hvd_dgc.info"
TF_CPP_MIN_LOG_LEVEL=3 "$PY" -m hvd_dgc.info

if [ "${HVD_DGC_SKIP_DEMO:-0}" != "1" ] && [ -f "$REPO/examples/quick_demo.sh" ]; then
  step "quick demo: Horovod and hvd_dgc over an emulated 50 Mbit/s link (2-3 minutes)"
  bash "$REPO/examples/quick_demo.sh"
fi

STEP="done"
printf '\n==> [install] done. Activate with: source %s/bin/activate\n' "$VENV"
