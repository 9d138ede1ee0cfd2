#!/usr/bin/env bash
# Runs every test: C++ unit tests (ctest), MPI tests under mpirun (K = 1..8 ranks), the DeepSpeed
# fixture generation, and the Python tests (pytest). Sets everything up first if needed.
#   RESHARD_TEST_QUICK=1   skip the slow Python tests marked `slow`
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || { echo "setup failed"; exit 2; }
source scripts/job_env.sh

declare -a NAMES RESULTS
run_suite() {  # name, command...
  local name=$1; shift
  echo "==== $name: $*"
  local t0=$SECONDS
  "$@"
  local rc=$?
  echo "==== $name: exit $rc after $((SECONDS - t0)) s"
  NAMES+=("$name"); RESULTS+=("$rc")
}

if [[ -x tests/fixtures/make_deepspeed_fixtures.sh ]]; then
  run_suite "DeepSpeed fixtures" bash tests/fixtures/make_deepspeed_fixtures.sh
fi
run_suite "C++ unit (ctest)" ctest --test-dir build --output-on-failure -j2 --timeout 900
# The GPU code (NCCL communicator, CUDA targets) must compile and link where the CUDA toolkit is,
# even without a GPU; it runs on a GPU machine through benchmarks/gpu_check.sh.
if [[ -x /usr/local/cuda/bin/nvcc ]]; then
  run_suite "CUDA/NCCL compile-only" .venv/bin/cmake --build build --target reshard_gpu
fi
if compgen -G "build/bin/*_test" >/dev/null && [[ -x tests/mpi/run.sh ]] && ls build/bin | grep -q '^comm_test$'; then
  run_suite "MPI (mpirun -np 1..8)" bash tests/mpi/run.sh build
fi
PYTEST_ARGS=(-q -rs -p no:cacheprovider tests/python)
[[ "${RESHARD_TEST_QUICK:-0}" == 1 ]] && PYTEST_ARGS+=(-m "not slow")
run_suite "Python (pytest)" .venv/bin/python -m pytest "${PYTEST_ARGS[@]}"

passed=0; failed=0
echo
echo "Summary:"
for i in "${!NAMES[@]}"; do
  if [[ ${RESULTS[$i]} == 0 ]]; then passed=$((passed + 1)); s=ok; else failed=$((failed + 1)); s="FAILED (exit ${RESULTS[$i]})"; fi
  printf '  %-28s %s\n' "${NAMES[$i]}" "$s"
done
echo "suites: $passed passed, $failed failed"
[[ $failed == 0 ]]
