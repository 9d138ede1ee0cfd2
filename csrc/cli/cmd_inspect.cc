// reshard inspect: what a checkpoint holds: layout, model, tensors (canonical names, global shapes,
// dtypes, state kinds), files and sizes, non-tensor state, problems found from the headers alone
// (missing files, uncovered regions) and the reader's notes. --stats consolidates each state kind
// in memory (cmd_diff.cc consolidate_state) and adds per tensor and state kind the mean, std
// (population, ddof 0), min, max and fraction of exact zeros over every stored element (vocab
// padding rows included).
//
// The JSON is built here from CheckpointReader; when include/reshard/inspect.h lands this should
// call inspect_json() instead.
#include <sys/stat.h>

#include <cmath>
#include <cstdio>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "io/file.h"
#include "reshard/checkpoint.h"
#include "reshard/error.h"
#include "reshard/layout.h"
#include "reshard/plan.h"

namespace reshard::cli {

// Defined in cmd_diff.cc; keep this definition identical to the one there.
struct ConsolidatedTensor {
  std::string tensor;
  StateKind state = StateKind::kWeight;
  std::vector<int64_t> shape;
  int64_t real_rows = -1;  // vocab tensors: rows >= real_rows are padding
  DType dtype = DType::F32;
  const void* data = nullptr;
  int64_t numel = 0;
};
bool has_state(const CheckpointReader& ckpt, StateKind s);
void consolidate_state(const CheckpointReader& ckpt, StateKind s,
                       const std::function<void(const ConsolidatedTensor&)>& fn);

namespace {
struct InspectArgs {
  std::string path, model, step;
  bool json = false, stats = false;
};

nlohmann::json stats_of(const ConsolidatedTensor& t) {
  nlohmann::json j;
  const int64_t n = t.numel;
  j["numel"] = n;
  if (n == 0 || !dtype_is_float(t.dtype)) return j;
  std::vector<double> v(static_cast<size_t>(n));
  convert_elements(t.data, t.dtype, v.data(), DType::F64, size_t(n));
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
  j["mean"] = mean;
  j["std"] = m ? std::sqrt(ss / double(m)) : 0.0;
  j["min"] = m ? mn : 0.0;
  j["max"] = m ? mx : 0.0;
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
    nlohmann::json d;
    d["path"] = ckpt->path();
    d["writer"] = ckpt->writer();
    d["layout"] = L.topo.to_string();
    d["topology"] = {{"tp", L.topo.tp}, {"pp", L.topo.pp}, {"vpp", L.topo.vpp}, {"dp", L.topo.dp},
                     {"zero", L.topo.zero}, {"world_size", L.topo.world_size()}};
    const ModelConfig& m = L.model;
    d["model"] = {{"name", m.name}, {"num_layers", m.num_layers}, {"hidden", m.hidden}, {"ffn", m.ffn},
                  {"heads", m.heads}, {"query_groups", m.groups()}, {"vocab", m.vocab},
                  {"padded_vocab", m.vocab > 0 ? m.padded_vocab(L.topo.tp) : 0}, {"swiglu", m.swiglu},
                  {"tied_embeddings", m.tied_embeddings}, {"bias", m.bias}, {"norm", m.norm},
                  {"param_dtype", dtype_name(m.param_dtype)}};
    const NonTensorState& st = ckpt->state();
    d["iteration"] = st.iteration;
    d["step"] = st.step;
    d["consumed_samples"] = st.consumed_samples;

    // Per tensor: dtype (of the 16-bit weight where stored, else of the first state) and states.
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
    nlohmann::json tensors = nlohmann::json::array();
    std::map<std::string, size_t> index_of;
    for (const auto& t : L.tensors) {
      nlohmann::json j;
      j["name"] = t.name;
      j["shape"] = t.shape;
      j["dtype"] = dtype_of.count(t.name) ? dtype_of[t.name] : "";
      j["split"] = split_name(t.split);
      j["states"] = states_of[t.name];
      if (t.real_rows >= 0) j["real_rows"] = t.real_rows;
      index_of[t.name] = tensors.size();
      tensors.push_back(j);
    }

    // Files and sizes.
    nlohmann::json files = nlohmann::json::array();
    uint64_t total = 0;
    std::vector<std::string> problems;
    for (size_t f = 0; f < s.files.size(); ++f) {
      nlohmann::json j;
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
      files.push_back(j);
    }
    d["files"] = files;
    d["file_bytes"] = total;
    d["state_bytes"] = L.total_bytes();
    d["num_buffers"] = L.buffers.size();

    // Coverage from the headers alone.
    Topology t1;
    const Layout full = derive_layout(m, t1);
    for (const auto& g : find_coverage_gaps(s, full))
      problems.push_back("tensor " + g.tensor + " (" + state_kind_name(g.state) + "): elements " +
                         g.region.to_string() + " covered by no file");

    if (a->stats) {
      for (StateKind k : {StateKind::kWeight, StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq}) {
        if (!has_state(*ckpt, k)) continue;
        try {
          consolidate_state(*ckpt, k, [&](const ConsolidatedTensor& t) {
            auto it = index_of.find(t.tensor);
            if (it == index_of.end()) return;
            tensors[it->second]["stats"][state_kind_name(k)] = stats_of(t);
          });
        } catch (const Error& e) {
          problems.push_back(std::string("stats of ") + state_kind_name(k) + " unavailable: " + e.what());
        }
      }
    }
    d["tensors"] = tensors;
    d["problems"] = problems;
    d["notes"] = ckpt->notes();

    if (a->json) {
      std::cout << d.dump(2) << std::endl;
      return 0;
    }
    std::printf("%s: %s checkpoint, layout %s (world size %d), model %s\n", ckpt->path().c_str(), ckpt->writer().c_str(),
                L.topo.to_string().c_str(), L.topo.world_size(), m.name.c_str());
    std::printf("iteration %lld, optimizer step %lld, consumed samples %lld\n", (long long)st.iteration,
                (long long)st.step, (long long)st.consumed_samples);
    std::printf("%zu tensor(s), %zu buffer(s), %.6f GB of state in %zu file(s) (%.6f GB on disk)\n", L.tensors.size(),
                L.buffers.size(), L.total_bytes() / 1e9, s.files.size(), total / 1e9);
    for (const auto& j : tensors) {
      std::string states;
      for (const auto& x : j["states"]) states += (states.empty() ? "" : ",") + x.get<std::string>();
      std::printf("  %-55s %-14s %-5s %s\n", j["name"].get<std::string>().c_str(),
                  shape_str(j["shape"].get<std::vector<int64_t>>()).c_str(), j["dtype"].get<std::string>().c_str(),
                  states.c_str());
      if (j.contains("stats"))
        for (auto& [k, v] : j["stats"].items()) {
          if (!v.contains("mean")) continue;
          std::printf("      %-10s mean %-12.6g std %-12.6g min %-12.6g max %-12.6g zeros %.4f\n", k.c_str(),
                      v["mean"].get<double>(), v["std"].get<double>(), v["min"].get<double>(), v["max"].get<double>(),
                      v["zero_fraction"].get<double>());
        }
    }
    std::printf("files:\n");
    for (const auto& j : files)
      std::printf("  %s %s\n", j["name"].get<std::string>().c_str(),
                  j["present"].get<bool>() ? (std::to_string(j["bytes"].get<uint64_t>()) + " bytes").c_str() : "MISSING");
    for (const auto& p : problems) std::printf("problem: %s\n", p.c_str());
    for (const auto& n : ckpt->notes()) std::printf("note: %s\n", n.c_str());
    return 0;
  };
  return c;
}

}  // namespace reshard::cli
