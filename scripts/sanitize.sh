#!/usr/bin/env bash
# ASan + UBSan build of the pure core and the parsers (no libtorch, no MPI, no YAML) and their
# tests: tests/unit/core_*_test.cc and tests/unit/parse_*_test.cc. Any sanitizer report aborts the
# test (-fno-sanitize-recover=all), so a clean run is "100% tests passed".
#
#   scripts/sanitize.sh            configure build-asan, build, ctest
#   BUILD_DIR=... JOBS=... CC=... CXX=...   to override (default: build-asan, nproc, the system cc/c++)
#
# Needs only cmake, ninja, a C++17 compiler with ASan/UBSan (gcc 12 or clang 14 here), GTest,
# nlohmann-json and libxxhash (scripts/setup.sh installs them).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
BUILD_DIR=${BUILD_DIR:-build-asan}
JOBS=${JOBS:-$(nproc)}
CMAKE=${CMAKE:-$( [[ -x .venv/bin/cmake ]] && echo "$ROOT/.venv/bin/cmake" || command -v cmake )}
NINJA=${NINJA:-$( [[ -x .venv/bin/ninja ]] && echo "$ROOT/.venv/bin/ninja" || command -v ninja )}
CTEST=${CTEST:-$(dirname "$CMAKE")/ctest}
[[ -x $CTEST ]] || CTEST=ctest

GEN=(-G Ninja -DCMAKE_MAKE_PROGRAM="$NINJA")
[[ -n $NINJA ]] || GEN=(-G "Unix Makefiles")
"$CMAKE" -S . -B "$BUILD_DIR" "${GEN[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DRESHARD_CORE_ONLY=ON -DRESHARD_SANITIZE=ON -DRESHARD_BUILD_TESTS=ON -DRESHARD_FUZZ=OFF >/dev/null
"$CMAKE" --build "$BUILD_DIR" -j"$JOBS"
# halt_on_error + abort: a report fails the test; detect_leaks: LeakSanitizer on exit.
export ASAN_OPTIONS=${ASAN_OPTIONS:-halt_on_error=1:abort_on_error=1:detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
"$CTEST" --test-dir "$BUILD_DIR" --output-on-failure -j"$JOBS" --timeout 900
