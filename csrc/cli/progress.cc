#include "cli/progress.h"
#include "reshard/units.h"

#include <unistd.h>

#include <cstdio>

namespace reshard::cli {

namespace {
bool g_quiet = false;
}

void set_quiet(bool q) { g_quiet = q; }
bool quiet() { return g_quiet; }

Progress::Progress(int rank, bool force) { on_ = rank == 0 && !g_quiet && (force || ::isatty(STDERR_FILENO) == 1); }

Progress::~Progress() { end(); }

void Progress::stage(const std::string& name, uint64_t total_bytes) {
  if (!on_) return;
  end();
  name_ = name;
  total_ = total_bytes;
  done_ = 0;
  open_ = true;
  t0_ = last_draw_ = std::chrono::steady_clock::now();
  draw(false);
}

void Progress::update(uint64_t done_bytes) {
  if (!on_ || !open_) return;
  done_ = done_bytes;
  const auto now = std::chrono::steady_clock::now();
  if (now - last_draw_ < std::chrono::milliseconds(100)) return;
  last_draw_ = now;
  draw(false);
}

void Progress::end() {
  if (!on_ || !open_) return;
  if (total_ > 0) done_ = total_;
  draw(true);
  open_ = false;
}

void Progress::draw(bool final) {
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  std::string line = "\r  " + name_;
  if (line.size() < 22) line.resize(22, ' ');  // "\r  weights vs master" and shorter names line up
  char buf[160];
  if (total_ > 0) {
    const double frac = done_ >= total_ ? 1.0 : double(done_) / double(total_);
    const int width = 24, filled = int(frac * width + 0.5);
    std::snprintf(buf, sizeof(buf), " [%s%s] %3d%%  %s / %s", std::string(size_t(filled), '#').c_str(),
                  std::string(size_t(width - filled), ' ').c_str(), int(frac * 100 + 0.5), format_bytes(done_).c_str(),
                  format_bytes(total_).c_str());
    line += buf;
  }
  if (final) {
    std::snprintf(buf, sizeof(buf), "  %.2f s\033[K\n", secs);
    line += buf;
  } else {
    line += "\033[K";  // clear what a longer earlier draw left
  }
  std::fputs(line.c_str(), stderr);
  std::fflush(stderr);
}

}  // namespace reshard::cli
