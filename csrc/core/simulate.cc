#include "reshard/simulate.h"

#include <cmath>
#include <cstring>
#include <sstream>
#include <vector>

#include "reshard/error.h"
#include "reshard/strided.h"

namespace reshard {

void read_box(int32_t file, uint64_t byte_base, DType dtype, const Box& box,
              const std::array<int64_t, kMaxDims>& strides, const ReadFn& read, void* packed) {
  const size_t es = dtype_size(dtype);
  auto* out = static_cast<uint8_t*>(packed);
  for_each_run(box, strides, [&](int64_t off, int64_t cnt, int64_t pk) {
    read(file, byte_base + uint64_t(off) * es, uint64_t(cnt) * es, out + pk * es);
  });
}

double replica_max_abs_diff(const ReplicaCompare& c, const ReadFn& read) {
  // Slab by slab: two buffers of at most kSlab elements instead of the whole box (and of two
  // doubles per element), and a byte compare first: replicas are nearly always bitwise equal, and
  // then |diff| is 0 without converting a value. Values are compared only in slabs whose bytes
  // differ (or whose dtypes do).
  constexpr int64_t kSlab = int64_t(1) << 18;
  const ReplicaCompare::Side& A = c.authoritative;
  const ReplicaCompare::Side& B = c.replica;
  const size_t ea = dtype_size(A.dtype), eb = dtype_size(B.dtype);
  Box rel = c.box;
  for (int d = 0; d < rel.ndim; ++d) rel.off[d] = 0;
  std::vector<uint8_t> a, b;
  std::vector<double> x, y;
  double m = 0;
  for_each_slab(rel, kSlab, [&](const Box& slab, int64_t) {
    const int64_t n = slab.numel();
    int64_t oa = 0, ob = 0;
    Box shape = slab;
    for (int d = 0; d < slab.ndim; ++d) {
      oa += slab.off[d] * A.strides[d];
      ob += slab.off[d] * B.strides[d];
      shape.off[d] = 0;
    }
    a.resize(size_t(n) * ea);
    b.resize(size_t(n) * eb);
    read_box(A.file, A.byte_base + uint64_t(oa) * ea, A.dtype, shape, A.strides, read, a.data());
    read_box(B.file, B.byte_base + uint64_t(ob) * eb, B.dtype, shape, B.strides, read, b.data());
    if (A.dtype == B.dtype && std::memcmp(a.data(), b.data(), a.size()) == 0) return;
    x.resize(size_t(n));
    y.resize(size_t(n));
    convert_elements(a.data(), A.dtype, x.data(), DType::F64, size_t(n));
    convert_elements(b.data(), B.dtype, y.data(), DType::F64, size_t(n));
    for (int64_t i = 0; i < n; ++i) {
      // Equal values (equal infinities too) differ by 0.
      double d = x[size_t(i)] == y[size_t(i)] ? 0.0 : std::fabs(x[size_t(i)] - y[size_t(i)]);
      if (std::isnan(d)) d = (std::isnan(x[size_t(i)]) && std::isnan(y[size_t(i)])) ? 0 : INFINITY;
      if (d > m) m = d;
    }
  });
  return m;
}

uint64_t average_replicas(const Plan& plan, const Fragment& f, const ReadFn& read, void* packed) {
  if (f.num_replicas == 0) return 0;
  const int64_t n = f.box.numel();
  std::vector<double> sum(size_t(n), 0.0);
  std::vector<uint32_t> count(size_t(n), 1);
  convert_elements(packed, f.src_dtype, sum.data(), DType::F64, size_t(n));
  // Row-major strides of the fragment's packed box, to place each replica's sub-box in it.
  std::array<int64_t, kMaxDims> packed_strides{};
  int64_t s = 1;
  for (int d = f.box.ndim - 1; d >= 0; --d) {
    packed_strides[d] = s;
    s *= f.box.len[d];
  }
  uint64_t bytes = 0;
  std::vector<uint8_t> raw;
  std::vector<double> vals;
  for (uint32_t k = 0; k < f.num_replicas; ++k) {
    const ReplicaSource& r = plan.replica_sources[f.first_replica + k];
    const int64_t m = r.box.numel();
    Box rel = r.box;
    for (int d = 0; d < rel.ndim; ++d) rel.off[d] = 0;
    raw.resize(size_t(m) * dtype_size(r.dtype));
    read_box(r.file, r.byte_base, r.dtype, rel, r.strides, read, raw.data());
    bytes += r.bytes();
    vals.resize(size_t(m));
    convert_elements(raw.data(), r.dtype, vals.data(), DType::F64, size_t(m));
    int64_t origin = 0;
    for (int d = 0; d < f.box.ndim; ++d) origin += (r.box.off[d] - f.box.off[d]) * packed_strides[d];
    for_each_run(rel, packed_strides, [&](int64_t off, int64_t cnt, int64_t pk) {
      for (int64_t i = 0; i < cnt; ++i) {
        sum[size_t(origin + off + i)] += vals[size_t(pk + i)];
        ++count[size_t(origin + off + i)];
      }
    });
  }
  for (int64_t i = 0; i < n; ++i) sum[size_t(i)] /= double(count[size_t(i)]);
  convert_elements(sum.data(), DType::F64, packed, f.src_dtype, size_t(n));
  return bytes;
}

std::vector<ReplicaResult> simulate_plan(const Plan& plan, const Layout& target, const ReadFn& read,
                                         const std::vector<void*>& bufs, ReplicaPolicy policy, double atol) {
  RESHARD_CHECK(bufs.size() == target.buffers.size(), "one pointer per target buffer");
  std::vector<ReplicaResult> results;
  std::ostringstream bad;
  int nbad = 0;
  for (size_t i = 0; i < plan.replica_compares.size(); ++i) {
    const auto& c = plan.replica_compares[i];
    double m = replica_max_abs_diff(c, read);
    results.push_back({i, m});
    if (m > atol) {
      if (nbad++ < 8) bad << (nbad > 1 ? "; " : "") << c.tensor << " (" << state_kind_name(c.state) << ") region "
                          << c.box.to_string() << ": max |diff| " << m;
    }
  }
  if (nbad > 0 && policy == ReplicaPolicy::kError) {
    fail(ErrorCode::kDataLoss, "replicated values differ between copies in the checkpoint in ", nbad,
         " region(s): ", bad.str(), " (replica policy 'error', atol ", atol,
         "; if `reshard verify` finds a checksum mismatch in a copy, the copy is damaged: restore the file; "
         "if not, either a file comes from another run or step (check where each file was copied from; a "
         "replica policy would load a mix of two runs) or the copies diverged in training (then choose policy "
         "'first' or 'average', or a tolerance, to load anyway)); nothing was written");
  }
  std::vector<uint8_t> packed;
  for (const Fragment& f : plan.fragments) {
    Box rel = f.box;
    for (int d = 0; d < rel.ndim; ++d) rel.off[d] = 0;
    packed.resize(f.bytes());
    read_box(f.file, f.byte_base, f.src_dtype, rel, f.src_strides, read, packed.data());
    average_replicas(plan, f, read, packed.data());
    for (uint32_t k = 0; k < f.num_deliveries; ++k) {
      const Delivery& d = plan.deliveries[f.first_delivery + k];
      const Buffer& b = target.buffers[d.buffer];
      auto* base = static_cast<uint8_t*>(bufs[d.buffer]) + d.base * int64_t(dtype_size(b.dtype));
      unpack_box(packed.data(), f.src_dtype, base, b.dtype, rel, d.strides);
    }
  }
  for (const Fill& f : plan.fills) {
    const Buffer& b = target.buffers[f.buffer];
    Box rel = f.extent;
    for (int d = 0; d < rel.ndim; ++d) rel.off[d] = 0;
    fill_zero_box(static_cast<uint8_t*>(bufs[f.buffer]) + f.base * int64_t(dtype_size(b.dtype)), b.dtype, rel, f.strides);
  }
  return results;
}

}  // namespace reshard
