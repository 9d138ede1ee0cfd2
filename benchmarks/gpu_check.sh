#!/usr/bin/env bash
# Everything reshard checks on a GPU machine, in one run (docs/gpu.md):
#   1. unpack the build dependencies carried in .gpu_deps/ (Debian 12 .debs: yaml-cpp, gtest,
#      nlohmann-json, simdjson, CLI11, xxhash, pkgconf; the machine has no package index) into a prefix;
#   2. configure + build the CUDA/NCCL targets (reshard_gpu) against the machine's CUDA, NCCL
#      (python3's site-packages nvidia/nccl) and OpenMPI;
#   3. GPU tests: NCCL communicator at world size 1, CUDA targets vs CPU loads, bitwise;
#   4. throughput: synth a >= 8 GB checkpoint (8 ranks), load it 8 -> 1 into CUDA buffers
#      (warm, cold), with the same-run ceilings, and DCP's load into CUDA tensors;
#   5. the Python extension against the machine's torch/libtorch, and reshard.load into CUDA
#      tensors over an NCCL process group against the CPU load (if time is left);
# then prints a short table. A failing step prints its error tail and the script goes on with
# whatever can still run; every step has a timeout. Results under $OUT (./gpu_out if unset):
#   gpu_check.log, build.log, tests.log, gpu_load.json, dcp.json, results.json
#
#   benchmarks/gpu_check.sh           # on the GPU machine (about 6-8 minutes)
#   benchmarks/gpu_check.sh --dry     # anywhere: deps, configure, build; no GPU execution
# Environment: GPU_CHECK_BUDGET (seconds, default 470) stops starting optional steps past it;
# GPU_CHECK_SIZE (default "big": ~9 GB checkpoint; "small": ~1 GB for a quick look).
set -uo pipefail
set -a  # every variable below is exported to the steps' child shells
cd "$(dirname "$0")/.."
ROOT=$(pwd)
DRY=0
[[ "${1:-}" == "--dry" ]] && DRY=1
OUT=${OUT:-$ROOT/gpu_out}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1
T0=$SECONDS
BUDGET=${GPU_CHECK_BUDGET:-470}
declare -a STEP_NAMES STEP_RC STEP_SECS

step() {  # name, timeout_s, command... : runs with a timeout, records the result, never exits
  local name=$1 to=$2; shift 2
  echo
  echo "==== [$((SECONDS - T0)) s] $name (timeout ${to} s)"
  local t=$SECONDS
  # Functions and arrays travel into the child shell; scalars are exported (set -a).
  timeout --kill-after=10 "$to" bash -o pipefail -c "$(declare -p GEN CONF PKGCONF 2>/dev/null); $(declare -f); \"\$@\"" _ "$@"
  local rc=$?
  [[ $rc == 124 || $rc == 137 ]] && echo "==== $name: TIMED OUT after ${to} s"
  echo "==== $name: exit $rc after $((SECONDS - t)) s"
  STEP_NAMES+=("$name"); STEP_RC+=("$rc"); STEP_SECS+=("$((SECONDS - t))")
  return $rc
}
skip() { echo "==== $1: skipped ($2)"; STEP_NAMES+=("$1"); STEP_RC+=("skip"); STEP_SECS+=(0); }
left() { echo $((BUDGET - (SECONDS - T0))); }

# ---- environment ----
PY=${GPU_CHECK_PYTHON:-}
if [[ -z "$PY" ]]; then
  for p in /opt/torch/.venv/bin/python3 "$ROOT/.venv/bin/python" python3; do
    if command -v "$p" >/dev/null 2>&1; then PY=$(command -v "$p"); break; fi
  done
fi
PYBIN=$(dirname "$PY")
export PATH="$PATH:$PYBIN:/usr/local/cuda/bin"
CMAKE=$(command -v cmake || echo "$PYBIN/cmake")
NINJA=$(command -v ninja || true)
GEN=(-G Ninja); [[ -z "$NINJA" ]] && GEN=(-G "Unix Makefiles")
NPROC=$(nproc)
echo "==== environment"
echo "host $(hostname) $(uname -m), $NPROC cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo)"
grep -E '^(PRETTY_NAME)=' /etc/os-release 2>/dev/null
ldd --version 2>/dev/null | head -1
echo "c++: $(c++ --version 2>/dev/null | head -1)"
echo "nvcc: $(nvcc --version 2>/dev/null | tail -1)"
echo "cmake: $("$CMAKE" --version 2>/dev/null | head -1), generator ${GEN[*]}"
echo "python: $PY $("$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1 | tail -1)"
NCCL_DIR=$("$PY" -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null || true)
echo "nccl: ${NCCL_DIR:-not found in python} $(grep -h 'define NCCL_\(MAJOR\|MINOR\|PATCH\)' "$NCCL_DIR/include/nccl.h" 2>/dev/null | awk '{printf "%s ", $3}')"
echo "mpi: $(mpirun --version 2>/dev/null | head -1)"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader 2>/dev/null || echo "nvidia-smi: none"
df -h /tmp "$ROOT" 2>/dev/null | tail -n +2

# ---- 1. carried dependencies ----
PREFIX=${GPU_CHECK_PREFIX:-/tmp/reshard_gpu_deps}
unpack_deps() {
  rm -rf "$PREFIX"; mkdir -p "$PREFIX"
  local n=0
  for deb in "$ROOT"/.gpu_deps/*.deb; do
    [[ -f "$deb" ]] || continue
    if command -v dpkg-deb >/dev/null; then
      dpkg-deb -x "$deb" "$PREFIX" || return 1
    else  # ar + tar fallback
      local tmp; tmp=$(mktemp -d)
      (cd "$tmp" && ar x "$deb" && tar -xf data.tar.* -C "$PREFIX") || return 1
      rm -rf "$tmp"
    fi
    n=$((n + 1))
  done
  [[ $n -gt 0 ]] || { echo "no .deb files in $ROOT/.gpu_deps"; return 1; }
  # pkg-config files name prefix=/usr: point them at the unpacked tree.
  find "$PREFIX" -name '*.pc' -exec sed -i "s|^prefix=/usr\$|prefix=$PREFIX/usr|" {} +
  echo "unpacked $n packages into $PREFIX"
  ls "$PREFIX/usr/lib/x86_64-linux-gnu" | head -30
}
step "unpack carried deps" 60 unpack_deps
LIBDIR=$PREFIX/usr/lib/x86_64-linux-gnu
export LD_LIBRARY_PATH="$LIBDIR${NCCL_DIR:+:$NCCL_DIR/lib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PKG_CONFIG_PATH="$LIBDIR/pkgconfig:$PREFIX/usr/share/pkgconfig"
PKGCONF=()
if ! command -v pkg-config >/dev/null && [[ -x $PREFIX/usr/bin/pkgconf ]]; then
  PKGCONF=(-DPKG_CONFIG_EXECUTABLE="$PREFIX/usr/bin/pkgconf")
fi
# gtest from the carried prebuilt archive needs a C++ library at least as new as Debian 12's
# (GCC 12); older compilers build it from the carried googletest source.
GTEST_PREFIX=$PREFIX/usr
build_gtest() {
  local src=$PREFIX/usr/src/googletest
  [[ -d $src ]] || { echo "no googletest source carried"; return 1; }
  "$CMAKE" -S "$src" -B /tmp/reshard_gtest_build "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_INSTALL_PREFIX=/tmp/reshard_gtest -DBUILD_GMOCK=OFF -DCMAKE_POSITION_INDEPENDENT_CODE=ON >/dev/null &&
    "$CMAKE" --build /tmp/reshard_gtest_build -j"$NPROC" >/dev/null && "$CMAKE" --install /tmp/reshard_gtest_build >/dev/null
}
GCC_MAJOR=$(c++ -dumpversion 2>/dev/null | cut -d. -f1)
if [[ -n "$GCC_MAJOR" && "$GCC_MAJOR" -lt 12 ]]; then
  step "gtest from source (c++ $GCC_MAJOR < 12)" 120 build_gtest && GTEST_PREFIX=/tmp/reshard_gtest
fi

# ---- 2. configure + build ----
BUILD=${GPU_CHECK_BUILD:-$ROOT/build-gpucheck}
CONF=("$CMAKE" -S "$ROOT" -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release
  -DCMAKE_PREFIX_PATH="$GTEST_PREFIX;$PREFIX/usr" -DCMAKE_CUDA_ARCHITECTURES=90
  -DPython_EXECUTABLE="$PY" -DRESHARD_BUILD_PYTHON=OFF -DRESHARD_BUILD_BENCHMARKS=OFF
  -DRESHARD_WITH_NCCL=ON "${PKGCONF[@]}")
build_all() {
  "${CONF[@]}" > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; return 1; }
  grep -E "reshard:|Found (GTest|MPI|CUDAToolkit|nlohmann|PkgConfig)|libxxhash" "$OUT/build.log"
  grep -E '^(yaml-cpp_DIR|GTest_DIR|nlohmann_json_DIR|simdjson_DIR|CLI11_DIR|RESHARD_NCCL_LIBRARY)' "$BUILD/CMakeCache.txt"
  "$CMAKE" --build "$BUILD" --target reshard_gpu -j"$NPROC" >> "$OUT/build.log" 2>&1 ||
    { grep -E "error|Error|FAILED" "$OUT/build.log" | head -30; tail -30 "$OUT/build.log"; return 1; }
  ls -la "$BUILD/bin"
}
step "configure + build reshard_gpu" 300 build_all
BIN=$BUILD/bin

if [[ $DRY == 1 ]]; then
  echo; echo "dry run: no GPU execution"
  for t in nccl_comm_test cuda_load_test gpu_load; do [[ -x $BIN/$t ]] && echo "built: $t" || echo "MISSING: $t"; done
  bash -n "$0" && echo "script syntax ok"
  "$PY" -m py_compile "$ROOT/benchmarks/gpu_bench.py" && echo "gpu_bench.py compiles"
  printf '\n%-40s %s\n' step result; for i in "${!STEP_NAMES[@]}"; do printf '%-40s %s (%s s)\n' "${STEP_NAMES[$i]}" "${STEP_RC[$i]}" "${STEP_SECS[$i]}"; done
  exit 0
fi

# ---- 3. GPU tests ----
run_tests() {
  local rc=0
  for t in nccl_comm_test cuda_load_test; do
    if [[ ! -x $BIN/$t ]]; then echo "$t not built"; rc=1; continue; fi
    echo "---- $t"
    timeout 150 "$BIN/$t" --gtest_color=no > "$OUT/$t.out" 2>&1
    local trc=$?
    grep -vE '^\[ *(RUN|OK) *\]' "$OUT/$t.out" | tail -60
    cat "$OUT/$t.out" >> "$OUT/tests.log"; rm -f "$OUT/$t.out"
    [[ $trc == 0 ]] || { echo "$t: exit $trc"; rc=1; }
  done
  return $rc
}
rm -f "$OUT/tests.log"
step "GPU tests" 300 run_tests

# ---- 4. throughput ----
WORK=${GPU_CHECK_WORK:-/tmp/reshard_gpu_bench}
CKPT=$WORK/ckpt
if [[ "${GPU_CHECK_SIZE:-big}" == small ]]; then
  SYNTH_ARGS=(--hidden 1024 --ffn 2816 --layers 8 --heads 16 --groups 16 --vocab 32000)
else  # 10 layers, hidden 2048, SwiGLU 5632, vocab 32000: ~0.65 B params x 14 B = ~9 GB
  SYNTH_ARGS=(--hidden 2048 --ffn 5632 --layers 10 --heads 16 --groups 16 --vocab 32000)
fi
if [[ -x $BIN/gpu_load ]]; then
  rm -rf "$WORK"; mkdir -p "$WORK"
  step "synth checkpoint (tp=2,pp=2,dp=2,zero=1)" 180 "$BIN/gpu_load" synth "$CKPT" "${SYNTH_ARGS[@]}" --topo tp=2,pp=2,dp=2,zero=1
  du -sh "$CKPT" 2>/dev/null
  step "reshard into CUDA + ceilings (8 -> 1)" 240 "$BIN/gpu_load" run "$CKPT" --target tp=1,dp=1,zero=1 \
    --repeats 3 --threads 16 --sources pread,mmap --cold --json "$OUT/gpu_load.json"
else
  skip "reshard into CUDA + ceilings" "gpu_load not built"
fi
STEP_DIR=$(ls -d "$CKPT"/step-* 2>/dev/null | head -1)
if [[ -n "$STEP_DIR" && $(left) -gt 60 ]]; then
  step "DCP save + load into CUDA" "$(( $(left) < 200 ? $(left) : 200 ))" env PYTHONUNBUFFERED=1 "$PY" "$ROOT/benchmarks/gpu_bench.py" dcp "$STEP_DIR" \
    --work "$WORK" --out "$OUT/dcp.json" --repeats 2
else
  skip "DCP save + load into CUDA" "no checkpoint or out of time ($(left) s left)"
fi
rm -rf "$WORK"

# ---- 5. Python extension against the machine's torch (optional) ----
build_python() {
  local tc pb
  tc=$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)') || return 1
  pb=$("$PY" -c 'import pybind11; print(pybind11.get_cmake_dir())') || return 1
  "$CMAKE" -S "$ROOT" -B "$BUILD-py" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$tc;$pb;$GTEST_PREFIX;$PREFIX/usr" -DPython_EXECUTABLE="$PY" \
    -DRESHARD_BUILD_PYTHON=ON -DRESHARD_BUILD_TESTS=OFF -DRESHARD_BUILD_BENCHMARKS=OFF -DRESHARD_WITH_NCCL=OFF \
    "${PKGCONF[@]}" > "$OUT/build_py.log" 2>&1 || { tail -30 "$OUT/build_py.log"; return 1; }
  "$CMAKE" --build "$BUILD-py" --target reshard_python -j"$NPROC" >> "$OUT/build_py.log" 2>&1 ||
    { grep -E "error|FAILED" "$OUT/build_py.log" | head -20; return 1; }
  PYTHONPATH="$ROOT/python" "$PY" -c 'import reshard, torch; print("import reshard ok with torch", torch.__version__)' || return 1
  # reshard.load into CUDA tensors over an NCCL process group == the CPU load (tests/gpu).
  PYTHONPATH="$ROOT/python" timeout 120 "$PY" "$ROOT/tests/gpu/python_cuda_check.py"
}
if [[ $(left) -gt 90 ]]; then
  step "Python extension vs machine torch" "$(( $(left) < 180 ? $(left) : 180 ))" build_python
else
  skip "Python extension vs machine torch" "out of time ($(left) s left)"
fi

# ---- summary ----
echo
echo "==== steps"
for i in "${!STEP_NAMES[@]}"; do printf '  %-42s %-6s %4s s\n' "${STEP_NAMES[$i]}" "${STEP_RC[$i]}" "${STEP_SECS[$i]}"; done
grep -E '^\[  (PASSED|FAILED) +\]|tests? ran|FAILED TEST' "$OUT/tests.log" 2>/dev/null | sed 's/^/  /'
"$PY" "$ROOT/benchmarks/gpu_bench.py" table --reshard "$OUT/gpu_load.json" --dcp "$OUT/dcp.json" --out "$OUT/results.json" ||
  echo "(no throughput table)"
echo "total $((SECONDS - T0)) s"
