// Which checksum units a load with verify="full" checks in its pre-flight, and by which rank.
#include <algorithm>
#include <iterator>

#include "reshard/plan.h"

namespace reshard {

bool box_is_dense(const Box& box, const std::array<int64_t, kMaxDims>& strides) {
  int64_t expect = 1;
  for (int d = box.ndim - 1; d >= 0; --d) {
    if (box.len[d] != 1 && strides[d] != expect) return false;
    expect *= box.len[d];
  }
  return true;
}

int64_t box_span(const Box& box, const std::array<int64_t, kMaxDims>& strides) {
  if (box.numel() == 0) return 0;
  int64_t span = 1;
  for (int d = 0; d < box.ndim; ++d) span += (box.len[d] - 1) * strides[d];
  return span;
}

std::vector<ChecksumCheck> checksum_checks(const Plan& plan, std::vector<ChecksumUnit> units) {
  std::sort(units.begin(), units.end(), [](const ChecksumUnit& a, const ChecksumUnit& b) {
    return a.file != b.file ? a.file < b.file : a.offset < b.offset;
  });
  // Prefix maximum of the unit ends within each file: units may interleave (a strided piece's
  // span can contain bytes of another piece), so a walk back from the last unit starting before
  // a fragment's end stops once no earlier unit reaches past the fragment's start.
  std::vector<uint64_t> max_end(units.size());
  for (size_t i = 0; i < units.size(); ++i) {
    const uint64_t e = units[i].offset + units[i].length;
    max_end[i] = (i > 0 && units[i - 1].file == units[i].file) ? std::max(max_end[i - 1], e) : e;
  }
  // Per unit and machine that reads it: read whole by one fragment, or the best checker so far
  // (most bytes inside). Every machine checks the units its ranks read: each may read its own
  // copy of the files (node-local disks), so one machine's check says nothing of another's.
  struct Best {
    int32_t machine = 0;
    bool whole = false;
    uint64_t bytes = 0;
    int32_t checker = 0;
  };
  std::vector<std::vector<Best>> best(units.size());
  auto machine_of = [&](int32_t rank) {
    return plan.rank_machine.empty() || rank < 0 || size_t(rank) >= plan.rank_machine.size() ? 0 : plan.rank_machine[size_t(rank)];
  };
  // One read of `box` at byte_base with `strides` by rank `reader`: which units it touches.
  auto touch = [&](int32_t file, uint64_t byte_base, const Box& box, const std::array<int64_t, kMaxDims>& strides,
                   DType dtype, int32_t reader) {
    if (box.numel() == 0) return;
    // Byte extent in the file: [lo, hi) (strides are non-negative).
    const uint64_t es = dtype_size(dtype);
    const uint64_t lo = byte_base, hi = byte_base + uint64_t(box_span(box, strides)) * es;
    const bool dense = box_is_dense(box, strides);
    // Units starting before hi, walked back from the last one.
    size_t n = size_t(std::lower_bound(units.begin(), units.end(), std::make_pair(file, hi),
                                       [](const ChecksumUnit& u, const std::pair<int32_t, uint64_t>& k) {
                                         return u.file != k.first ? u.file < k.first : u.offset < k.second;
                                       }) -
                      units.begin());
    while (n > 0 && units[n - 1].file == file && max_end[n - 1] > lo) {
      const size_t i = --n;
      const uint64_t ulo = units[i].offset, uhi = units[i].offset + units[i].length;
      if (uhi <= lo) continue;
      const int32_t m = machine_of(reader);
      auto it = std::find_if(best[i].begin(), best[i].end(), [&](const Best& x) { return x.machine == m; });
      if (it == best[i].end()) {
        best[i].push_back(Best{m, false, 0, reader});
        it = best[i].end() - 1;
      }
      Best& b = *it;
      if (dense && ulo == lo && uhi == hi) b.whole = true;
      const uint64_t inside = std::min(hi, uhi) - std::max(lo, ulo);
      if (inside > b.bytes) {
        b.bytes = inside;
        b.checker = reader;
      }
    }
  };
  for (const Fragment& f : plan.fragments) {
    touch(f.file, f.byte_base, f.box, f.src_strides, f.src_dtype, f.reader);
    // Replica policy average: the other saved copies its reader reads and averages in.
    for (uint32_t k = 0; k < f.num_replicas; ++k) {
      const ReplicaSource& r = plan.replica_sources[f.first_replica + k];
      touch(r.file, r.byte_base, r.box, r.strides, r.dtype, f.reader);
    }
  }
  std::vector<ChecksumCheck> out;
  for (size_t i = 0; i < units.size(); ++i) {
    std::sort(best[i].begin(), best[i].end(), [](const Best& a, const Best& b) { return a.machine < b.machine; });
    for (const Best& b : best[i]) out.push_back({units[i], b.checker, !b.whole});
  }
  return out;
}

}  // namespace reshard
