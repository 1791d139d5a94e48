#!/usr/bin/env bash
# Build Horovod 0.28.1 with NCCL (HOROVOD_GPU_OPERATIONS=NCCL) for the PyTorch side of
# hvd_dgc on a GPU machine, as a wheel, and install it into the Python that holds a CUDA
# build of torch. The CPU set-up (tools/install.sh) stays as it is; this is the GPU
# user's one extra command:
#
#   bash tools/build_horovod_gpu.sh                 # build, cache, install, check
#
# Verified on an NVIDIA H100 (Python 3.12, torch 2.11.0+cu130, CUDA 13.0, GCC 13.3, the
# nvidia-nccl-cu13 wheel's NCCL 2.28.9, Open MPI found: MPI controller built too): 2 min 20 s
# on 16 cores, then tools/test_gpu.sh passed (see README, "On GPUs"). Horovod's setup.py
# needs cffi at build time: pip fetches it, or install it first on a machine without PyPI.
#
# What Horovod 0.28.1 needs changed to build there (the sdist is patched, never copied):
#   1. the C++ standard torch's headers need (C++17 for torch 2.1-2.13, C++20 from 2.14:
#      what torch.utils.cpp_extension compiles with) for gloo, the core and the torch glue,
#      which must agree;
#   2. C++17 for Horovod's CUDA kernels (CUDA 13's headers dropped C++11);
#   3. NCCL linked as a shared library when it comes from the pip wheel, which ships
#      libnccl.so.2 only (a libnccl.so link is made in a scratch folder for the linker);
#   4. with GCC >= 13, <string>, <cstdint> and <cstdio> included up front: Horovod's
#      headers (group_table.h, ...) relied on older libstdc++ pulling them in.
#
# Environment knobs:
#   PYTHON=python3          the Python whose torch (with CUDA) Horovod builds against
#   HOROVOD_SDIST=path      horovod-0.28.1.tar.gz (default: pip download, needs PyPI)
#   CUDA_CC=90              compute capabilities to build for, comma separated (default: the
#                           visible GPUs', else every one nvcc supports: a slower build)
#   HOROVOD_NCCL_HOME=dir   an NCCL with include/ and lib/ (default: the nvidia-nccl wheel
#                           next to torch, else the system's)
#   HVD_DGC_CACHE=dir       wheel cache (default ~/.cache/hvd_dgc); WHEEL_ONLY=1 skips install
#   WITH_MPI=0|1            build the MPI controller too (default: 1 if mpicc is found)
set -euo pipefail

PYTHON="${PYTHON:-python3}"
HOROVOD_VERSION=0.28.1
PATCH_REV=1
CACHE="${HVD_DGC_CACHE:-$HOME/.cache/hvd_dgc}"

STEP=start
step() { STEP="$*"; printf '\n==> [horovod-gpu] %s\n' "$*"; }
trap 'rc=$?; [ $rc -ne 0 ] && printf "\n!!! [horovod-gpu] FAILED at step: %s (exit %d)\n" "$STEP" "$rc" >&2' EXIT
die() { echo "!!! [horovod-gpu] $*" >&2; exit 1; }

step "toolchain"
read -r TORCH_VERSION TORCH_CUDA < <("$PYTHON" -c \
  'import torch; print(torch.__version__.split("+")[0], torch.version.cuda or "none")')
[ "$TORCH_CUDA" != none ] || die "$PYTHON's torch $TORCH_VERSION has no CUDA: install a CUDA build of torch first (this script builds Horovod's NCCL operations against it)"
# The toolkit: the first of $CUDA_HOME, $CUDA_PATH, /usr/local/cuda and nvcc's own folder
# that has both bin/nvcc and include/cuda_runtime.h (an nvcc on PATH may be a wrapper).
CUDA_HOME_DIR=""
NVCC_ON_PATH="$(command -v nvcc || true)"
for d in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda \
         ${NVCC_ON_PATH:+"$(dirname "$(readlink -f "$NVCC_ON_PATH")")/.."}; do
  if [ -n "$d" ] && [ -x "$d/bin/nvcc" ] && [ -f "$d/include/cuda_runtime.h" ]; then
    CUDA_HOME_DIR="$(cd "$d" && pwd -P)"; break
  fi
done
[ -n "$CUDA_HOME_DIR" ] || die "no CUDA toolkit found (bin/nvcc + include/cuda_runtime.h) in \$CUDA_HOME, \$CUDA_PATH, /usr/local/cuda or beside nvcc: install the CUDA toolkit matching torch's CUDA $TORCH_CUDA and set CUDA_HOME"
NVCC="$CUDA_HOME_DIR/bin/nvcc"
command -v cmake >/dev/null || die "cmake not found: pip install cmake (or apt-get install cmake)"
echo "python: $("$PYTHON" --version 2>&1)  torch $TORCH_VERSION (CUDA $TORCH_CUDA)"
echo "nvcc:   $("$NVCC" --version | tail -1) ($CUDA_HOME_DIR)"
echo "cmake:  $(cmake --version | head -1)   g++: $(g++ -dumpfullversion 2>/dev/null || echo none)"
CXX_STD="$("$PYTHON" -c 'import inspect, torch.utils.cpp_extension as c
print(20 if "-std=c++20" in inspect.getsource(c) else 17)')"
echo "C++ standard for torch's headers: C++$CXX_STD"

if [ -z "${CUDA_CC:-}" ]; then
  CUDA_CC="$("$PYTHON" -c 'import torch
caps = sorted({"%d%d" % torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
print(",".join(caps))' 2>/dev/null || true)"
fi
echo "compute capabilities: ${CUDA_CC:-all that nvcc supports}"

step "NCCL"
if [ -z "${HOROVOD_NCCL_HOME:-}" ]; then
  NCCL_DIR="$("$PYTHON" -c 'import os, nvidia.nccl as m; print(os.path.dirname(m.__file__) if m.__file__ else list(m.__path__)[0])' 2>/dev/null || true)"
  if [ -n "$NCCL_DIR" ] && [ -f "$NCCL_DIR/include/nccl.h" ]; then
    HOROVOD_NCCL_HOME="$NCCL_DIR"
  elif [ -f /usr/include/nccl.h ]; then
    HOROVOD_NCCL_HOME=/usr
  else
    die "NCCL not found: pip install nvidia-nccl-cu${TORCH_CUDA%%.*} (torch's own), or apt-get install libnccl-dev, or set HOROVOD_NCCL_HOME"
  fi
fi
NCCL_INC="$HOROVOD_NCCL_HOME/include"
NCCL_LIBDIR=""
for d in "$HOROVOD_NCCL_HOME/lib" "$HOROVOD_NCCL_HOME/lib64" "$HOROVOD_NCCL_HOME/lib/x86_64-linux-gnu"; do
  if compgen -G "$d/libnccl.so*" >/dev/null; then NCCL_LIBDIR="$d"; break; fi
done
[ -n "$NCCL_LIBDIR" ] || die "no libnccl.so* under $HOROVOD_NCCL_HOME/lib*"
NCCL_VERSION="$(awk '/#define NCCL_(MAJOR|MINOR|PATCH)[ \t]/ {printf "%s.", $3}' "$NCCL_INC/nccl.h" | sed 's/\.$//')"
echo "NCCL $NCCL_VERSION: $NCCL_INC, $NCCL_LIBDIR"

PYTAG="$("$PYTHON" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
KEY="horovod-${HOROVOD_VERSION}-nccl${NCCL_VERSION}_torch-${TORCH_VERSION}-cu${TORCH_CUDA}_cc${CUDA_CC:-all}_cxx${CXX_STD}_${PYTAG}_$(uname -m)_patch${PATCH_REV}"
KEY="${KEY//,/-}"
WHEEL_DIR="$CACHE/$KEY"

if compgen -G "$WHEEL_DIR/horovod-*.whl" >/dev/null; then
  step "Horovod wheel found in cache: $WHEEL_DIR"
else
  step "build Horovod $HOROVOD_VERSION with NCCL -> $WHEEL_DIR"
  BUILD="$(mktemp -d)"
  trap 'rm -rf "$BUILD"' RETURN 2>/dev/null || true
  if [ -n "${HOROVOD_SDIST:-}" ]; then
    cp "$HOROVOD_SDIST" "$BUILD/"
  else
    "$PYTHON" -m pip download -q --no-deps --no-binary :all: -d "$BUILD" "horovod==$HOROVOD_VERSION"
  fi
  tar -xzf "$BUILD"/horovod-$HOROVOD_VERSION.tar.gz -C "$BUILD"
  SRC="$BUILD/horovod-$HOROVOD_VERSION"
  sed -i "s/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD $CXX_STD)/" \
    "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"
  sed -i 's/set(CMAKE_CUDA_STANDARD 11)/set(CMAKE_CUDA_STANDARD 17)/' \
    "$SRC/horovod/common/ops/cuda/CMakeLists.txt"
  grep -q "set(CMAKE_CXX_STANDARD $CXX_STD)" "$SRC/CMakeLists.txt"
  grep -q "set(CMAKE_CXX_STANDARD $CXX_STD)" "$SRC/horovod/torch/CMakeLists.txt"
  grep -q 'set(CMAKE_CUDA_STANDARD 17)' "$SRC/horovod/common/ops/cuda/CMakeLists.txt"
  # The wheel ships libnccl.so.2 only; the linker looks for libnccl.so.
  LINKDIR="$BUILD/nccl-lib"
  mkdir -p "$LINKDIR"
  ln -sf "$(ls "$NCCL_LIBDIR"/libnccl.so* | sort | tail -1)" "$LINKDIR/libnccl.so"
  if [ -z "${WITH_MPI:-}" ]; then
    if command -v mpicc >/dev/null; then WITH_MPI=1; else WITH_MPI=0; fi
  fi
  if [ "$WITH_MPI" = 1 ]; then MPI_FLAG=HOROVOD_WITH_MPI=1; else MPI_FLAG=HOROVOD_WITHOUT_MPI=1; fi
  echo "MPI controller: $([ "$WITH_MPI" = 1 ] && echo yes || echo 'no (Gloo only)')"
  mkdir -p "$WHEEL_DIR.tmp"
  env PATH="$CUDA_HOME_DIR/bin:$PATH" CMAKE_POLICY_VERSION_MINIMUM=3.5 \
      CXXFLAGS="-include string -include cstdint -include cstdio ${CXXFLAGS:-}" \
      HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_LINK=SHARED \
      HOROVOD_NCCL_INCLUDE="$NCCL_INC" HOROVOD_NCCL_LIB="$LINKDIR" \
      HOROVOD_CUDA_HOME="$CUDA_HOME_DIR" ${CUDA_CC:+HOROVOD_BUILD_CUDA_CC_LIST=$CUDA_CC} \
      HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
      HOROVOD_WITH_GLOO=1 "$MPI_FLAG" MAKEFLAGS="-j$(nproc)" \
    "$PYTHON" -m pip wheel -v --no-build-isolation --no-deps --no-cache-dir \
      -w "$WHEEL_DIR.tmp" "$SRC"
  rm -rf "$WHEEL_DIR"
  mv "$WHEEL_DIR.tmp" "$WHEEL_DIR"
  rm -rf "$BUILD"
fi
ls -la "$WHEEL_DIR"

if [ "${WHEEL_ONLY:-0}" = 1 ]; then
  echo "WHEEL_ONLY=1: not installing"
  exit 0
fi

step "install the wheel"
"$PYTHON" -m pip install -q --no-deps --force-reinstall "$WHEEL_DIR"/horovod-*.whl

step "check: Horovod sees NCCL"
"$PYTHON" - <<'EOF'
import horovod.torch as hvd
built = {"nccl": hvd.nccl_built(), "gloo": hvd.gloo_built(), "mpi": hvd.mpi_built(),
         "cuda": hvd.cuda_built()}
print("horovod.torch:", built)
assert built["nccl"] and built["cuda"] and built["gloo"], built
EOF
STEP=done
echo "==> [horovod-gpu] done: $WHEEL_DIR"
