// explicit_layout: layouts given box by box (DCP chunks, FSDP2 / DTensor local shards), and plans
// between them. Pure: in-memory buffers filled with a known value per element.
#include <gtest/gtest.h>

#include "reshard/layout.h"
#include "reshard/plan.h"
#include "reshard/simulate.h"
#include "unit/core_harness.h"
#include "unit/test_util.h"

namespace reshard {
namespace {

using testing::MemCheckpoint;

// dim 0 of each tensor cut as torch.chunk cuts it over `world` ranks (FSDP2's Shard(0)).
Layout chunked(const std::vector<ExplicitArray>& arrays, int world) {
  std::vector<ExplicitBuffer> bufs;
  for (size_t a = 0; a < arrays.size(); ++a) {
    const int64_t rows = arrays[a].shape[0], per = (rows + world - 1) / world;
    for (int r = 0; r < world; ++r) {
      const int64_t lo = std::min(rows, per * r), hi = std::min(rows, per * (r + 1));
      if (hi == lo) continue;
      ExplicitBuffer b;
      b.name = arrays[a].tensor + "/" + state_kind_name(arrays[a].state);
      b.rank = r;
      b.array = int32_t(a);
      b.offsets.assign(arrays[a].shape.size(), 0);
      b.sizes = arrays[a].shape;
      b.offsets[0] = lo;
      b.sizes[0] = hi - lo;
      bufs.push_back(b);
    }
  }
  Topology t;
  t.dp = world;
  return explicit_layout("test", t, arrays, bufs);
}

const std::vector<ExplicitArray> kArrays = {
    {"emb.weight", StateKind::kWeight, {37, 8}},  // 37 rows: uneven at every world size here
    {"emb.weight", StateKind::kExpAvg, {37, 8}},
    {"tiny", StateKind::kWeight, {3}},            // fewer rows than ranks: empty shards
    {"w13.weight", StateKind::kWeight, {12, 8}},
};

TEST(ExplicitLayout, ChunksReCutBetweenWorldSizesAreExact) {
  for (int from : {4, 3}) {
    const Layout S = chunked(kArrays, from);
    MemCheckpoint src(S);
    src.fill_truth(S);
    for (int to : {1, 2, 3, 8}) {
      const Layout T = chunked(kArrays, to);
      const Plan p = make_plan(src.as_source(S), T);
      EXPECT_EQ(p.bytes_to_read, p.bytes_needed) << from << "->" << to;
      EXPECT_EQ(p.bytes_needed, uint64_t((37 * 8 * 2 + 3 + 12 * 8) * 4));
      MemCheckpoint dst(T);
      simulate_plan(p, T, src.reader(), dst.ptrs());
      std::string why;
      EXPECT_EQ(testing::check_truth(T, dst, 1 << 30, &why), 0) << from << "->" << to << ": " << why;
      EXPECT_NE(p.change.find("re-cut box by box"), std::string::npos) << p.change;
    }
  }
}

TEST(ExplicitLayout, MissingChunkIsNamedUncovered) {
  Layout S = chunked(kArrays, 4);
  MemCheckpoint src(S);
  SourceLayout s = src.as_source(S);
  // The chunk of emb.weight rows [10, 20) is in a file that is missing.
  for (size_t b = 0; b < S.buffers.size(); ++b)
    if (S.buffers[b].rank == 1 && S.buffers[b].name == "emb.weight/weight") s.locations[b].file = -1;
  const Layout T = chunked(kArrays, 2);
  const std::vector<CoverageGap> gaps = find_coverage_gaps(s, T);
  // The gap may be reported per target box it falls in; together: rows [10, 20), every column.
  ASSERT_FALSE(gaps.empty());
  int64_t elements = 0;
  for (const CoverageGap& g : gaps) {
    EXPECT_EQ(g.tensor, "emb.weight");
    EXPECT_EQ(g.state, StateKind::kWeight);
    EXPECT_GE(g.region.off[0], 10);
    EXPECT_LE(g.region.off[0] + g.region.len[0], 20);
    elements += g.region.numel();
  }
  EXPECT_EQ(elements, 10 * 8);
  try {
    make_plan(s, T);
    FAIL() << "planned over a gap";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kDataLoss);
    EXPECT_NE(std::string(e.what()).find("emb.weight"), std::string::npos) << e.what();
  }
}

TEST(ExplicitLayout, RefusesBadBoxesByName) {
  Topology t;
  t.dp = 2;
  auto refuse = [&](std::vector<ExplicitArray> arrays, std::vector<ExplicitBuffer> bufs, const char* want) {
    try {
      explicit_layout("ckpt", t, arrays, bufs);
      ADD_FAILURE() << "accepted; wanted " << want;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  };
  const std::vector<ExplicitArray> a = {{"x", StateKind::kWeight, {4, 2}}};
  refuse(a, {{"b", 0, DType::F32, 0, {3, 0}, {2, 2}}}, "outside x's 4");
  refuse(a, {{"b", 2, DType::F32, 0, {0, 0}, {2, 2}}}, "rank outside [0, 2)");
  refuse(a, {{"b", 0, DType::F32, 1, {0, 0}, {2, 2}}}, "names tensor index 1");
  refuse(a, {{"b", 0, DType::F32, 0, {0}, {2}}}, "of 2 dims");
  refuse(a, {{"b", 0, DType::F32, 0, {0, 0}, {2, 2}}, {"b", 0, DType::F32, 0, {2, 0}, {2, 2}}}, "listed twice");
  refuse({{"x", StateKind::kWeight, {}}}, {}, "has 0 dims");
  refuse({{"x", StateKind::kWeight, {4}}, {"x", StateKind::kWeight, {4}}}, {}, "listed twice");
}

}  // namespace
}  // namespace reshard
