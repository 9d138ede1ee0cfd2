// reshard inspect: what a checkpoint holds. The JSON is reshard::inspect_json (inspect.h: layout,
// model, tensors, files, problems from planning to tp=1 with replica comparison, notes); the CLI adds
// the world size, the state kinds and stored dtype of each tensor, data file sizes and missing files,
// and with --stats per tensor and state kind (weight, fp32, exp_avg, exp_avg_sq) the numel, mean, std
// (population, ddof 0), min, max and fraction of exact zeros over every stored element (vocab padding
// rows included), from reshard::consolidate (consolidate.h). inspect_json's own top-level "stats"
// (16-bit weights only) is kept in its schema, filled from the same pass.
#include <sys/stat.h>

#include <cmath>
#include <cstdio>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>

#include "cli/commands.h"
#include "io/parallel.h"
#include "io/file.h"
#include "reshard/checkpoint.h"
#include "reshard/consolidate.h"
#include "reshard/inspect.h"
#include "reshard/error.h"
#include "reshard/layout.h"
#include "reshard/plan.h"
#include "reshard/units.h"

namespace reshard::cli {

namespace {
struct InspectArgs {
  std::string path, model, step;
  bool json = false, stats = false;
};

using json = nlohmann::ordered_json;

json stats_of(const std::vector<float>& v) {
  json j;
  const int64_t n = int64_t(v.size());
  j["numel"] = n;
  if (n == 0) return j;
  double sum = 0, mn = INFINITY, mx = -INFINITY;
  int64_t zeros = 0, nonfinite = 0;
  for (double x : v) {
    if (!std::isfinite(x)) {
      ++nonfinite;
      continue;
    }
    sum += x;
    mn = std::min(mn, x);
    mx = std::max(mx, x);
    zeros += x == 0;
  }
  const int64_t m = n - nonfinite;
  const double mean = m ? sum / double(m) : 0;
  double ss = 0;
  for (double x : v)
    if (std::isfinite(x)) ss += (x - mean) * (x - mean);
  // No finite element (all NaN / Inf): null, not a made-up 0.
  j["mean"] = m ? json(mean) : json(nullptr);
  j["std"] = m ? json(std::sqrt(ss / double(m))) : json(nullptr);
  j["min"] = m ? json(mn) : json(nullptr);
  j["max"] = m ? json(mx) : json(nullptr);
  j["zero_fraction"] = double(zeros) / double(n);
  if (nonfinite) j["non_finite"] = nonfinite;
  return j;
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string o = "[";
  for (size_t i = 0; i < s.size(); ++i) o += (i ? ", " : "") + std::to_string(s[i]);
  return o + "]";
}
}  // namespace

Command inspect_command() {
  auto a = std::make_shared<InspectArgs>();
  Command c;
  c.add = [a](CLI::App& app) {
    CLI::App* s = app.add_subcommand("inspect", "Show a checkpoint's layout, tensors, files, sizes and problems");
    s->add_option("path", a->path, "Checkpoint (root or step folder)")->required();
    s->add_option("--step", a->step, "Step to open (default: the one `latest` names)");
    s->add_option("--model", a->model, "Model YAML where the files do not record it (DeepSpeed)");
    s->add_flag("--json", a->json, "Print JSON");
    s->add_flag("--stats", a->stats, "Per tensor and state: mean, std, min, max, fraction of zeros (reads all data)");
    return s;
  };
  c.run = [a]() {
    OpenOptions oo;
    oo.step = a->step;
    if (!a->model.empty()) oo.model_path = resolve_model_path(a->model);
    auto ckpt = open_checkpoint(a->path, oo);
    const SourceLayout& s = ckpt->source();
    const Layout& L = s.layout;
    const ModelConfig& m = L.model;
    const NonTensorState& st = ckpt->state();
    json d = json::parse(inspect_json(*ckpt, false));
    d["layout"] = L.topo.to_string();
    d["topology"]["world_size"] = L.topo.world_size();
    d["model"]["name"] = m.name;

    // Per tensor: state kinds and the dtype stored (the 16-bit weight where stored).
    std::map<std::string, std::vector<std::string>> states_of;
    std::map<std::string, std::string> dtype_of;
    std::vector<int> array_dtype(L.arrays.size(), -1);
    for (const Piece& p : L.pieces)
      if (array_dtype[p.array] < 0) array_dtype[p.array] = int(L.buffers[p.buffer].dtype);
    for (size_t i = 0; i < L.arrays.size(); ++i) {
      const auto& ar = L.arrays[i];
      states_of[ar.tensor].push_back(state_kind_name(ar.state));
      if (array_dtype[i] >= 0 && (ar.state == StateKind::kWeight || !dtype_of.count(ar.tensor)))
        dtype_of[ar.tensor] = dtype_name(DType(array_dtype[i]));
    }
    json tensors = std::move(d["tensors"]);  // d is an ordered map: no reference into it across inserts
    std::map<std::string, size_t> index_of;
    for (size_t i = 0; i < tensors.size(); ++i) {
      const std::string name = tensors[i]["name"].get<std::string>();
      if (dtype_of.count(name)) tensors[i]["dtype"] = dtype_of[name];
      tensors[i]["states"] = states_of[name];
      index_of[name] = i;
    }

    // Data files: sizes, and missing ones as problems (first).
    json sizes = json::array();
    uint64_t total = 0;
    std::vector<std::string> problems;
    for (size_t f = 0; f < s.files.size(); ++f) {
      json j;
      j["path"] = s.files[f];
      j["name"] = io::base_name(s.files[f]);
      if (io::is_file(s.files[f])) {
        const uint64_t n = io::file_size(s.files[f]);
        j["bytes"] = n;
        j["present"] = true;
        total += n;
      } else {
        j["bytes"] = nullptr;
        j["present"] = false;
        problems.push_back("missing data file " + s.files[f]);
      }
      sizes.push_back(j);
    }
    for (const auto& p : d["problems"]) problems.push_back(p.get<std::string>());
    d["file_sizes"] = sizes;
    d["file_bytes"] = total;
    d["state_bytes"] = L.total_bytes();
    d["num_buffers"] = L.buffers.size();

    if (a->stats) {
      // Statistics of corrupted bytes would look plausible: --stats reads every byte anyway, so it
      // checks every stored checksum first and lists mismatches as problems.
      for (const std::string& bad : check_checksum_units(*ckpt, ckpt->checksum_units(), default_threads()))
        problems.push_back("checksum: " + bad);
      json top = json::object();
      try {
        bool opt = false;
        for (const auto& ar : L.arrays) opt |= ar.state != StateKind::kWeight;
        ConsolidateOptions co;
        co.optimizer = opt;
        co.replica_policy = ReplicaPolicy::kFirst;  // differing replicas are reported in problems
        co.compare_replicas = false;
        Consolidated c = consolidate(*ckpt, co);
        for (int k = 0; k < kNumStateKinds; ++k)
          for (auto& [name, t] : c.states[k]) {
            auto it = index_of.find(name);
            json js = stats_of(t.values);
            if (k == int(StateKind::kWeight)) top[name] = js;
            if (it != index_of.end()) tensors[it->second]["stats"][state_kind_name(StateKind(k))] = js;
            std::vector<float>().swap(t.values);
          }
      } catch (const Error& e) {
        problems.push_back(std::string("stats: ") + e.what());
      }
      d["stats"] = top;
    }
    d["tensors"] = tensors;
    d["problems"] = problems;

    // Exit 1 when it found a problem (a missing file, uncovered elements, a checksum), as verify.
    const int rc = problems.empty() ? 0 : 1;
    if (a->json) {
      std::cout << d.dump(2) << std::endl;
      return rc;
    }
    // Text read from the files (paths, names, notes) is printed on one line each (detail::one_line):
    // a name holding a newline must not forge a line of this report.
    using detail::one_line;
    std::printf("%s: %s checkpoint, layout %s (world size %d), model %s\n", one_line(ckpt->path()).c_str(),
                one_line(ckpt->writer()).c_str(), L.topo.to_string().c_str(), L.topo.world_size(), one_line(m.name).c_str());
    std::printf("iteration %lld, optimizer step %lld, consumed samples %lld\n", (long long)st.iteration,
                (long long)st.step, (long long)st.consumed_samples);
    std::printf("%zu tensor(s), %zu buffer(s), %s of state in %zu file(s) (%s on disk)\n", L.tensors.size(),
                L.buffers.size(), format_bytes(L.total_bytes()).c_str(), s.files.size(), format_bytes(total).c_str());
    for (const auto& j : tensors) {
      std::string states;
      for (const auto& x : j["states"]) states += (states.empty() ? "" : ",") + x.get<std::string>();
      std::printf("  %-55s %-14s %-5s %s\n", one_line(j["name"].get<std::string>()).c_str(),
                  shape_str(j["shape"].get<std::vector<int64_t>>()).c_str(), j["dtype"].get<std::string>().c_str(),
                  states.c_str());
      if (j.contains("stats"))
        for (auto& [k, v] : j["stats"].items()) {
          if (!v.contains("mean")) continue;
          // null (no finite element: all NaN / Inf) prints as "-".
          auto num = [&](const char* key) {
            if (v[key].is_null()) return std::string("-");
            char buf[32];
            std::snprintf(buf, sizeof buf, "%.6g", v[key].get<double>());
            return std::string(buf);
          };
          std::printf("      %-10s mean %-12s std %-12s min %-12s max %-12s zeros %.4f", k.c_str(), num("mean").c_str(),
                      num("std").c_str(), num("min").c_str(), num("max").c_str(), v["zero_fraction"].get<double>());
          // NaN / Inf are left out of mean..max; say how many there are, or they stay invisible.
          if (v.contains("non_finite"))
            std::printf("  NON-FINITE %lld (NaN or Inf; left out of mean, std, min, max)",
                        (long long)v["non_finite"].get<int64_t>());
          std::printf("\n");
        }
    }
    std::printf("files:\n");
    for (const auto& j : sizes)
      std::printf("  %s %s\n", one_line(j["name"].get<std::string>()).c_str(),
                  j["present"].get<bool>() ? (std::to_string(j["bytes"].get<uint64_t>()) + " bytes").c_str() : "MISSING");
    for (const auto& p : problems) std::printf("problem: %s\n", one_line(p).c_str());
    for (const auto& n : ckpt->notes()) std::printf("note: %s\n", one_line(n).c_str());
    return rc;
  };
  return c;
}

}  // namespace reshard::cli
