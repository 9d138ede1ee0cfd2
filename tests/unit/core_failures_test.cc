// The layout parts of the public failure reports in shared/research/failures.md, as named tests.
// Fused layouts are checked against row orders written out here independently of the planner's
// logical views (Megatron semantics from formats.md §4.3-4.5), so a wrong view cannot pass.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>

#include "reshard/model.h"
#include "reshard/simulate.h"
#include "unit/core_harness.h"

namespace reshard {
namespace {

using testing::MemCheckpoint;

ModelConfig base_model() {
  ModelConfig m;
  m.name = "t";
  m.num_layers = 2;
  m.hidden = 32;
  m.heads = 8;
  m.ffn = 16;
  m.vocab = 64;
  m.vocab_divisible_by = 1;
  m.param_dtype = DType::F32;
  m.bias = false;
  return m;
}

Layout weights_layout(const ModelConfig& m, const std::string& topo, bool dp0_only = false) {
  DeriveOptions o;
  o.optimizer = false;
  o.weights_on_dp0_only = dp0_only;
  return derive_layout(m, Topology::parse(topo), o);
}

float* weight_ptr(const Layout& L, MemCheckpoint& mem, int rank, const std::string& tensor) {
  int b = L.find_buffer(rank, "weight/" + tensor);
  EXPECT_GE(b, 0) << tensor << " on rank " << rank;
  return b < 0 ? nullptr : reinterpret_cast<float*>(mem.bufs[b].data());
}

// Fills/checks a 2-D row-split weight: local row i of rank r holds global fused row rows(r)[i],
// element (row, col) = row * 1000 + col.
using RowMap = std::function<std::vector<int64_t>(int tp_rank)>;

void fill_rows(const Layout& L, MemCheckpoint& mem, const std::string& tensor, int64_t H, const RowMap& rows) {
  for (int r = 0; r < L.topo.world_size(); ++r) {
    if (L.topo.dp_rank(r) != 0) continue;
    float* p = weight_ptr(L, mem, r, tensor);
    if (!p) continue;
    auto ids = rows(L.topo.tp_rank(r));
    for (size_t i = 0; i < ids.size(); ++i)
      for (int64_t c = 0; c < H; ++c) p[i * H + c] = float(ids[i] * 1000 + c);
  }
}

void expect_rows(const Layout& L, MemCheckpoint& mem, const std::string& tensor, int64_t H, const RowMap& rows) {
  for (int r = 0; r < L.topo.world_size(); ++r) {
    float* p = weight_ptr(L, mem, r, tensor);
    if (!p) continue;
    auto ids = rows(L.topo.tp_rank(r));
    for (size_t i = 0; i < ids.size(); ++i)
      for (int64_t c = 0; c < H; ++c)
        ASSERT_EQ(p[i * H + c], float(ids[i] * 1000 + c))
            << tensor << " rank " << r << " local row " << i << " col " << c << " want fused row " << ids[i];
  }
}

void run(const Layout& src, MemCheckpoint& ms, const Layout& dst, MemCheckpoint& md, PlanOptions o = {}) {
  Plan p = make_plan(ms.as_source(src), dst, o);
  simulate_plan(p, dst, ms.reader(), md.ptrs());
}

// SwiGLU dense_h_to_4h: rank r holds [gate_r; up_r] [formats.md §4.5].
RowMap swiglu_rows(int64_t F, int tp) {
  return [=](int r) {
    std::vector<int64_t> v;
    int64_t n = F / tp;
    for (int64_t i = 0; i < n; ++i) v.push_back(r * n + i);
    for (int64_t i = 0; i < n; ++i) v.push_back(F + r * n + i);
    return v;
  };
}

// Fused QKV version >= 2 with query groups: per group [q heads..., k, v] x head_dim; tp splits
// whole groups [formats.md §4.4].
RowMap gqa_rows(int64_t ng, int64_t q, int64_t hn, int tp) {
  return [=](int r) {
    std::vector<int64_t> v;
    int64_t per = ng / tp;
    for (int64_t g = r * per; g < (r + 1) * per; ++g)
      for (int64_t k = 0; k < (q + 2) * hn; ++k) v.push_back(g * (q + 2) * hn + k);
    return v;
  };
}

// tp > groups, replicate_kv: rank t holds its q/(tp/ng) query heads, then a copy of its group's K and V.
RowMap replicate_kv_rows(int64_t ng, int64_t q, int64_t hn, int tp) {
  return [=](int t) {
    std::vector<int64_t> v;
    int64_t per = tp / ng, qq = q / per, g = t / per, j = t % per;
    for (int64_t h = j * qq; h < (j + 1) * qq; ++h)
      for (int64_t d = 0; d < hn; ++d) v.push_back((g * (q + 2) + h) * hn + d);
    for (int64_t s = q; s < q + 2; ++s)
      for (int64_t d = 0; d < hn; ++d) v.push_back((g * (q + 2) + s) * hn + d);
    return v;
  };
}

TEST(FailureB08, SwigluGateUpSurvivesTp4ToTp1AndTp2) {
  ModelConfig m = base_model();
  m.swiglu = true;
  const std::string t = "layers.0.mlp.dense_h_to_4h.weight";
  Layout a = weights_layout(m, "tp=4,dp=1");
  MemCheckpoint ma(a);
  fill_rows(a, ma, t, m.hidden, swiglu_rows(m.ffn, 4));
  for (int tp : {1, 2}) {
    Layout b = weights_layout(m, "tp=" + std::to_string(tp) + ",dp=1");
    MemCheckpoint mb(b);
    run(a, ma, b, mb);
    expect_rows(b, mb, t, m.hidden, swiglu_rows(m.ffn, tp));
  }
  // A naive concatenation of rank blocks would put up_0 at rows F/4..F/2: make sure it is not.
  Layout one = weights_layout(m, "tp=1,dp=1");
  MemCheckpoint mo(one);
  run(a, ma, one, mo);
  EXPECT_EQ(weight_ptr(one, mo, 0, t)[(m.ffn / 4) * m.hidden], float((m.ffn / 4) * 1000));
}

TEST(FailureB09, RuleThatMatchesNothingIsAnError) {
  ModelConfig m = base_model();
  m.rules.push_back({R"(layers\.\d+\.self_attn\.dense\.weight)", Split::kRow});  // the typo of the report
  try {
    model_tensors(m, 1);
    FAIL() << "a rule matching nothing must be refused";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("matches no tensor"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("self_attn"), std::string::npos) << e.what();
  }
  m.rules.back().pattern = R"(layers\.\d+\.self_attention\.dense\.weight)";
  EXPECT_NO_THROW(model_tensors(m, 1));
}

TEST(FailureB12, MqaKeyValueIsCopiedNotConcatenated) {
  ModelConfig m = base_model();
  m.heads = 8;
  m.hidden = 32;  // head_dim 4
  m.query_groups = 1;
  m.tp_gt_groups = QkvVariant::kReplicateKv;
  const std::string t = "layers.0.self_attention.query_key_value.weight";
  Layout a = weights_layout(m, "tp=4,dp=1");
  MemCheckpoint ma(a);
  fill_rows(a, ma, t, m.hidden, replicate_kv_rows(1, 8, 4, 4));
  // Each tp=4 rank holds 2 query heads + the shared K and V: 16 rows.
  EXPECT_EQ(a.buffers[a.find_buffer(0, "weight/" + t)].numel, 16 * m.hidden);
  Layout one = weights_layout(m, "tp=1,dp=1");
  MemCheckpoint mo(one);
  run(a, ma, one, mo);
  // Merged: 8 query heads + ONE K + ONE V = 40 rows of 32 (K and V each [4, 32], not [16, 32]).
  EXPECT_EQ(one.buffers[one.find_buffer(0, "weight/" + t)].numel, 40 * m.hidden);
  expect_rows(one, mo, t, m.hidden, gqa_rows(1, 8, 4, 1));
  for (int tp : {2, 4}) {
    Layout b = weights_layout(m, "tp=" + std::to_string(tp) + ",dp=1");
    MemCheckpoint mb(b);
    run(one, mo, b, mb);
    expect_rows(b, mb, t, m.hidden, replicate_kv_rows(1, 8, 4, tp));
  }
  // The K/V copies on the four source ranks are replicas: they are compared, and a difference is
  // reported with the tensor name and the max |diff|.
  float* kv1 = weight_ptr(a, ma, 1, t) + 2 * 4 * m.hidden;  // rank 1's K block
  kv1[3] += 0.5f;
  Plan p = make_plan(ma.as_source(a), one);
  EXPECT_GE(p.replica_compares.size(), 3u);
  try {
    simulate_plan(p, one, ma.reader(), mo.ptrs(), ReplicaPolicy::kError);
    FAIL() << "diverged K copy must be reported";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kDataLoss);
    EXPECT_NE(std::string(e.what()).find(t), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("max |diff| 0.5"), std::string::npos) << e.what();
  }
  // Policy first: rank 0's copy loads; the difference is still reported.
  {
    PlanOptions o;
    o.replica_policy = ReplicaPolicy::kFirst;
    Plan pf = make_plan(ma.as_source(a), one, o);
    MemCheckpoint mf(one);
    auto res = simulate_plan(pf, one, ma.reader(), mf.ptrs(), ReplicaPolicy::kFirst);
    double worst = 0;
    for (const auto& r : res) worst = std::max(worst, r.max_abs_diff);
    EXPECT_EQ(worst, 0.5);
    expect_rows(one, mf, t, m.hidden, gqa_rows(1, 8, 4, 1));
  }
  // Policy average: the merged K block is the mean of the four saved copies (three agree, one is
  // 0.5 higher at one element: +0.125 there), every other element exactly as saved.
  {
    PlanOptions o;
    o.replica_policy = ReplicaPolicy::kAverage;
    Plan pa = make_plan(ma.as_source(a), one, o);
    EXPECT_FALSE(pa.replica_sources.empty());
    MemCheckpoint mav(one);
    simulate_plan(pa, one, ma.reader(), mav.ptrs(), ReplicaPolicy::kAverage);
    const float* merged = weight_ptr(one, mav, 0, t);
    ASSERT_NE(merged, nullptr);
    auto rows = gqa_rows(1, 8, 4, 1)(0);
    const int64_t k_row0 = 8 * 4;  // K rows follow the 8 query heads of 4 rows
    for (size_t i = 0; i < rows.size(); ++i)
      for (int64_t c = 0; c < m.hidden; ++c) {
        float want = float(rows[i] * 1000 + c);
        if (int64_t(i) == k_row0 && c == 3) want += 0.125f;
        ASSERT_EQ(merged[i * m.hidden + c], want) << "row " << i << " col " << c;
      }
    // Reads: the load's bytes plus every other copy that was averaged in.
    uint64_t replica_bytes = 0;
    for (const auto& r : pa.replica_sources) replica_bytes += r.bytes();
    EXPECT_EQ(pa.bytes_to_read, pa.bytes_needed + replica_bytes);
  }
}

TEST(ReplicaAverage, BitsOfTheMeanForEachFloatTypeAndPartialCopies) {
  // Copies that agree give the same bits for every float type; copies that differ give the mean
  // rounded once to the saved dtype. Replica boxes that cover only part of a fragment average only
  // where they hold elements.
  for (DType dt : {DType::F32, DType::BF16, DType::F16, DType::F64}) {
    SCOPED_TRACE(dtype_name(dt));
    // One 1-D array of 8 elements saved by three "files": file 0 whole, file 1 whole, file 2 holds
    // elements [2, 6) only.
    const int64_t n = 8;
    std::vector<std::vector<double>> vals = {{1, 2, 3, 4, 5, 6, 7, 8},
                                             {1, 2, 3.5, 4, 5, 6, 7, 9},
                                             {0, 0, 4.25, 4, -5, 6, 0, 0}};
    std::vector<std::vector<uint8_t>> files(3, std::vector<uint8_t>(n * dtype_size(dt)));
    for (int f = 0; f < 3; ++f) convert_elements(vals[f].data(), DType::F64, files[f].data(), dt, n);
    ReadFn read = [&](int32_t file, uint64_t off, uint64_t len, void* dst) {
      std::memcpy(dst, files[file].data() + off, len);
    };
    Plan plan;
    Fragment f;
    f.box.ndim = 1;
    f.box.off[0] = 0;
    f.box.len[0] = n;
    f.src_strides[0] = 1;
    f.src_dtype = dt;
    f.num_replicas = 2;
    ReplicaSource r1{f.box, 1, 0, f.src_strides, dt};
    ReplicaSource r2 = r1;
    r2.file = 2;
    r2.box.off[0] = 2;
    r2.box.len[0] = 4;
    r2.byte_base = 2 * dtype_size(dt);
    plan.replica_sources = {r1, r2};
    std::vector<uint8_t> packed = files[0];
    EXPECT_EQ(average_replicas(plan, f, read, packed.data()), r1.bytes() + r2.bytes());
    std::vector<double> got(n);
    convert_elements(packed.data(), dt, got.data(), DType::F64, n);
    const std::vector<double> want = {1, 2, (3 + 3.5 + 4.25) / 3, 4, (5 + 5 - 5) / 3.0, 6, 7, 8.5};
    for (int64_t i = 0; i < n; ++i) {
      // The expected mean rounded to dt the same way (via fp32 for the 16-bit types).
      std::vector<uint8_t> one(dtype_size(dt));
      convert_elements(&want[i], DType::F64, one.data(), dt, 1);
      double w;
      convert_elements(one.data(), dt, &w, DType::F64, 1);
      EXPECT_EQ(got[i], w) << "element " << i;
    }
    EXPECT_EQ(got[0], 1.0);
    EXPECT_EQ(got[3], 4.0);
  }
}

TEST(FailureB13, GqaFusedQkvKeepsGroupsAndRefusesAnMhaModel) {
  ModelConfig m = base_model();
  m.hidden = 64;
  m.heads = 8;  // head_dim 8
  m.query_groups = 2;
  m.tp_gt_groups = QkvVariant::kReplicateKv;
  const std::string t = "layers.1.self_attention.query_key_value.weight";
  Layout a = weights_layout(m, "tp=2,dp=1");
  // At tp=2 each rank holds one group: (4 q + k + v) * 8 = 48 rows.
  EXPECT_EQ(a.buffers[a.find_buffer(0, "weight/" + t)].numel, 48 * 64);
  MemCheckpoint ma(a);
  fill_rows(a, ma, t, m.hidden, gqa_rows(2, 4, 8, 2));
  Layout one = weights_layout(m, "tp=1,dp=1");
  MemCheckpoint mo(one);
  run(a, ma, one, mo);
  expect_rows(one, mo, t, m.hidden, gqa_rows(2, 4, 8, 1));
  Layout four = weights_layout(m, "tp=4,dp=1");  // fewer KV heads than ranks: K/V replicated
  MemCheckpoint mf(four);
  run(a, ma, four, mf);
  expect_rows(four, mf, t, m.hidden, replicate_kv_rows(2, 4, 8, 4));
  // A model that says MHA (8 groups: 3*64/2 = 96 rows per rank) disagrees with the checkpoint.
  ModelConfig mha = m;
  mha.query_groups = 0;
  try {
    make_plan(ma.as_source(a), weights_layout(mha, "tp=2,dp=1"));
    FAIL() << "GQA checkpoint into an MHA model must be refused";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("query_key_value"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("[2, 6, 8, 64]"), std::string::npos) << e.what();
  }
}

TEST(FailureB13, QkvCheckpointVersionsZeroAndOneBecomeVersionThree) {
  // MHA, 8 heads of 4; tp=2 -> np = 4 heads per rank.
  ModelConfig m = base_model();
  const int64_t hn = 4, np = 4, H = m.hidden;
  const std::string t = "layers.0.self_attention.query_key_value.weight";
  for (double version : {0.0, 1.0}) {
    ModelConfig old = m;
    old.qkv_version = version;
    Layout a = weights_layout(old, "tp=2,dp=1");
    MemCheckpoint ma(a);
    fill_rows(a, ma, t, H, [&](int r) {
      std::vector<int64_t> v;  // global v3 row id of each local row
      for (int64_t i = 0; i < 3 * np * hn; ++i) {
        int64_t s, h, d;
        if (version == 0.0) { s = i / (np * hn); h = (i / hn) % np; d = i % hn; }   // [3, np, hn]
        else { h = i / (hn * 3); d = (i / 3) % hn; s = i % 3; }                     // [np, hn, 3]
        v.push_back(((r * np + h) * 3 + s) * hn + d);
      }
      return v;
    });
    Layout one = weights_layout(m, "tp=1,dp=1");  // version 3 model
    MemCheckpoint mo(one);
    run(a, ma, one, mo);
    expect_rows(one, mo, t, H, gqa_rows(8, 1, hn, 1));
  }
}

TEST(FailureB14, VocabRowsGoToTheirRankAtTp2AndTp4) {
  ModelConfig m = base_model();
  m.hidden = 8;
  m.heads = 4;
  m.vocab = 64;
  m.vocab_divisible_by = 1;
  for (const char* t : {"embedding.word_embeddings.weight", "lm_head.weight"}) {
    Layout a = weights_layout(m, "tp=1,dp=1");
    MemCheckpoint ma(a);
    fill_rows(a, ma, t, 8, [](int) { std::vector<int64_t> v(64); for (int i = 0; i < 64; ++i) v[i] = i; return v; });
    for (int tp : {2, 4}) {
      Layout b = weights_layout(m, "tp=" + std::to_string(tp) + ",dp=1");
      MemCheckpoint mb(b);
      run(a, ma, b, mb);
      expect_rows(b, mb, t, 8, [&](int r) {
        std::vector<int64_t> v;
        for (int64_t i = 0; i < 64 / tp; ++i) v.push_back(r * (64 / tp) + i);  // rank r: rows [16r, 16r+16) at tp 4
        return v;
      });
    }
  }
  // vocab 62 padded to a multiple of 8*tp: rows >= 62 are padding, marked as such.
  m.vocab = 62;
  m.vocab_divisible_by = 8;
  Layout b = weights_layout(m, "tp=4,dp=1");
  int e = b.find_array("embedding.word_embeddings.weight", StateKind::kWeight);
  EXPECT_EQ(b.arrays[e].shape[0], 64);
  EXPECT_EQ(b.arrays[e].real_rows, 62);
}

TEST(FailureB15, TiedEmbeddingAcrossPipelineStages) {
  ModelConfig m = base_model();
  m.num_layers = 4;
  m.vocab = 16;
  m.hidden = 8;
  m.heads = 2;
  m.ffn = 8;
  m.tied_embeddings = true;
  m.param_dtype = DType::BF16;
  const std::string emb = "embedding.word_embeddings.weight";
  Layout a = derive_layout(m, Topology::parse("pp=1,dp=1"));
  MemCheckpoint ma(a);
  ma.fill_truth(a);
  for (const char* topo : {"pp=2,dp=1", "pp=4,dp=1", "pp=2,vpp=2,dp=1"}) {
    SCOPED_TRACE(topo);
    Layout b = derive_layout(m, Topology::parse(topo));
    MemCheckpoint mb(b);
    run(a, ma, b, mb);
    std::string why;
    EXPECT_EQ(testing::check_truth(b, mb, 16, &why), 0) << why;
    const int pp = b.topo.pp;
    for (const char* state : {"weight", "fp32", "exp_avg", "exp_avg_sq"}) {
      std::string name = std::string(state) + "/" + emb;
      int first = b.find_buffer(0, name), last = b.find_buffer(pp - 1, name);
      ASSERT_GE(first, 0);
      ASSERT_GE(last, 0);
      if (b.topo.zero == 0) {
        EXPECT_EQ(mb.bufs[first], mb.bufs[last]) << name;  // bitwise equal copies
      }
      for (int s = 1; s < pp - 1; ++s) EXPECT_LT(b.find_buffer(s, name), 0) << "middle stage " << s << " holds " << name;
    }
  }
}

TEST(FailureB16, PaddedVocabIsAGlobalShapeNotMultipliedByTp) {
  ModelConfig m = base_model();
  m.vocab = 10;
  m.hidden = 4;
  m.heads = 2;
  m.vocab_divisible_by = 8;
  EXPECT_EQ(m.padded_vocab(1), 16);
  EXPECT_EQ(m.padded_vocab(2), 16);  // a multiple of 8*2 = 16, not 32
  Layout b = weights_layout(m, "tp=2,dp=1");
  EXPECT_EQ(b.arrays[b.find_array("embedding.word_embeddings.weight", StateKind::kWeight)].shape[0], 16);
  EXPECT_EQ(b.buffers[b.find_buffer(1, "weight/embedding.word_embeddings.weight")].numel, 8 * 4);  // [8, 4] per rank
}

// Runs fn, which must throw reshard::Error with `code` and a message containing `part`.
template <typename Fn>
void expect_error(ErrorCode code, const std::string& part, Fn fn) {
  try {
    fn();
    ADD_FAILURE() << "expected an error containing: " << part;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

TEST(FailureB24, VocabNotDivisibleByTpReloadsAtTp1AndTp4) {
  ModelConfig m = base_model();
  m.vocab = 13;
  m.hidden = 4;
  m.heads = 4;
  m.vocab_divisible_by = 1;
  const std::string t = "embedding.word_embeddings.weight";
  Layout a = weights_layout(m, "tp=2,dp=1");  // padded to 14
  EXPECT_EQ(a.arrays[a.find_array(t, StateKind::kWeight)].shape[0], 14);
  MemCheckpoint ma(a);
  fill_rows(a, ma, t, 4, [](int r) { std::vector<int64_t> v; for (int i = 0; i < 7; ++i) v.push_back(r * 7 + i); return v; });
  Layout one = weights_layout(m, "tp=1,dp=1");  // exactly 13 rows: the padding row is dropped
  MemCheckpoint mo(one);
  Plan p = make_plan(ma.as_source(a), one);
  simulate_plan(p, one, ma.reader(), mo.ptrs());
  EXPECT_EQ(one.buffers[one.find_buffer(0, "weight/" + t)].numel, 13 * 4);
  expect_rows(one, mo, t, 4, [](int) { std::vector<int64_t> v; for (int i = 0; i < 13; ++i) v.push_back(i); return v; });
  // The drop is a warning that says how many rows and which divisor keeps them (ceil(13/2)*2 = 14).
  ASSERT_EQ(p.warnings.size(), 1u);
  EXPECT_NE(p.warnings[0].find("pads vocab 13 to 14 rows, the target to 13"), std::string::npos) << p.warnings[0];
  EXPECT_NE(p.warnings[0].find("1 trained padding row(s) of embedding.word_embeddings.weight, lm_head.weight dropped"), std::string::npos)
      << p.warnings[0];
  EXPECT_NE(p.warnings[0].find("--make-vocab-size-divisible-by 2) at tp 1 keeps the 14 rows"), std::string::npos)
      << p.warnings[0];
  PlanOptions refuse;
  refuse.refuse_vocab_padding_change = true;
  expect_error(ErrorCode::kInvalidArgument, "policy vocab_padding=refuse", [&] { make_plan(ma.as_source(a), one, refuse); });
  Layout four = weights_layout(m, "tp=4,dp=1");  // 16 rows: row 13 from the source's padding, 14-15 zero
  MemCheckpoint mf(four);
  Plan p4 = make_plan(ma.as_source(a), four);
  ASSERT_EQ(p4.warnings.size(), 1u);
  EXPECT_NE(p4.warnings[0].find("2 padding row(s) of embedding.word_embeddings.weight, lm_head.weight added as zeros"), std::string::npos)
      << p4.warnings[0];
  EXPECT_NE(p4.warnings[0].find("no vocab_divisible_by gives 14 rows at tp 4"), std::string::npos) << p4.warnings[0];
  expect_error(ErrorCode::kInvalidArgument, "added as zeros", [&] { make_plan(ma.as_source(a), four, refuse); });
  // The same rows on both sides: no warning, and the policy lets it through.
  Layout two = weights_layout(m, "tp=2,dp=2");
  EXPECT_TRUE(make_plan(ma.as_source(a), two, refuse).warnings.empty());
  run(a, ma, four, mf);
  float* r3 = weight_ptr(four, mf, 3, t);  // rows 12..15
  for (int c = 0; c < 4; ++c) {
    EXPECT_EQ(r3[0 * 4 + c], float(12 * 1000 + c));
    EXPECT_EQ(r3[1 * 4 + c], float(13 * 1000 + c)) << "padding row present on both sides is copied";
    EXPECT_EQ(r3[2 * 4 + c], 0.f);
    EXPECT_EQ(r3[3 * 4 + c], 0.f);
  }
}

TEST(FailureB24, DivisorForRowsReproducesMegatronPadding) {
  EXPECT_EQ(divisor_for_rows(13, 14, 1), 2);          // ceil(13/2)*2 = 14
  EXPECT_EQ(divisor_for_rows(50257, 50432, 1), 256);  // GPT-2 at tp 2 x 128, kept at tp 1
  EXPECT_EQ(divisor_for_rows(50257, 50432, 4), 64);
  EXPECT_EQ(divisor_for_rows(50257, 50432, 8), 32);
  EXPECT_EQ(divisor_for_rows(128, 128, 4), 32);       // the largest power of two that works
  EXPECT_EQ(divisor_for_rows(13, 14, 4), 0);          // 14 rows cannot be cut in 4
  EXPECT_EQ(divisor_for_rows(13, 12, 1), 0);          // fewer rows than the vocab
  EXPECT_EQ(divisor_for_rows(10, 15, 1), 15);         // no power of two works (10, 10, 12, 16): the smallest d
  for (int64_t V : {13, 100, 50257})
    for (int tp : {1, 2, 4, 8})
      for (int64_t rows = V; rows < V + 300; ++rows)
        if (int64_t d = divisor_for_rows(V, rows, tp)) {
          ModelConfig m;
          m.vocab = V;
          m.vocab_divisible_by = int(d);
          EXPECT_EQ(m.padded_vocab(tp), rows) << V << " " << rows << " " << tp;
        }
}

// ---- flat partitions (B01, B02): custom tensors through build_layout ----

struct Mlp {
  ModelConfig cfg;
  LayoutRecipe recipe;
};

TensorSpec spec(const std::string& name, std::vector<int64_t> shape, bool nwd) {
  TensorSpec s;
  s.name = name;
  s.shape = std::move(shape);
  s.owner = Owner::kFirstStage;
  s.no_weight_decay = nwd;
  return s;
}

Mlp mlp_5_7_3() {  // B01: weights 35 + 21 = 56 in group A; biases 7 + 3 and a norm of 5 = 15 in group B
  Mlp m;
  m.cfg = base_model();
  m.recipe.tensors = {spec("fc1.weight", {7, 5}, false), spec("fc1.bias", {7}, true), spec("norm.weight", {5}, true),
                      spec("fc2.weight", {3, 7}, false), spec("fc2.bias", {3}, true)};
  m.recipe.stages.assign(m.recipe.tensors.size(), {0});
  return m;
}

TEST(FailureB01, TwoParamGroupsConsolidateExactly) {
  Mlp m = mlp_5_7_3();
  for (int zero : {1, 2}) {
    Topology a = Topology::parse("dp=4,zero=" + std::to_string(zero));
    DeriveOptions so;
    so.weights_on_dp0_only = true;
    Layout src = build_layout(m.cfg, a, m.recipe, so);
    ASSERT_EQ(src.flat_groups[0].size(), 2u);
    EXPECT_EQ(src.flat_groups[0][0].numel, 56);
    EXPECT_EQ(src.flat_groups[0][1].numel, 15);
    MemCheckpoint ms(src);
    ms.fill_truth(src);
    for (const char* t : {"dp=1,zero=0", "dp=3,zero=2", "dp=1,zero=1"}) {
      Layout dst = build_layout(m.cfg, Topology::parse(t), m.recipe);
      MemCheckpoint md(dst);
      run(src, ms, dst, md);
      std::string why;
      EXPECT_EQ(testing::check_truth(dst, md, 0, &why), 0) << t << ": " << why;
    }
  }
}

TEST(FailureB01, WeightsFromMasterAreTheDowncastMaster) {
  Mlp m = mlp_5_7_3();
  m.cfg.param_dtype = DType::BF16;
  Layout full = build_layout(m.cfg, Topology::parse("dp=2,zero=2"), m.recipe);
  // A source without 16-bit weights (as ZeRO-3 files): keep only optimizer arrays.
  Layout src = full;
  std::vector<Piece> keep;
  for (const Piece& p : src.pieces)
    if (src.arrays[p.array].state != StateKind::kWeight) keep.push_back(p);
  src.pieces = keep;
  std::vector<LogicalArray> arrays;
  MemCheckpoint ms(src);
  ms.fill_truth(src);
  SourceLayout s = ms.as_source(src);
  // Drop the weight arrays from the source so the planner falls back to the master.
  Layout dst = build_layout(m.cfg, Topology::parse("dp=1,zero=0"), m.recipe);
  for (auto& a : s.layout.arrays)
    if (a.state == StateKind::kWeight) a.tensor += ".absent";
  PlanOptions o;
  o.strict_unexpected = false;
  Plan p = make_plan(s, dst, o);
  MemCheckpoint md(dst);
  simulate_plan(p, dst, ms.reader(), md.ptrs());
  bool noted = false;
  for (const auto& n : p.notes) noted |= n.find("downcasting the checkpoint's fp32 master") != std::string::npos;
  EXPECT_TRUE(noted);
  for (const auto& t : m.recipe.tensors) {
    int wb = dst.find_buffer(0, "weight/" + t.name), mb = dst.find_buffer(0, "fp32/" + t.name);
    ASSERT_GE(wb, 0);
    ASSERT_GE(mb, 0);
    const int64_t n = dst.buffers[wb].numel;
    std::vector<uint16_t> want(n);
    convert_elements(md.bufs[mb].data(), DType::F32, want.data(), DType::BF16, n);
    EXPECT_EQ(0, std::memcmp(want.data(), md.bufs[wb].data(), n * 2)) << t.name;
  }
}

TEST(FailureB02, AlignmentComesFromTheRecipeNeverAConstant) {
  ModelConfig cfg = base_model();
  LayoutRecipe r;
  r.tensors = {spec("w", {7, 7}, false), spec("b", {7}, false), spec("gain", {}, false)};  // 49 + 7 + 1 = 57
  r.stages.assign(3, {0});
  for (int dp : {2, 3, 4, 8}) {
    for (int align : {1, 4, 2 * dp}) {
      SCOPED_TRACE("dp=" + std::to_string(dp) + " align=" + std::to_string(align));
      LayoutRecipe rr = r;
      FlatGroup g;
      g.entries = {{"w", 0, 49}, {"b", 49, 7}, {"gain", 56, 1}};
      g.numel = 57;
      int64_t padded = (57 + align - 1) / align * align;
      g.partition_size = (padded + dp - 1) / dp;
      rr.groups = {{g}};
      DeriveOptions so;
      so.weights_on_dp0_only = true;
      Layout src = build_layout(cfg, Topology::parse("dp=" + std::to_string(dp) + ",zero=2"), rr, so);
      MemCheckpoint ms(src);
      ms.fill_truth(src);
      Layout dst = build_layout(cfg, Topology::parse("dp=3,zero=2"), r);
      MemCheckpoint md(dst);
      run(src, ms, dst, md);
      std::string why;
      EXPECT_EQ(testing::check_truth(dst, md, 0, &why), 0) << why;
      // Exactly 57 values per state in the consolidated flat order.
      Layout one = build_layout(cfg, Topology::parse("dp=1,zero=1"), r);
      EXPECT_EQ(one.flat_groups[0][0].numel, 57);
    }
  }
  // A partition too small for the group: the error names the group and both counts.
  LayoutRecipe bad = r;
  FlatGroup g;
  g.entries = {{"w", 0, 49}, {"b", 49, 7}, {"gain", 56, 1}};
  g.partition_size = 14;  // 14 * 4 = 56 < 57
  bad.groups = {{g}};
  try {
    build_layout(cfg, Topology::parse("dp=4,zero=2"), bad);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("param group 0"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("14 x dp 4 < 57"), std::string::npos) << e.what();
  }
}

TEST(Coverage, MissingShardIsReportedWithTensorAndRegion) {  // B17
  ModelConfig m = base_model();
  m.hidden = 8;
  m.heads = 8;
  m.vocab = 64;
  Layout a = weights_layout(m, "tp=8,dp=1");
  MemCheckpoint ma(a);
  SourceLayout s = ma.as_source(a);
  // Only rank 0's embedding shard is registered: ranks 1-7 lose theirs.
  for (size_t b = 0; b < a.buffers.size(); ++b)
    if (a.buffers[b].rank != 0 && a.buffers[b].name == "weight/embedding.word_embeddings.weight") s.locations[b].file = -1;
  try {
    make_plan(s, weights_layout(m, "tp=1,dp=1"));
    FAIL();
  } catch (const Error& e) {
    std::string w = e.what();
    EXPECT_EQ(e.code(), ErrorCode::kDataLoss);
    EXPECT_NE(w.find("covered by no file"), std::string::npos) << w;
    EXPECT_NE(w.find("tensor embedding.word_embeddings.weight (weight): elements [8:64, 0:8]"), std::string::npos) << w;
    EXPECT_NE(w.find("weight/embedding.word_embeddings.weight of source rank 7"), std::string::npos) << w;
  }
  auto gaps = find_coverage_gaps(s, weights_layout(m, "tp=1,dp=1"));
  ASSERT_EQ(gaps.size(), 1u);
  EXPECT_EQ(gaps[0].region.off[0], 8);
  EXPECT_EQ(gaps[0].region.len[0], 56);
}

}  // namespace
}  // namespace reshard

namespace reshard {
namespace {

TEST(PartialSum, TpChangeIsRefusedNotCopied) {
  ModelConfig m = base_model();
  m.bias = true;
  m.rules.push_back({R"(layers\.\d+\.self_attention\.dense\.bias)", Split::kReplicated, Reduction::kPartialSum});
  Layout a = weights_layout(m, "tp=2,dp=1");
  MemCheckpoint ma(a);
  try {
    make_plan(ma.as_source(a), weights_layout(m, "tp=1,dp=1"));
    FAIL() << "partial_sum across a tp change must be refused";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnsupported);
    EXPECT_NE(std::string(e.what()).find("self_attention.dense.bias is declared partial_sum"), std::string::npos) << e.what();
  }
  // dp-only changes keep each tp rank's partial value where it was: rank t gets tp rank t's value
  // (the logical view has a leading tp index, so the copies are not treated as replicas).
  ma.fill_truth(a);
  Layout b = weights_layout(m, "tp=2,dp=2");
  MemCheckpoint mb(b);
  Plan p = make_plan(ma.as_source(a), b);
  for (const auto& c : p.replica_compares) EXPECT_EQ(c.tensor.find("dense.bias"), std::string::npos) << c.tensor;
  simulate_plan(p, b, ma.reader(), mb.ptrs());
  std::string why;
  EXPECT_EQ(testing::check_truth(b, mb, 1 << 30, &why), 0) << why;
  const std::string t = "weight/layers.0.self_attention.dense.bias";
  EXPECT_NE(mb.bufs[b.find_buffer(0, t)], mb.bufs[b.find_buffer(1, t)]) << "tp ranks keep distinct partial values";
  EXPECT_EQ(mb.bufs[b.find_buffer(0, t)], mb.bufs[b.find_buffer(2, t)]) << "dp replicas of tp rank 0 agree";
}

}  // namespace
}  // namespace reshard

namespace reshard {
namespace {

ModelConfig small_config() {
  ModelConfig m;
  m.name = "m";
  m.num_layers = 1;
  m.hidden = 4;
  m.ffn = 8;
  m.heads = 4;
  m.vocab = 10;
  m.vocab_divisible_by = 1;
  return m;
}

std::string validate_error(const ModelConfig& m, int tp = 0) {
  try {
    if (tp > 0)
      m.validate_for(tp, 1, 1);
    else
      m.validate();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    return e.what();
  }
  return "";
}

// A model whose counts do not fit int64 used to be planned (2520 bytes to read for a 2^64-element
// embedding) and synthesised; one of 2^60-element matrices made plan allocate without bound.
TEST(ModelLimits, CountsBeyondTheDeclaredLimitsAreRefusedNamingTheCount) {
  ModelConfig m = small_config();
  EXPECT_EQ(validate_error(m), "");
  m.vocab = int64_t(1) << 62;
  EXPECT_NE(validate_error(m).find("field vocab=4611686018427387904 exceeds the limit of 17592186044416"),
            std::string::npos);
  m.vocab = INT64_MAX;  // padded_vocab would overflow: checked before it is computed
  EXPECT_NE(validate_error(m).find("field vocab=9223372036854775807"), std::string::npos);
  m = small_config();
  m.hidden = m.ffn = 1 << 30;
  m.heads = 1;
  EXPECT_NE(validate_error(m).find("a fused QKV weight's elements = 3458764513820540928"), std::string::npos);
  m = small_config();
  m.num_layers = kMaxModelLayers + 1;
  EXPECT_NE(validate_error(m).find("num_layers = 16385 exceeds the limit of 16384"), std::string::npos);
  // The limit itself: parameters summed over every tensor (untied head counted).
  m = small_config();
  m.hidden = 4;
  m.heads = 4;
  m.ffn = 4;
  m.bias = false;
  m.vocab = (int64_t(1) << 41) - 1024;  // 2 x 4 x vocab = 2^44 - 8192, plus one small layer and norms
  EXPECT_EQ(validate_error(m), "");
  m.vocab = int64_t(1) << 41;
  EXPECT_NE(validate_error(m).find("the model's parameters = "), std::string::npos);
  // At a topology: the vocab padded for tp is checked again.
  m.vocab = (int64_t(1) << 41) - (int64_t(1) << 31);
  m.vocab_divisible_by = 1 << 30;
  EXPECT_EQ(validate_error(m, 1), "");
  EXPECT_NE(validate_error(m, 4).find("model 'm' at tp=4: the model's parameters = "), std::string::npos);
  EXPECT_THROW(model_tensors(m, 4), Error);
}

TEST(ModelLimits, ModelDifferencesNamesEveryFieldThatDecidesShapesAndCuts) {
  ModelConfig a = small_config(), b = small_config();
  b.name = "other";
  EXPECT_EQ(model_differences(a, b), "");
  b.hidden = 8;
  b.swiglu = true;
  b.param_dtype = DType::F32;
  EXPECT_EQ(model_differences(a, b), "hidden 4 vs 8; swiglu false vs true; param_dtype BF16 vs F32");
  b = small_config();
  b.query_groups = 2;
  b.qkv_order = "blocked";
  EXPECT_EQ(model_differences(a, b), "query_groups 4 vs 2; qkv_order interleaved vs blocked");
  // A qkv order only one side states is not a contradiction (a model file that leaves it out).
  a.qkv_order = "blocked";
  b = small_config();
  EXPECT_EQ(model_differences(a, b), "");
}

}  // namespace
}  // namespace reshard
