// Planning time for large jobs (every rank's plan is the one global plan). Run:
//   build/bin/plan_bench [--benchmark_filter=NAME]
// The figures are recorded in docs/benchmarks.md; nothing here asserts a time. Cases named
// `nodes_of_8` plan as load() does on machines of 8 ranks (PlanOptions::rank_node, node-local
// reads) and add model_traffic's figures at kLinkGBps per machine and direction (one 400 Gb/s
// NIC) and kReadGBps of storage reads per machine: a model of where a resume's time goes, not a
// measurement. peak_rss_GB is the process's peak so far (run one case per process to read it).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <sys/resource.h>

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

constexpr double kLinkGBps = 50.0;
constexpr double kReadGBps = 10.0;

void plan_case(benchmark::State& state, const char* model, const char* src, const char* tgt, int ranks_per_node) {
  reshard::ModelConfig m = reshard::load_model_config(std::string(RESHARD_SOURCE_DIR) + "/configs/models/" + model);
  reshard::Topology a = reshard::Topology::parse(src), b = reshard::Topology::parse(tgt);
  for (auto _ : state) {
    // Everything a rank does before executing: both layouts and the plan.
    auto s = source_for(m, a);
    auto t = reshard::derive_layout(m, b);
    reshard::PlanOptions po;
    if (ranks_per_node > 0)
      for (int r = 0; r < b.world_size(); ++r) po.rank_node.push_back(r / ranks_per_node);
    auto p = reshard::make_plan(s, t, po);
    benchmark::DoNotOptimize(p.fragments.data());
    state.counters["fragments"] = double(p.fragments.size());
    state.counters["deliveries"] = double(p.deliveries.size());
    state.counters["waves"] = p.num_waves;
    state.counters["GB_read"] = p.bytes_to_read / 1e9;
    state.counters["GB_exchanged"] = p.bytes_to_exchange / 1e9;
    if (ranks_per_node > 0) {
      state.PauseTiming();
      const reshard::TrafficModel tm = reshard::model_traffic(p, po.rank_node, kLinkGBps * 1e9, kReadGBps * 1e9);
      uint64_t busiest = 0;
      for (const auto& w : tm.waves) busiest = std::max(busiest, w.max_link_bytes);
      state.counters["GB_between_machines"] = tm.bytes_between_machines / 1e9;
      state.counters["GB_busiest_link_wave"] = busiest / 1e9;
      state.counters["model_exchange_s"] = tm.exchange_seconds;
      state.counters["model_read_s"] = tm.read_seconds;
      state.ResumeTiming();
    }
  }
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  state.counters["peak_rss_GB"] = double(u.ru_maxrss) * 1024 / 1e9;
}

}  // namespace

BENCHMARK_CAPTURE(plan_case, gpt3_175b_1024_to_1024, "gpt3-175b.yaml", "tp=8,pp=16,dp=8,zero=1", "tp=4,pp=8,dp=32,zero=1", 0)
    ->Unit(benchmark::kMillisecond)->Iterations(3);
BENCHMARK_CAPTURE(plan_case, llama2_70b_64_to_128, "llama2-70b.yaml", "tp=8,pp=4,dp=2,zero=1", "tp=4,pp=4,dp=8,zero=1", 0)
    ->Unit(benchmark::kMillisecond)->Iterations(3);
BENCHMARK_CAPTURE(plan_case, gpt3_175b_1024_to_1024_nodes_of_8, "gpt3-175b.yaml", "tp=8,pp=16,dp=8,zero=1", "tp=4,pp=8,dp=32,zero=1", 8)
    ->Unit(benchmark::kMillisecond)->Iterations(3);
BENCHMARK_CAPTURE(plan_case, llama2_70b_8192_to_16384_nodes_of_8, "llama2-70b.yaml", "tp=8,pp=8,dp=64,zero=1", "tp=8,pp=16,dp=128,zero=1", 8)
    ->Unit(benchmark::kMillisecond)->Iterations(1);
BENCHMARK_MAIN();
