// Conformance cases for reshard::Communicator, shared by every implementation's tests
// (tests/unit/comm_local_test.cc for the local world of 1, tests/mpi/comm_test.cc under mpirun).
// Each case is collective: every rank of the communicator calls it with the same arguments.
// Cases report with EXPECT_* (never ASSERT_* before a collective) so that a failing rank keeps
// taking part in the collectives and its peers do not hang.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "reshard/comm.h"
#include "reshard/error.h"
#include "unit/test_util.h"

namespace reshard::conformance {

/// One seed for all ranks: rank 0 draws (and prints) it, everyone gets it via all_reduce_sum.
inline uint64_t shared_seed(Communicator& c, const char* test_name) {
  uint64_t seed = c.rank() == 0 ? reshard::testing::test_seed(test_name) : 0;
  return uint64_t(c.all_reduce_sum(int64_t(seed)));
}

/// Byte i of the payload rank `src` sends to rank `dst` in round `round`.
inline uint8_t pattern(int src, int dst, uint64_t round, uint64_t i) {
  uint64_t x = i * 0x9E3779B97F4A7C15ull + uint64_t(src) * 0xBF58476D1CE4E5B9ull +
               uint64_t(dst) * 0x94D049BB133111EBull + round * 0x2545F4914F6CDD1Dull;
  x ^= x >> 29;
  return uint8_t(x >> 24);
}

inline void fill_pattern(uint8_t* p, uint64_t n, int src, int dst, uint64_t round) {
  for (uint64_t i = 0; i < n; ++i) p[i] = pattern(src, dst, round, i);
}

/// Index of the first differing byte, or -1.
inline int64_t first_diff(const uint8_t* a, const uint8_t* b, uint64_t n) {
  if (n == 0) return -1;  // an empty vector's data() may be null, which memcmp must not get
  if (std::memcmp(a, b, n) == 0) return -1;
  for (uint64_t i = 0; i < n; ++i)
    if (a[i] != b[i]) return int64_t(i);
  return -1;
}

constexpr uint8_t kSentinel = 0xAB;

/// Lays out regions of `counts[p]` bytes in a random order of p with random gaps; returns the
/// displacements and the total buffer size.
inline uint64_t random_layout(std::mt19937_64& rng, const std::vector<uint64_t>& counts,
                              std::vector<uint64_t>& displs) {
  const size_t n = counts.size();
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  displs.assign(n, 0);
  uint64_t off = 0;
  for (size_t p : order) {
    off += rng() % 17;  // gap
    displs[p] = off;
    off += counts[p];
  }
  return off + rng() % 17;
}

/// all_to_all_v with a seeded random count matrix (zero counts and self-sends included, counts
/// up to max_count), random displacement orders and gaps; checks every received byte and that
/// the gaps of the receive buffer are untouched.
inline void all_to_all_random(Communicator& c, uint64_t seed, int rounds, uint64_t max_count) {
  const int n = c.size(), me = c.rank();
  for (int round = 0; round < rounds; ++round) {
    std::mt19937_64 rng(seed * 1000003ull + uint64_t(round));
    // counts[s][d]: what s sends to d. Same matrix on all ranks.
    std::vector<std::vector<uint64_t>> m(static_cast<size_t>(n), std::vector<uint64_t>(static_cast<size_t>(n)));
    for (auto& row : m) {
      for (auto& v : row) {
        const uint64_t kind = rng() % 8;
        v = kind < 2 ? 0 : kind == 2 ? max_count : 1 + rng() % max_count;
      }
    }
    if (round == 1 && n > 1) {  // one rank sends and receives nothing at all
      const size_t idle = size_t(rng() % uint64_t(n));
      for (size_t p = 0; p < size_t(n); ++p) m[idle][p] = m[p][idle] = 0;
    }
    std::vector<uint64_t> send_counts(static_cast<size_t>(n)), recv_counts(static_cast<size_t>(n));
    for (int p = 0; p < n; ++p) {
      send_counts[size_t(p)] = m[size_t(me)][size_t(p)];
      recv_counts[size_t(p)] = m[size_t(p)][size_t(me)];
    }
    // Per-rank layout randomness (layouts are local, so ranks may differ).
    std::mt19937_64 lrng(seed ^ (uint64_t(me + 1) * 0x9E3779B97F4A7C15ull) ^ uint64_t(round));
    std::vector<uint64_t> send_displs, recv_displs;
    const uint64_t send_size = random_layout(lrng, send_counts, send_displs);
    const uint64_t recv_size = random_layout(lrng, recv_counts, recv_displs);
    std::vector<uint8_t> send(send_size, 0x11), recv(recv_size, kSentinel),
        expected(recv_size, kSentinel);
    for (int p = 0; p < n; ++p) {
      fill_pattern(send.data() + send_displs[size_t(p)], send_counts[size_t(p)], me, p,
                   uint64_t(round));
      fill_pattern(expected.data() + recv_displs[size_t(p)], recv_counts[size_t(p)], p, me,
                   uint64_t(round));
    }
    try {
      c.all_to_all_v(send.data(), send_counts, send_displs, recv.data(), recv_counts,
                     recv_displs);
    } catch (const Error& e) {
      ADD_FAILURE() << "round " << round << ": " << e.what();
      return;
    }
    const int64_t d = first_diff(recv.data(), expected.data(), recv_size);
    EXPECT_EQ(d, -1) << "[rank " << me << "/" << n << "] round " << round
                     << ": receive buffer differs at byte " << d << " (got "
                     << int(d >= 0 ? recv[size_t(d)] : 0) << ", want "
                     << int(d >= 0 ? expected[size_t(d)] : 0) << ")";
  }
}

/// Every rank sends `bytes` (> 2^31 to exercise 64-bit counts) to the next rank of a ring made
/// of ranks [0, min(size, 2)); other ranks take part with zero counts. Needs ~2*bytes of memory
/// on each participating rank.
inline void all_to_all_big(Communicator& c, uint64_t bytes) {
  const int n = c.size(), me = c.rank();
  const int ring = std::min(n, 2);
  std::vector<uint64_t> sc(size_t(n), 0), rc(size_t(n), 0), sd(size_t(n), 0), rd(size_t(n), 0);
  std::vector<uint8_t> send, recv;
  if (me < ring) {
    const int to = (me + 1) % ring, from = (me + ring - 1) % ring;
    sc[size_t(to)] = bytes;
    rc[size_t(from)] = bytes;
    send.resize(bytes);
    recv.assign(bytes, kSentinel);
    // Cheap pattern: 8-byte words (word index, src, dst).
    auto* w = reinterpret_cast<uint64_t*>(send.data());
    for (uint64_t i = 0; i < bytes / 8; ++i) w[i] = i ^ (uint64_t(me) << 56) ^ (uint64_t(to) << 48);
    for (uint64_t i = bytes / 8 * 8; i < bytes; ++i) send[i] = uint8_t(i);
  }
  c.all_to_all_v(send.data(), sc, sd, recv.data(), rc, rd);
  if (me < ring) {
    const int from = (me + ring - 1) % ring;
    const auto* w = reinterpret_cast<const uint64_t*>(recv.data());
    uint64_t bad = 0, first = UINT64_MAX;
    for (uint64_t i = 0; i < bytes / 8; ++i) {
      if (w[i] != (i ^ (uint64_t(from) << 56) ^ (uint64_t(me) << 48))) {
        ++bad;
        first = std::min(first, i);
      }
    }
    for (uint64_t i = bytes / 8 * 8; i < bytes; ++i) bad += recv[i] != uint8_t(i);
    EXPECT_EQ(bad, 0u) << "[rank " << me << "] " << bad << " bad words of " << bytes
                       << " bytes, first at word " << first;
  }
}

/// Rank 0 expects 10 bytes from rank 1 (from itself when alone) but that rank sends 12: every
/// rank raises an Error, the two involved ranks name both ranks and both counts, and the
/// communicator is still usable afterwards.
inline void all_to_all_mismatch(Communicator& c) {
  const int n = c.size(), me = c.rank();
  const int other = n > 1 ? 1 : 0;
  std::vector<uint64_t> sc(size_t(n), 0), rc(size_t(n), 0), zd(size_t(n), 0);
  if (me == 0) rc[size_t(other)] = 10;
  if (me == other) sc[0] = 12;
  std::vector<uint8_t> send(64, 1), recv(64, 0);
  std::string msg;
  try {
    c.all_to_all_v(send.data(), sc, zd, recv.data(), rc, zd);
    ADD_FAILURE() << "[rank " << me << "] mismatched counts did not raise";
  } catch (const Error& e) {
    msg = e.what();
    EXPECT_TRUE(e.code() == ErrorCode::kFailedPrecondition || e.code() == ErrorCode::kInternal)
        << msg;
  }
  const std::string prefix = "[rank " + std::to_string(me) + "/" + std::to_string(n) + "]";
  EXPECT_EQ(msg.rfind(prefix, 0), 0u) << msg;
  if (me == 0) {
    EXPECT_NE(msg.find("rank 0 expects 10 bytes from rank " + std::to_string(other) +
                       ", but rank " + std::to_string(other) + " sends 12 bytes"),
              std::string::npos)
        << msg;
  } else if (me == other) {
    EXPECT_NE(msg.find("rank 1 sends 12 bytes to rank 0, but rank 0 expects 10 bytes"),
              std::string::npos)
        << msg;
  }
  EXPECT_EQ(c.all_reduce_sum(1), n) << "communicator unusable after a count mismatch";
}

/// One rank passes count vectors of the wrong length: every rank raises, nobody hangs.
inline void all_to_all_bad_arguments(Communicator& c) {
  const int n = c.size(), me = c.rank();
  const int bad = n - 1;
  std::vector<uint64_t> v(size_t(me == bad ? n + 1 : n), 0), ok(size_t(n), 0);
  uint8_t dummy = 0;
  bool raised = false;
  try {
    c.all_to_all_v(&dummy, v, ok, &dummy, ok, ok);
  } catch (const Error& e) {
    raised = true;
    if (me == bad) {
      EXPECT_NE(std::string(e.what()).find("one entry per rank"), std::string::npos) << e.what();
    }
  }
  EXPECT_TRUE(raised) << "[rank " << me << "] bad arguments on rank " << bad << " did not raise";
  EXPECT_EQ(c.all_reduce_sum(1), n);
}

/// Broadcasts over seeded random subgroups (any subset containing the root), with random roots
/// and sizes (0, small, up to max_bytes). Non-members skip the call, so groups interleave.
inline void broadcast_random_groups(Communicator& c, uint64_t seed, int rounds,
                                    uint64_t max_bytes) {
  const int n = c.size(), me = c.rank();
  std::mt19937_64 rng(seed);
  for (int round = 0; round < rounds; ++round) {
    std::vector<int> group;
    const uint64_t mode = rng() % 4;
    for (int r = 0; r < n; ++r)
      if (mode == 0 || rng() % 2) group.push_back(r);  // mode 0: the whole world
    if (group.empty()) group.push_back(int(rng() % uint64_t(n)));
    const int root = group[rng() % group.size()];
    const uint64_t kind = rng() % 6;
    const uint64_t bytes = kind == 0 ? 0 : kind == 1 ? 1 + rng() % 16
                           : kind == 2 ? max_bytes : 1 + rng() % max_bytes;
    if (!std::binary_search(group.begin(), group.end(), me)) continue;
    std::vector<uint8_t> data(bytes), expected(bytes);
    fill_pattern(expected.data(), bytes, root, -1, uint64_t(round));
    if (me == root) data = expected;
    else std::fill(data.begin(), data.end(), kSentinel);
    try {
      c.broadcast(data.data(), bytes, root, group);
    } catch (const Error& e) {
      ADD_FAILURE() << "round " << round << ": " << e.what();
      return;
    }
    const int64_t d = first_diff(data.data(), expected.data(), bytes);
    EXPECT_EQ(d, -1) << "[rank " << me << "] round " << round << " root " << root << " bytes "
                     << bytes << " group size " << group.size() << ": differs at byte " << d;
  }
  c.barrier();
}

/// broadcast rejects, locally and without communicating, a group that is unsorted, has
/// duplicates, or lacks the caller or the root.
inline void broadcast_invalid_group(Communicator& c) {
  const int n = c.size(), me = c.rank();
  uint8_t b = 0;
  EXPECT_THROW(c.broadcast(&b, 1, me, {me, me}), Error);
  EXPECT_THROW(c.broadcast(&b, 1, n, {me}), Error);          // root outside
  EXPECT_THROW(c.broadcast(&b, 1, me, {me, n}), Error);      // rank out of range
  if (n > 1) {
    const int other = (me + 1) % n;
    EXPECT_THROW(c.broadcast(&b, 1, other, {other}), Error);  // caller not in group
    std::vector<int> unsorted = {std::max(me, other), std::min(me, other)};
    EXPECT_THROW(c.broadcast(&b, 1, me, unsorted), Error);
  }
}

inline void all_reduce(Communicator& c) {
  const int64_t n = c.size(), me = c.rank();
  EXPECT_EQ(c.all_reduce_sum(me + 1), n * (n + 1) / 2);
  EXPECT_EQ(c.all_reduce_sum(int64_t(1) << 40), n << 40);
  EXPECT_EQ(c.all_reduce_sum(-3 * (me + 1)), -3 * n * (n + 1) / 2);
  EXPECT_EQ(c.all_reduce_sum(0), 0);
  EXPECT_EQ(c.all_reduce_max(me), n - 1);
  EXPECT_EQ(c.all_reduce_max(-100 - me), -100);
  EXPECT_EQ(c.all_reduce_max(me == n / 2 ? INT64_MAX : INT64_MIN), INT64_MAX);
  int64_t want = INT64_MIN;
  for (int64_t r = 0; r < n; ++r) want = std::max(want, (r * 7 + 3) % n - 5);
  EXPECT_EQ(c.all_reduce_max((me * 7 + 3) % n - 5), want);
}

/// Strings of varied lengths (empty, with NUL bytes, one of 1 MiB) gathered on every rank.
inline void all_gather_strings(Communicator& c, uint64_t seed) {
  const int n = c.size(), me = c.rank();
  auto make = [&](int r) {
    std::mt19937_64 rng(seed + uint64_t(r) * 7919);
    const uint64_t kind = rng() % 4;
    size_t len = kind == 0 ? 0 : kind == 1 ? 1 : size_t(rng() % 1000);
    if (r == n / 2) len = size_t(1) << 20;
    std::string s(len, '\0');
    for (auto& ch : s) ch = char(rng() % 256);  // includes NUL
    return s;
  };
  const auto got = c.all_gather_strings(make(me));
  EXPECT_EQ(got.size(), size_t(n));
  for (int r = 0; r < n && r < int(got.size()); ++r) {
    EXPECT_TRUE(got[size_t(r)] == make(r))
        << "[rank " << me << "] string from rank " << r << " differs (length "
        << got[size_t(r)].size() << ", want " << make(r).size() << ")";
  }
  // All empty.
  const auto empties = c.all_gather_strings("");
  EXPECT_EQ(empties, std::vector<std::string>(size_t(n)));
}

/// barrier blocks until every rank has entered: rank 0 enters late, and everyone measures.
inline void barrier(Communicator& c) {
  const int n = c.size(), me = c.rank();
  for (int i = 0; i < 3; ++i) c.barrier();
  if (n == 1) return;
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  if (me == 0) std::this_thread::sleep_for(std::chrono::milliseconds(400));
  c.barrier();
  const double ms = std::chrono::duration<double, std::milli>(clock::now() - t0).count();
  EXPECT_GE(ms, 200.0) << "[rank " << me << "] left the barrier before rank 0 entered it";
}

}  // namespace reshard::conformance
