#!/usr/bin/env bash
# Builds the libFuzzer targets (clang + ASan + UBSan), writes the seed corpora from real files,
# and runs each target for a while. Crashes/timeouts/OOMs land in $OUT/artifacts/<target>/.
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]     default 600 s; targets fuzz_zip fuzz_pickle
#                                             fuzz_safetensors fuzz_metadata
#   PARALLEL=2   targets run at once (one core each); OUT=fuzz_out   corpora, logs, artifacts
#
# Needs clang and its libFuzzer runtime, the .venv with torch (zip/pickle seeds) and the reshard
# Python extension (safetensors/metadata seeds: synth checkpoints). Where clang or the extension
# is missing it runs the setup first with RESHARD_SETUP_FUZZ=1, which adds Debian's clang and
# libclang-rt-dev to the packages it installs.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
need_setup=0
command -v "${CXX:-clang++}" >/dev/null || need_setup=1
compgen -G "python/reshard/_C*.so" >/dev/null || need_setup=1
if [[ $need_setup == 1 ]]; then
  RESHARD_SETUP_FUZZ=1 bash scripts/setup.sh || { echo "fuzz: setup failed"; exit 2; }
fi
SECS=${1:-600}
shift || true
TARGETS=("$@")
[[ ${#TARGETS[@]} -gt 0 ]] || TARGETS=(fuzz_zip fuzz_pickle fuzz_safetensors fuzz_metadata)
BUILD_DIR=${BUILD_DIR:-build-fuzz}
OUT=${OUT:-fuzz_out}
PARALLEL=${PARALLEL:-2}
CMAKE=${CMAKE:-$( [[ -x .venv/bin/cmake ]] && echo "$ROOT/.venv/bin/cmake" || command -v cmake )}
NINJA=${NINJA:-$( [[ -x .venv/bin/ninja ]] && echo "$ROOT/.venv/bin/ninja" || command -v ninja )}
PY=${PY:-$ROOT/.venv/bin/python}

CC=${CC:-clang} CXX=${CXX:-clang++} "$CMAKE" -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_MAKE_PROGRAM="$NINJA" \
  -DRESHARD_CORE_ONLY=ON -DRESHARD_FUZZ=ON -DRESHARD_BUILD_TESTS=OFF >/dev/null || exit 2
"$CMAKE" --build "$BUILD_DIR" -j"$PARALLEL" --target "${TARGETS[@]}" || exit 2

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
if [[ ! -d $OUT/seeds ]]; then
  "$PY" tests/fuzz/make_corpus.py "$OUT/seeds" || echo "fuzz: no zip/pickle seeds (torch missing?)"
  "$PY" tests/fuzz/make_native_corpus.py "$OUT/seeds" || echo "fuzz: no native seeds"
fi
declare -A SEEDS=([fuzz_zip]=zip [fuzz_pickle]=pickle [fuzz_safetensors]=safetensors [fuzz_metadata]=metadata)

run_one() {  # target
  local t=$1 corpus=$OUT/corpus/$1 art=$OUT/artifacts/$1
  mkdir -p "$corpus" "$art"
  [[ -d $OUT/seeds/${SEEDS[$t]} ]] && cp -n "$OUT/seeds/${SEEDS[$t]}"/* "$corpus"/ 2>/dev/null
  (cd "$art" && "$ROOT/$BUILD_DIR/bin/$t" -max_total_time="$SECS" -rss_limit_mb=2048 -timeout=10 \
     -print_final_stats=1 "$corpus" >"$OUT/$t.log" 2>&1)
  local rc=$?
  local runs crashes
  runs=$(grep -E '^stat::number_of_executed_units' "$OUT/$t.log" | awk '{print $2}')
  crashes=$(find "$art" -name 'crash-*' -o -name 'leak-*' -o -name 'timeout-*' -o -name 'oom-*' | wc -l)
  echo "$t: rc $rc, executions ${runs:-?}, crash/leak/timeout/oom files $crashes, log $OUT/$t.log"
}

pids=()
for t in "${TARGETS[@]}"; do
  run_one "$t" &
  pids+=($!)
  while [[ $(jobs -rp | wc -l) -ge $PARALLEL ]]; do sleep 1; done
done
wait
