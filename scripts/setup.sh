#!/usr/bin/env bash
# Installs everything reshard needs, builds it into build/ and installs the `reshard` package
# editable into .venv (pip install -e ., scikit-build-core over CMake; the C++ tests and benchmarks
# are built too). Idempotent: a second run only rebuilds what changed. Debian 12 or 13 (OpenMPI 4 or 5), Python 3.11 with the local
# torch==2.13.0 CPU wheel.
#   RESHARD_SKIP_APT=1     skip apt-get (packages already there)
#   RESHARD_SETUP_FUZZ=1   also install clang and its libFuzzer runtime (scripts/fuzz.sh)
#   RESHARD_BUILD_TYPE=... CMake build type (default Release)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

APT_PACKAGES=(build-essential cmake pkg-config openmpi-bin libopenmpi-dev libyaml-cpp-dev
  libgtest-dev libgmock-dev libbenchmark-dev nlohmann-json3-dev libsimdjson-dev libcli11-dev libxxhash-dev zlib1g-dev libdeflate-dev
  fortunes-min fortunes)
# libFuzzer needs clang; only scripts/fuzz.sh asks for it.
[[ "${RESHARD_SETUP_FUZZ:-0}" == 1 ]] && APT_PACKAGES+=(clang libclang-rt-dev)

need_apt=0
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need_apt=1
done
if [[ "${RESHARD_SKIP_APT:-0}" != 1 && $need_apt == 1 ]]; then
  echo "[setup] installing Debian packages: ${APT_PACKAGES[*]}"
  SUDO=""; [[ $(id -u) != 0 ]] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${APT_PACKAGES[@]}" >/dev/null
fi

# Python: a venv with the CPU torch first, then everything else with torch pinned.
PY=${RESHARD_PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
VPY=$ROOT/.venv/bin/python
if ! "$VPY" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null; then
  echo "[setup] pip install torch==2.13.0 (CPU, local wheel)"
  "$VPY" -m pip install -q --upgrade pip setuptools wheel
  "$VPY" -m pip install -q torch==2.13.0
fi
# Pin torch so that nothing below can pull another build.
echo "torch==2.13.0" > .venv/constraints.txt
PIP_REQS=(numpy pytest matplotlib pybind11 ninja "cmake<5" pyyaml safetensors psutil tqdm nvidia-nccl-cu13
  "scikit-build-core>=0.10")
if ! "$VPY" -c "import numpy, pytest, matplotlib, pybind11, yaml, safetensors, psutil, tqdm, nvidia.nccl, scikit_build_core" 2>/dev/null; then
  echo "[setup] pip install ${PIP_REQS[*]}"
  "$VPY" -m pip install -q -c .venv/constraints.txt "${PIP_REQS[@]}"
fi
# DeepSpeed (pinned): setup.py imports torch, so no build isolation (which would fetch another torch).
DS_VERSION=0.19.8
if ! "$VPY" -c "import deepspeed, sys; sys.exit(0 if deepspeed.__version__.startswith('$DS_VERSION') else 1)" 2>/dev/null; then
  echo "[setup] pip install deepspeed==$DS_VERSION (no ops built; CPU)"
  DS_BUILD_OPS=0 "$VPY" -m pip install -q --no-build-isolation -c .venv/constraints.txt \
    "deepspeed==$DS_VERSION" || echo "[setup] WARNING: DeepSpeed could not be installed; DeepSpeed-written checkpoints will be skipped"
fi

# DeepSpeed JIT-compiles its CPU shared-memory all-reduce op in the first process that starts a
# distributed engine; build it once here, in one process, instead of inside every rank of the
# first mpirun (where two concurrent compiles on a small machine can run out of memory).
# One build folder per checkout (scripts/test.sh and demo.sh export the same), so that checkouts
# with different venv paths do not rebuild each other's op in ~/.cache.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$ROOT/.venv/torch_extensions}"
if "$VPY" -c "import deepspeed" 2>/dev/null; then
  DS_ACCELERATOR=cpu "$VPY" - <<'PY' >/dev/null 2>&1 || echo "[setup] WARNING: DeepSpeed's CPU comm op did not build here; DeepSpeed runs will build it themselves"
from deepspeed.accelerator import get_accelerator
b = get_accelerator().create_op_builder("ShareMemCommBuilder")
if b is not None:
    b.load()
PY
fi

# Build: `pip install -e .` runs CMake (scikit-build-core) in build/ with the C++ tests and
# benchmarks on, and installs the package editable: `import reshard` and the `reshard` console
# script work from any directory with .venv active; the Python sources are the checkout's.
BUILD_TYPE=${RESHARD_BUILD_TYPE:-Release}
# A build/ configured by hand with another generator cannot be reused by scikit-build-core.
if [[ -f build/CMakeCache.txt ]] && ! grep -q '^CMAKE_GENERATOR:INTERNAL=Ninja$' build/CMakeCache.txt; then
  echo "[setup] build/ was configured with another generator; starting it afresh"
  rm -rf build
fi
# The extension lives in the package now; one a plain CMake build left in the tree would shadow it.
rm -f python/reshard/_C*.so
echo "[setup] building and installing (build/; about 12-14 min from scratch on 2 cores)"
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
"$VPY" -m pip install -q --no-build-isolation --no-deps -c .venv/constraints.txt -e . \
  -Cbuild-dir=build -Ccmake.build-type="$BUILD_TYPE" \
  -Ccmake.define.RESHARD_BUILD_TESTS=ON -Ccmake.define.RESHARD_BUILD_BENCHMARKS=ON
echo "[setup] done"
