// Checking whole checksum units: the pre-flight of a verify="full" load and convert's default check.
#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <thread>

#include "io/file.h"
#include "io/parallel.h"
#include "reshard/checkpoint.h"
#include "reshard/error.h"

namespace reshard {

std::vector<std::string> check_checksum_units(const CheckpointReader& reader, const std::vector<ChecksumUnit>& units,
                                              int threads, bool drop_pages) {
  std::vector<std::string> problems;
  std::mutex mu;
  auto report = [&](std::string s) {
    std::lock_guard<std::mutex> lock(mu);
    problems.push_back(std::move(s));
  };
  // A file's size once, before any mapped byte is touched (a byte past the end of a mapping is
  // SIGBUS, not an error); a missing file is an error for each of its units.
  std::map<int32_t, uint64_t> size;
  std::map<int32_t, std::string> missing;
  for (const ChecksumUnit& u : units) {
    if (size.count(u.file) || missing.count(u.file)) continue;
    try {
      size[u.file] = reader.file_size(u.file);
    } catch (const Error& e) {
      missing[u.file] = e.what();
    }
  }
  const int n = threads > 0 ? threads : default_threads();
  std::vector<std::vector<uint8_t>> bufs(static_cast<size_t>(n));  // per thread
  parallel_for(units.size(), n, [&](size_t k, int w) {
    std::vector<uint8_t>& buf = bufs[size_t(w)];
    const ChecksumUnit& u = units[k];
    auto gone = missing.find(u.file);
    if (gone != missing.end()) {
      report(gone->second);
      return;
    }
    try {
      const uint8_t* map = reader.mapped(u.file);
      std::string why;
      if (map && size.at(u.file) >= u.offset + u.length) {
        why = reader.verify_range(u.file, u.offset, u.length, map + u.offset);
        if (drop_pages) io::drop_mapped_pages(map + u.offset, u.length);
      } else {
        buf.resize(size_t(u.length));
        reader.read(u.file, u.offset, u.length, buf.data());
        why = reader.verify_range(u.file, u.offset, u.length, buf.data());
      }
      if (!why.empty()) report(why);
    } catch (const Error& e) {
      report(e.what());
    }
  });
  // What the per-unit drops left (pages faulted in again around a neighbour's drop).
  if (drop_pages) reader.drop_mapped_pages();
  std::sort(problems.begin(), problems.end());
  problems.erase(std::unique(problems.begin(), problems.end()), problems.end());
  return problems;
}

}  // namespace reshard
