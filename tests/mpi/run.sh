#!/usr/bin/env bash
# Runs every built MPI test binary (the tests/mpi/*_test.cc targets) under mpirun at several
# world sizes.
#
#   tests/mpi/run.sh BUILD_DIR [binary-name-regex]
#
# Environment:
#   RESHARD_MPI_NPS       world sizes to run (default "1 2 3 4 8")
#   RESHARD_MPI_TIMEOUT_S wall-clock limit per mpirun (default 300)
#   MPIRUN                launcher (default mpirun); RESHARD_MPIRUN_ARGS extra launcher arguments
# Prints one line per run and finally "mpi: N passed, M failed"; exits non-zero if any run failed.
# The output of a failed run is printed; passing runs keep their log in BUILD_DIR/mpi_logs/.
set -u

if [[ $# -lt 1 || $# -gt 2 ]]; then
  echo "usage: $0 BUILD_DIR [binary-name-regex]" >&2
  exit 2
fi
build_dir=$1
filter=${2:-.}
nps=${RESHARD_MPI_NPS:-"1 2 3 4 8"}
limit=${RESHARD_MPI_TIMEOUT_S:-300}
mpirun_bin=${MPIRUN:-mpirun}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

if ! command -v "$mpirun_bin" >/dev/null 2>&1; then
  echo "mpi: $mpirun_bin not found" >&2
  echo "mpi: 0 passed, 1 failed"
  exit 1
fi

# The binaries are the names of tests/mpi/*_test.cc, built into BUILD_DIR/bin (or BUILD_DIR).
binaries=()
for src in "$here"/*_test.cc; do
  [[ -e $src ]] || continue
  name=$(basename "$src" .cc)
  [[ $name =~ $filter ]] || continue
  for cand in "$build_dir/bin/$name" "$build_dir/$name"; do
    if [[ -x $cand ]]; then binaries+=("$cand"); break; fi
  done
done

# Ranks' stdout is a pty under mpirun: keep gtest's colour codes out of the logs.
export GTEST_COLOR=${GTEST_COLOR:-no}

log_dir="$build_dir/mpi_logs"
mkdir -p "$log_dir"
passed=0
failed=0
if [[ ${#binaries[@]} -eq 0 ]]; then
  echo "mpi: no built binaries in $build_dir/bin matching '$filter' (build the tests/mpi targets)" >&2
  failed=1
fi

for bin in "${binaries[@]}"; do
  name=$(basename "$bin")
  for np in $nps; do
    log="$log_dir/$name.np$np.log"
    start=$(date +%s)
    # --kill-after: mpirun forwards SIGTERM to its ranks; SIGKILL if it does not exit.
    timeout --kill-after=10 "$limit" "$mpirun_bin" --oversubscribe --allow-run-as-root \
      -np "$np" -x GTEST_COLOR ${RESHARD_MPIRUN_ARGS:-} "$bin" >"$log" 2>&1
    rc=$?
    secs=$(( $(date +%s) - start ))
    summary=$(grep -E '^\[ +(PASSED|SKIPPED|FAILED) +\] [0-9]+ test' "$log" | sed 's/, listed below://' | tr '\n' ' ' | sed 's/  */ /g')
    if [[ $rc -eq 0 ]]; then
      passed=$((passed + 1))
      echo "PASS $name np=$np (${secs}s) ${summary}"
    else
      failed=$((failed + 1))
      why="exit $rc"
      [[ $rc -eq 124 || $rc -eq 137 ]] && why="timed out after ${limit}s"
      echo "FAIL $name np=$np (${secs}s, $why) ${summary}"
      echo "----- $log -----"
      tail -n 200 "$log"
      echo "-----"
    fi
  done
done

echo "mpi: $passed passed, $failed failed"
[[ $failed -eq 0 ]]
