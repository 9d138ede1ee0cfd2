# Writes OUT, a header defining RESHARD_VERSION (VERSION) and RESHARD_GIT_COMMIT (the checkout at
# SRC: its short commit, "-dirty" with uncommitted changes to tracked files, "unknown" outside git).
# Run at every build (cmake -P); the file is rewritten only when its text changes, so a build
# without a new commit recompiles nothing.
execute_process(COMMAND git -C "${SRC}" rev-parse --short=12 HEAD OUTPUT_VARIABLE commit
                OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE rc)
if(NOT rc EQUAL 0 OR commit STREQUAL "")
  set(commit "unknown")
else()
  execute_process(COMMAND git -C "${SRC}" status --porcelain --untracked-files=no OUTPUT_VARIABLE dirty ERROR_QUIET)
  if(NOT dirty STREQUAL "")
    set(commit "${commit}-dirty")
  endif()
endif()
set(text "#pragma once\n#define RESHARD_VERSION \"${VERSION}\"\n#define RESHARD_GIT_COMMIT \"${commit}\"\n")
set(old "")
if(EXISTS "${OUT}")
  file(READ "${OUT}" old)
endif()
if(NOT old STREQUAL text)
  file(WRITE "${OUT}" "${text}")
endif()
