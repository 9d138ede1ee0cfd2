// Progress of a long CLI operation on stderr: one line per stage as it finishes ("  plan  0.01 s"),
// and for stages that move bytes a bar redrawn in place ("  copy  [#####     ]  52%  0.62/1.20 GB").
// Shown only when stderr is a terminal and --quiet was not given, on rank 0 of an mpirun job;
// otherwise every call is a no-op, so output piped to a file or a log stays unchanged.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace reshard::cli {

/// Set from the top-level -q/--quiet flag (main.cc) before a command runs.
void set_quiet(bool quiet);
bool quiet();

class Progress {
 public:
  /// `rank`: this process's rank (only rank 0 draws). Enabled when quiet() is false and stderr is a
  /// terminal (isatty), or when `force` is set (tests drive it through a pseudo-terminal instead).
  explicit Progress(int rank = 0, bool force = false);
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  bool enabled() const { return on_; }
  /// Starts a stage (ends the previous one). `total_bytes` > 0 draws a bar that update() moves.
  void stage(const std::string& name, uint64_t total_bytes = 0);
  /// Bytes done in the current stage; redrawn at most every 100 ms and at the end.
  void update(uint64_t done_bytes);
  /// Ends the current stage: its line is completed with the stage's seconds.
  void end();

 private:
  void draw(bool final);
  bool on_ = false;
  bool open_ = false;
  std::string name_;
  uint64_t total_ = 0, done_ = 0;
  std::chrono::steady_clock::time_point t0_, last_draw_;
};

}  // namespace reshard::cli
