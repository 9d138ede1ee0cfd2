#include "unit/test_util.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <vector>

namespace reshard::testing {

void flip_bits(const std::string& path, uint64_t offset, uint8_t mask) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  char x;
  if (!f.seekg(std::streamoff(offset)) || !f.get(x))
    throw std::runtime_error("flip_bits: cannot read byte " + std::to_string(offset) + " of " + path);
  f.seekp(std::streamoff(offset));
  if (!f.put(char(x ^ char(mask))))
    throw std::runtime_error("flip_bits: cannot write byte " + std::to_string(offset) + " of " + path);
}

void swap_files(const std::string& a, const std::string& b) {
  const std::string tmp = a + ".swap";
  std::filesystem::rename(a, tmp);
  std::filesystem::rename(b, a);
  std::filesystem::rename(tmp, b);
}

std::pair<uint64_t, int> mapped_rss_under(const std::string& dir) {
  std::ifstream in("/proc/self/smaps");
  std::string line;
  bool mine = false;
  uint64_t kb = 0;
  int n = 0;
  while (std::getline(in, line)) {
    if (!line.empty() && std::isxdigit(static_cast<unsigned char>(line[0])) && line.find('-') < line.find(' ')) {
      mine = line.find(dir) != std::string::npos;  // a mapping's header line: "lo-hi perms ... path"
      n += mine;
    } else if (mine && line.rfind("Rss:", 0) == 0) {
      kb += std::stoull(line.substr(4));
    }
  }
  return {kb * 1024, n};
}

uint64_t test_seed(const char* test_name) {
  uint64_t seed;
  if (const char* env = std::getenv("RESHARD_TEST_SEED")) {
    seed = std::strtoull(env, nullptr, 10);
  } else {
    seed = uint64_t(std::chrono::steady_clock::now().time_since_epoch().count()) % 1000000007ull;
  }
  std::printf("[seed] %s: RESHARD_TEST_SEED=%llu\n", test_name, (unsigned long long)seed);
  std::fflush(stdout);
  return seed;
}

std::string source_path(const std::string& relative) {
#ifdef RESHARD_SOURCE_DIR
  return std::string(RESHARD_SOURCE_DIR) + "/" + relative;
#else
  return relative;
#endif
}

namespace {

// The directories make_temp_dir created in this process, removed when it exits normally (a
// test that returns early, skips or fails would otherwise leave its directory behind: dozens had
// piled up in /tmp from repeated runs). Only the process that created a directory removes it: a
// forked child that exits must not delete what its parent still uses.
struct TempDirs {
  std::mutex mu;
  std::vector<std::string> paths;
  pid_t owner = ::getpid();
  ~TempDirs() {
    if (::getpid() != owner || std::getenv("RESHARD_KEEP_TEST_DIRS")) return;
    for (const auto& p : paths) {
      std::error_code ec;
      std::filesystem::remove_all(p, ec);  // best effort: a test may have made a file immutable
    }
  }
};

TempDirs& temp_dirs() {
  static TempDirs dirs;
  return dirs;
}

}  // namespace

std::string make_temp_dir(const std::string& prefix) {
  const char* base = std::getenv("TMPDIR");
  std::string tmpl = std::string(base ? base : "/tmp") + "/" + prefix + "XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  if (!mkdtemp(buf.data())) throw std::runtime_error("mkdtemp failed for " + tmpl);
  TempDirs& dirs = temp_dirs();
  std::lock_guard<std::mutex> lock(dirs.mu);
  dirs.paths.emplace_back(buf.data());
  return dirs.paths.back();
}

uint64_t latest_inode(const std::string& root) {
  struct stat st;
  return ::stat((root + "/latest").c_str(), &st) == 0 ? uint64_t(st.st_ino) : 0;
}

}  // namespace reshard::testing
