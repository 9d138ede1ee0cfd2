// checksum_checks: which checksum units a load with verify="full" reads whole in its pre-flight,
// which rank does it, and which of them no fragment reads whole (cut). Pure: hand-made plans,
// then plans from the planner.
#include <gtest/gtest.h>

#include <random>

#include "reshard/layout.h"
#include "reshard/model.h"
#include "reshard/plan.h"
#include "unit/core_harness.h"
#include "unit/test_util.h"

namespace reshard {
namespace {

Fragment frag(int32_t file, uint64_t byte_base, std::initializer_list<int64_t> lens,
              std::initializer_list<int64_t> strides, int32_t reader) {
  Fragment f;
  f.file = file;
  f.byte_base = byte_base;
  f.src_dtype = DType::F32;
  f.reader = reader;
  f.box.ndim = int(lens.size());
  int d = 0;
  for (int64_t l : lens) f.box.len[d++] = l;
  d = 0;
  for (int64_t s : strides) f.src_strides[d++] = s;
  return f;
}

TEST(ChecksumChecks, WholeUnitsGoToTheirReaderCutOnesToTheLargestReader) {
  Plan p;
  p.fragments.push_back(frag(0, 0, {25}, {1}, 0));            // unit [0,100) whole, dense
  p.fragments.push_back(frag(0, 100, {10}, {1}, 1));          // unit [100,200): 40 bytes ...
  p.fragments.push_back(frag(0, 140, {15}, {1}, 2));          // ... and 60 bytes: rank 2 checks
  p.fragments.push_back(frag(0, 200, {2, 5}, {25, 1}, 3));    // strided rows in [200,320): cuts [200,300)
  const std::vector<ChecksumUnit> units = {{1, 0, 50}, {0, 200, 100}, {0, 100, 100}, {0, 0, 100}};
  std::vector<ChecksumCheck> c = checksum_checks(p, units);
  ASSERT_EQ(c.size(), 3u);  // file 1's unit is touched by nothing
  EXPECT_EQ(c[0].unit.offset, 0u);
  EXPECT_EQ(c[0].checker, 0);
  EXPECT_FALSE(c[0].cut);
  EXPECT_EQ(c[1].unit.offset, 100u);
  EXPECT_EQ(c[1].unit.length, 100u);
  EXPECT_EQ(c[1].checker, 2);
  EXPECT_TRUE(c[1].cut);
  EXPECT_EQ(c[2].unit.offset, 200u);
  EXPECT_EQ(c[2].checker, 3);
  EXPECT_TRUE(c[2].cut);
  // A unit that only a non-dense fragment covers end to end counts as cut: the reader packs it in
  // box order, not file order, and cannot check it as it goes.
  Plan q;
  q.fragments.push_back(frag(0, 0, {5, 5}, {1, 5}, 1));  // a transposed 5x5 block: bytes [0,100)
  c = checksum_checks(q, {{0, 0, 100}});
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].checker, 1);
  EXPECT_TRUE(c[0].cut);
}

TEST(ChecksumChecks, TiesGoToTheEarlierFragmentAndInterleavedUnitsAreEachChecked) {
  Plan p;
  p.fragments.push_back(frag(0, 0, {10}, {1}, 5));
  p.fragments.push_back(frag(0, 40, {10}, {1}, 4));
  std::vector<ChecksumCheck> c = checksum_checks(p, {{0, 0, 80}});
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].checker, 5);
  EXPECT_TRUE(c[0].cut);
  // Units whose spans interleave (a strided piece's span holds bytes of another piece).
  Plan q;
  q.fragments.push_back(frag(2, 60, {5}, {1}, 7));  // bytes [60,80)
  c = checksum_checks(q, {{2, 0, 100}, {2, 50, 100}, {2, 90, 5}});
  ASSERT_EQ(c.size(), 2u);
  EXPECT_EQ(c[0].unit.offset, 0u);
  EXPECT_EQ(c[1].unit.offset, 50u);
  EXPECT_EQ(c[0].checker, 7);
  EXPECT_TRUE(checksum_checks(Plan{}, {{0, 0, 10}}).empty());
  // Replica policy average: the other copies a fragment's reader reads are checked too.
  Plan r;
  r.fragments.push_back(frag(0, 0, {10}, {1}, 3));
  r.fragments[0].first_replica = 0;
  r.fragments[0].num_replicas = 1;
  ReplicaSource rs;
  rs.box.ndim = 1;
  rs.box.len[0] = 5;
  rs.file = 1;
  rs.byte_base = 20;
  rs.strides[0] = 1;
  r.replica_sources.push_back(rs);
  c = checksum_checks(r, {{0, 0, 40}, {1, 0, 100}});
  ASSERT_EQ(c.size(), 2u);
  EXPECT_EQ(c[1].unit.file, 1);
  EXPECT_EQ(c[1].checker, 3);
  EXPECT_TRUE(c[1].cut);
}

// Units = every source piece's byte span (as native checkpoints store them). For plans the planner
// makes: every unit any fragment touches is checked once, by a rank that reads it; it is marked
// cut exactly when no fragment reads it whole and dense; the identity cuts nothing.
TEST(ChecksumChecks, PlannerPlansCoverEveryTouchedUnitOnce) {
  std::mt19937_64 rng(testing::test_seed("ChecksumChecks.PlannerPlans"));
  ModelConfig m;
  m.name = "checks";
  m.num_layers = 2;
  m.hidden = 32;
  m.heads = 4;
  m.ffn = 64;
  m.vocab = 100;
  m.vocab_divisible_by = 8;
  const std::vector<std::string> topos = {"tp=1,dp=1,zero=1", "tp=2,dp=2,zero=1", "tp=4,dp=1,zero=1",
                                          "tp=1,pp=2,dp=3,zero=1", "tp=2,dp=3,zero=2"};
  int cut_cases = 0;
  for (const auto& sa : topos)
    for (const auto& sb : topos) {
      SCOPED_TRACE(sa + " -> " + sb);
      DeriveOptions so;
      so.weights_on_dp0_only = true;
      Layout A = derive_layout(m, Topology::parse(sa), so);
      Layout B = derive_layout(m, Topology::parse(sb));
      testing::MemCheckpoint ma(A);
      SourceLayout s = ma.as_source(A);
      std::vector<ChecksumUnit> units;
      for (const Piece& pc : A.pieces) {
        int64_t span = 1;
        for (int d = 0; d < pc.box.ndim; ++d) span += (pc.box.len[d] - 1) * pc.strides[d];
        const uint64_t es = dtype_size(A.buffers[pc.buffer].dtype);
        units.push_back({s.locations[pc.buffer].file, uint64_t(pc.base) * es, uint64_t(span) * es});
      }
      PlanOptions po;
      po.dedup = rng() % 2;
      Plan p = make_plan(s, B, po);
      std::vector<ChecksumCheck> c = checksum_checks(p, units);
      int ncut = 0;
      for (const ChecksumCheck& k : c) ncut += k.cut;
      if (sa == sb) {
        EXPECT_EQ(ncut, 0) << "cut units in an identity load";
      }
      cut_cases += ncut > 0;
      for (const ChecksumUnit& u : units) {
        bool touched = false, whole = false;
        std::vector<int32_t> readers;
        for (const Fragment& f : p.fragments) {
          int64_t span = 1;
          for (int d = 0; d < f.box.ndim; ++d) span += (f.box.len[d] - 1) * f.src_strides[d];
          const uint64_t lo = f.byte_base, hi = lo + uint64_t(span) * dtype_size(f.src_dtype);
          if (f.file != u.file || hi <= u.offset || lo >= u.offset + u.length) continue;
          touched = true;
          readers.push_back(f.reader);
          whole |= lo == u.offset && hi == u.offset + u.length && box_is_dense(f.box, f.src_strides);
        }
        int n = 0;
        int32_t checker = -1;
        bool cut = false;
        for (const ChecksumCheck& k : c)
          if (k.unit.file == u.file && k.unit.offset == u.offset && k.unit.length == u.length) {
            ++n;
            checker = k.checker;
            cut = k.cut;
          }
        EXPECT_EQ(n, touched ? 1 : 0) << "unit at " << u.offset << " of file " << u.file;
        if (n == 1) {
          EXPECT_EQ(cut, !whole) << "unit at " << u.offset << " of file " << u.file;
          EXPECT_NE(std::find(readers.begin(), readers.end(), checker), readers.end());
        }
      }
    }
  EXPECT_GT(cut_cases, 5) << "tp splits and ZeRO re-cuts must cut some pieces";
}

}  // namespace
}  // namespace reshard
