// Planning time for large jobs (every rank's plan is the one global plan). Run:
//   build/bin/plan_bench [--benchmark_min_time=1x]
// The figure is recorded in docs/benchmarks.md; nothing here asserts a time.
#include <benchmark/benchmark.h>

#include <chrono>

#include "reshard/config.h"
#include "reshard/plan.h"

namespace {

reshard::SourceLayout source_for(const reshard::ModelConfig& m, const reshard::Topology& t) {
  reshard::DeriveOptions so;
  so.weights_on_dp0_only = true;
  reshard::SourceLayout s;
  s.layout = reshard::derive_layout(m, t, so);
  std::vector<uint64_t> at(t.world_size(), 0);
  for (int r = 0; r < t.world_size(); ++r) s.files.push_back("rank_" + std::to_string(r));
  for (const auto& b : s.layout.buffers) {
    s.locations.push_back({int32_t(b.rank), at[b.rank]});
    at[b.rank] += uint64_t(b.numel) * reshard::dtype_size(b.dtype);
  }
  return s;
}

void plan_case(benchmark::State& state, const char* model, const char* src, const char* tgt) {
  reshard::ModelConfig m = reshard::load_model_config(std::string(RESHARD_SOURCE_DIR) + "/configs/models/" + model);
  reshard::Topology a = reshard::Topology::parse(src), b = reshard::Topology::parse(tgt);
  for (auto _ : state) {
    // Everything a rank does before executing: both layouts and the plan.
    auto s = source_for(m, a);
    auto t = reshard::derive_layout(m, b);
    auto p = reshard::make_plan(s, t);
    benchmark::DoNotOptimize(p.fragments.data());
    state.counters["fragments"] = double(p.fragments.size());
    state.counters["waves"] = p.num_waves;
    state.counters["GB_read"] = p.bytes_to_read / 1e9;
    state.counters["GB_exchanged"] = p.bytes_to_exchange / 1e9;
  }
}

}  // namespace

BENCHMARK_CAPTURE(plan_case, gpt3_175b_1024_to_1024, "gpt3-175b.yaml", "tp=8,pp=16,dp=8,zero=1", "tp=4,pp=8,dp=32,zero=1")
    ->Unit(benchmark::kMillisecond)->Iterations(3);
BENCHMARK_CAPTURE(plan_case, llama2_70b_64_to_128, "llama2-70b.yaml", "tp=8,pp=4,dp=2,zero=1", "tp=4,pp=4,dp=8,zero=1")
    ->Unit(benchmark::kMillisecond)->Iterations(3);
BENCHMARK_CAPTURE(plan_case, llama2_70b_8192_to_16384, "llama2-70b.yaml", "tp=8,pp=8,dp=64,zero=1", "tp=8,pp=16,dp=128,zero=1")
    ->Unit(benchmark::kMillisecond)->Iterations(1);
BENCHMARK_MAIN();
