// Per-wave link and storage bytes of a plan (plan.h, model_traffic).
#include <algorithm>
#include <unordered_map>

#include "reshard/error.h"
#include "reshard/plan.h"

namespace reshard {

TrafficModel model_traffic(const Plan& plan, const std::vector<int32_t>& rank_node, double link_bytes_per_second,
                           double read_bytes_per_second) {
  const int W = plan.world_size;
  if (!rank_node.empty() && int(rank_node.size()) != W)
    fail(ErrorCode::kInvalidArgument, "rank_node has ", rank_node.size(), " entries for ", W, " target ranks");
  if (!(link_bytes_per_second > 0) || !(read_bytes_per_second > 0))
    fail(ErrorCode::kInvalidArgument, "traffic model rates must be positive (link ", link_bytes_per_second,
         " B/s, read ", read_bytes_per_second, " B/s)");
  // Dense machine ids 0..M-1 in order of first appearance.
  std::vector<int32_t> machine(size_t(std::max(W, 0)));
  std::unordered_map<int32_t, int32_t> id;
  for (int r = 0; r < W; ++r) {
    const int32_t key = rank_node.empty() ? r : rank_node[size_t(r)];
    machine[size_t(r)] = id.emplace(key, int32_t(id.size())).first->second;
  }
  const size_t M = id.size();
  TrafficModel out;
  out.num_machines = int(M);
  out.waves.resize(size_t(std::max(plan.num_waves, 0)));
  std::vector<uint64_t> sent(M), received(M), read(M);
  // Fragments are sorted by wave (make_plan); a wave's totals are complete when the next begins.
  auto close_wave = [&](int w) {
    WaveTraffic& t = out.waves[size_t(w)];
    for (size_t m = 0; m < M; ++m) {
      const uint64_t link = std::max(sent[m], received[m]);
      if (link > t.max_link_bytes) {
        t.max_link_bytes = link;
        t.link_machine = int32_t(m);
      }
      t.max_read_bytes = std::max(t.max_read_bytes, read[m]);
    }
    out.exchange_seconds += double(t.max_link_bytes) / link_bytes_per_second;
    out.read_seconds += double(t.max_read_bytes) / read_bytes_per_second;
    std::fill(sent.begin(), sent.end(), 0);
    std::fill(received.begin(), received.end(), 0);
    std::fill(read.begin(), read.end(), 0);
  };
  int wave = 0;
  for (const Fragment& f : plan.fragments) {
    RESHARD_CHECK(f.wave >= wave && f.wave < plan.num_waves, "fragment wave ", f.wave, " out of order or range");
    while (wave < f.wave) close_wave(wave++);
    const uint64_t bytes = f.bytes();
    const int32_t from = machine[size_t(f.reader)];
    if (!f.reread_on_node) read[size_t(from)] += bytes;
    // Deliveries are sorted by rank: each receiving rank once.
    int32_t last = -1;
    for (uint32_t k = 0; k < f.num_deliveries; ++k) {
      const int32_t r = plan.deliveries[f.first_delivery + k].rank;
      if (r == last || r == f.reader) continue;
      last = r;
      const int32_t to = machine[size_t(r)];
      if (to == from) continue;
      sent[size_t(from)] += bytes;
      received[size_t(to)] += bytes;
      out.bytes_between_machines += bytes;
    }
  }
  while (wave < plan.num_waves) close_wave(wave++);
  return out;
}

}  // namespace reshard
