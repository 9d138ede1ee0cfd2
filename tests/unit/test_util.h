// Helpers shared by the C++ tests.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

namespace reshard::testing {

/// Seed for a randomised test: RESHARD_TEST_SEED if set, else a fresh one. The seed is printed so
/// that a failure can be replayed with RESHARD_TEST_SEED=<seed>.
uint64_t test_seed(const char* test_name);

/// Absolute path of a file in the source tree (configs, fixtures).
std::string source_path(const std::string& relative);

/// A fresh empty temporary directory under $TMPDIR (else /tmp), named PREFIX + 6 random characters.
/// Removed with everything in it when the process that created it exits normally (set
/// RESHARD_KEEP_TEST_DIRS to keep them for a look after a failure); a test may remove it sooner.
/// Throws std::runtime_error naming the template when mkdtemp fails.
std::string make_temp_dir(const std::string& prefix);

/// Inode of ROOT/latest (0 when absent): a save that commits replaces it by rename, so a change
/// tells a kill-during-save test that a save has completed.
uint64_t latest_inode(const std::string& root);

/// XORs the byte at `offset` of file `path` with `mask`: one damaged byte on disk. Throws
/// std::runtime_error naming the file when it cannot be opened or ends before `offset`.
void flip_bits(const std::string& path, uint64_t offset, uint8_t mask);

/// Exchanges the names of two existing files (three renames through `a` + ".swap"): a checkpoint's
/// files renamed among themselves.
void swap_files(const std::string& a, const std::string& b);

/// Resident bytes of this process's mappings of files whose path contains `dir` (the sum of their
/// Rss lines in /proc/self/smaps), and how many such mappings there are.
std::pair<uint64_t, int> mapped_rss_under(const std::string& dir);

}  // namespace reshard::testing
