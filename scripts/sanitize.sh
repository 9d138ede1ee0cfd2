#!/usr/bin/env bash
# ASan + UBSan builds and their tests. Any sanitizer report aborts the test
# (-fno-sanitize-recover=all), so a clean run is "100% tests passed" and pytest's "passed".
#
#   scripts/sanitize.sh          both stages below
#   SCOPE=core scripts/sanitize.sh   stage 1 only
#
# Stage 1 (build-asan): the pure core and the parsers (no libtorch, MPI or YAML):
#   tests/unit/core_*_test.cc and tests/unit/parse_*_test.cc.
# Stage 2 (build-asan-full): the whole C++ library without Python, MPI or CUDA: the readers, the
#   executor, the native writer, the YAML model and resume-config loading (yaml-cpp) and the CLI;
#   every C++ unit test, then the CLI's Python tests (tests/python/test_cli*.py,
#   test_reliability_faults.py) with RESHARD_CLI pointing at the sanitized `reshard` binary, so
#   every CLI path those tests take (synth, inspect, verify, plan, convert, diff, bad inputs,
#   bad YAML files, concurrent writers) runs under ASan + UBSan.
#   BUILD_DIR=... FULL_BUILD_DIR=... JOBS=... CC=... CXX=...   to override
#
# Needs cmake, ninja, a C++17 compiler with ASan/UBSan (gcc 12 or clang 14 here), and the
# libraries scripts/setup.sh installs; stage 2 also the .venv (pytest, torch).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
SCOPE=${SCOPE:-full}
BUILD_DIR=${BUILD_DIR:-build-asan}
FULL_BUILD_DIR=${FULL_BUILD_DIR:-build-asan-full}
JOBS=${JOBS:-$(nproc)}
CMAKE=${CMAKE:-$( [[ -x .venv/bin/cmake ]] && echo "$ROOT/.venv/bin/cmake" || command -v cmake )}
NINJA=${NINJA:-$( [[ -x .venv/bin/ninja ]] && echo "$ROOT/.venv/bin/ninja" || command -v ninja )}
CTEST=${CTEST:-$(dirname "$CMAKE")/ctest}
[[ -x $CTEST ]] || CTEST=ctest

GEN=(-G Ninja -DCMAKE_MAKE_PROGRAM="$NINJA")
[[ -n $NINJA ]] || GEN=(-G "Unix Makefiles")
# halt_on_error + abort: a report fails the test; detect_leaks: LeakSanitizer on exit.
export ASAN_OPTIONS=${ASAN_OPTIONS:-halt_on_error=1:abort_on_error=1:detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}

echo "==== sanitize stage 1: core and parsers ($BUILD_DIR)"
"$CMAKE" -S . -B "$BUILD_DIR" "${GEN[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DRESHARD_CORE_ONLY=ON -DRESHARD_SANITIZE=ON -DRESHARD_BUILD_TESTS=ON -DRESHARD_FUZZ=OFF >/dev/null
"$CMAKE" --build "$BUILD_DIR" -j"$JOBS"
"$CTEST" --test-dir "$BUILD_DIR" --output-on-failure -j"$JOBS" --timeout 900
[[ $SCOPE == core ]] && exit 0

echo "==== sanitize stage 2: library, writer, YAML and CLI ($FULL_BUILD_DIR)"
"$CMAKE" -S . -B "$FULL_BUILD_DIR" "${GEN[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DRESHARD_SANITIZE=ON -DRESHARD_BUILD_TESTS=ON -DRESHARD_FUZZ=OFF -DRESHARD_BUILD_PYTHON=OFF \
  -DRESHARD_WITH_MPI=OFF -DRESHARD_WITH_NCCL=OFF -DRESHARD_BUILD_BENCHMARKS=OFF >/dev/null
"$CMAKE" --build "$FULL_BUILD_DIR" -j"$JOBS"
"$CTEST" --test-dir "$FULL_BUILD_DIR" --output-on-failure -j"$JOBS" --timeout 1800
# The CLI under the sanitizers, through the tests that drive it. The Python package these tests
# import is the regular build's (libtorch is not sanitized); only the CLI binary changes.
export RESHARD_CLI="$ROOT/$FULL_BUILD_DIR/bin/reshard"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
"$ROOT/.venv/bin/python" -m pytest -q -p no:cacheprovider -m "not slow" \
  tests/python/test_cli.py tests/python/test_cli_inspect.py tests/python/test_cli_verify.py \
  tests/python/test_cli_roundtrip.py tests/python/test_cli_diff.py tests/python/test_cli_writers_and_sizes.py \
  tests/python/test_reliability_faults.py
