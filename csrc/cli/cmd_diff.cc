// reshard diff: compares the consolidated values of two checkpoints whatever their layouts, or a
// checkpoint with a single-file state dict (read_state_dict, reshard/state_dict.h).
// Consolidation is reshard::consolidate (consolidate.h): tp=1,pp=1,dp=1,zero=0 in memory, every
// stored vocab row kept, so padding rows are compared where both sides have them.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <functional>
#include <map>
#include <set>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "reshard/checkpoint.h"
#include "reshard/consolidate.h"
#include "reshard/error.h"
#include "reshard/layout.h"
#include "reshard/plan.h"
#include "reshard/simulate.h"
#include "reshard/state_dict.h"

namespace reshard::cli {

namespace {

struct DiffArgs {
  std::string a, b, state = "all", model_a, model_b;
  double atol = 0;
  bool json = false;
};

// A held tensor: copied out of a consolidation, or read from a state-dict file.
using Held = StateDictTensor;

std::string shape_str(const std::vector<int64_t>& s) {
  std::string o = "[";
  for (size_t i = 0; i < s.size(); ++i) o += (i ? ", " : "") + std::to_string(s[i]);
  return o + "]";
}

struct Compared {
  std::string tensor, state, note;
  double max_abs_diff = 0;
  bool bitwise = false, ok = false, comparable = true;
  int64_t numel = 0;
};

// Elements [0, n) of two tensors converted to double in chunks. `*nonfinite_mismatches` counts
// elements where one side is NaN or infinite and the other is not the same (NaN = NaN, +Inf = +Inf
// count as equal): no tolerance makes those equal, so they are not folded into the max (an
// infinite max would pass --atol inf).
double max_abs_diff(const void* a, DType ta, const void* b, DType tb, int64_t n, int64_t* nonfinite_mismatches) {
  *nonfinite_mismatches = 0;
  if (!dtype_is_float(ta) || !dtype_is_float(tb)) {
    if (ta != tb) return INFINITY;
    return std::memcmp(a, b, size_t(n) * dtype_size(ta)) == 0 ? 0.0 : INFINITY;
  }
  constexpr int64_t kChunk = 1 << 16;
  std::vector<double> x(kChunk), y(kChunk);
  double m = 0;
  for (int64_t i = 0; i < n; i += kChunk) {
    const int64_t k = std::min(kChunk, n - i);
    convert_elements(static_cast<const char*>(a) + i * dtype_size(ta), ta, x.data(), DType::F64, size_t(k));
    convert_elements(static_cast<const char*>(b) + i * dtype_size(tb), tb, y.data(), DType::F64, size_t(k));
    for (int64_t j = 0; j < k; ++j) {
      if (x[j] == y[j] || (std::isnan(x[j]) && std::isnan(y[j]))) continue;
      if (!std::isfinite(x[j]) || !std::isfinite(y[j])) {
        ++*nonfinite_mismatches;
        continue;
      }
      m = std::max(m, std::fabs(x[j] - y[j]));
    }
  }
  return m;
}

Compared compare(const std::string& name, const std::string& state, const Held& a, const Held& b, double atol) {
  Compared c;
  c.tensor = name;
  c.state = state;
  const bool vocab = a.real_rows >= 0 || b.real_rows >= 0;
  bool same_inner = a.shape.size() == b.shape.size() && !a.shape.empty();
  for (size_t d = 1; same_inner && d < a.shape.size(); ++d) same_inner = a.shape[d] == b.shape[d];
  if (a.shape.empty() && b.shape.empty()) same_inner = true;
  if (!same_inner || (!vocab && a.shape != b.shape)) {
    c.comparable = false;
    c.note = "shape " + shape_str(a.shape) + " vs " + shape_str(b.shape);
    c.max_abs_diff = INFINITY;
    return c;
  }
  int64_t n = a.numel;
  if (a.shape != b.shape) {  // vocab padding rows: compare the rows both sides have
    int64_t row = 1;
    for (size_t d = 1; d < a.shape.size(); ++d) row *= a.shape[d];
    const int64_t rows = std::min(a.shape[0], b.shape[0]);
    const int64_t real = std::max(a.real_rows, b.real_rows);
    if (real > rows) {
      c.comparable = false;
      c.note = "shape " + shape_str(a.shape) + " vs " + shape_str(b.shape) + " (fewer rows than the vocab)";
      c.max_abs_diff = INFINITY;
      return c;
    }
    n = rows * row;
    c.note = "first " + std::to_string(rows) + " rows of " + shape_str(a.shape) + " vs " + shape_str(b.shape);
  }
  c.numel = n;
  if (a.dtype == b.dtype && std::memcmp(a.data.data(), b.data.data(), size_t(n) * dtype_size(a.dtype)) == 0) {
    c.bitwise = c.ok = true;
    return c;
  }
  // A checkpoint's values are held as fp32 (16-bit weights widened exactly), a state dict's in its
  // file's dtype: a 16-bit side is widened the same way, so identical values compare bitwise.
  auto narrow16 = [](DType t) { return t == DType::BF16 || t == DType::F16; };
  if ((a.dtype == DType::F32 && narrow16(b.dtype)) || (b.dtype == DType::F32 && narrow16(a.dtype))) {
    const Held& wide = a.dtype == DType::F32 ? a : b;
    const Held& narrow = a.dtype == DType::F32 ? b : a;
    constexpr int64_t kChunk = 1 << 16;
    std::vector<float> w(kChunk);
    bool same = true;
    for (int64_t i = 0; same && i < n; i += kChunk) {
      const int64_t k = std::min(kChunk, n - i);
      convert_elements(narrow.data.data() + i * dtype_size(narrow.dtype), narrow.dtype, w.data(), DType::F32, size_t(k));
      same = std::memcmp(w.data(), wide.data.data() + i * sizeof(float), size_t(k) * sizeof(float)) == 0;
    }
    if (same) {
      c.bitwise = c.ok = true;
      c.note += std::string(c.note.empty() ? "" : "; ") + dtype_name(a.dtype) + " vs " + dtype_name(b.dtype) +
                ", compared widened to fp32";
      return c;
    }
  }
  int64_t nonfinite = 0;
  c.max_abs_diff = max_abs_diff(a.data.data(), a.dtype, b.data.data(), b.dtype, n, &nonfinite);
  c.ok = nonfinite == 0 && c.max_abs_diff <= atol;
  if (nonfinite)
    c.note += std::string(c.note.empty() ? "" : "; ") + std::to_string(nonfinite) +
              " element(s) NaN or infinite where the other side differs";
  if (a.dtype != b.dtype) c.note += std::string(c.note.empty() ? "" : "; ") + dtype_name(a.dtype) + " vs " + dtype_name(b.dtype);
  return c;
}

// Values are exact in float (16-bit weights widened), so float bytes compare bitwise like the stored ones.
Held hold(ConsolidatedTensor&& t) {
  Held h;
  h.shape = std::move(t.shape);
  h.real_rows = t.real_rows;
  h.dtype = DType::F32;
  h.numel = int64_t(t.values.size());
  const char* p = reinterpret_cast<const char*>(t.values.data());
  h.data.assign(p, p + t.values.size() * sizeof(float));
  std::vector<float>().swap(t.values);
  return h;
}

std::string fmt(double d) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.6g", d);
  return buf;
}

}  // namespace

Command diff_command() {
  auto a = std::make_shared<DiffArgs>();
  Command c;
  c.add = [a](CLI::App& app) {
    CLI::App* s = app.add_subcommand(
        "diff", "Compare the consolidated values of two checkpoints (any layouts) or a safetensors state dict");
    s->add_option("A", a->a, "Checkpoint (root or step folder) or a .safetensors state dict")->required();
    s->add_option("B", a->b, "Checkpoint (root or step folder) or a .safetensors state dict")->required();
    s->add_option("--atol", a->atol, "Largest absolute difference still counted as equal (default 0: exact)");
    s->add_option("--state", a->state, "State kind to compare: fp32, weights, exp_avg, exp_avg_sq or all")
        ->check(CLI::IsMember({"fp32", "weights", "weight", "exp_avg", "exp_avg_sq", "all"}));
    s->add_option("--model-a", a->model_a, "Model YAML for A where its files do not record it (DeepSpeed)");
    s->add_option("--model-b", a->model_b, "Model YAML for B where its files do not record it (DeepSpeed)");
    s->add_flag("--json", a->json, "Print the per-tensor results as JSON");
    return s;
  };
  c.run = [a]() {
    if (a->atol < 0 || std::isnan(a->atol)) fail(ErrorCode::kInvalidArgument, "--atol ", a->atol, " must be >= 0");
    // Open both sides first, so that an unreadable input fails before any comparison.
    std::unique_ptr<CheckpointReader> ca, cb;
    std::unique_ptr<StateDict> fa, fb;
    auto open_side = [](const std::string& p, const std::string& model, std::unique_ptr<CheckpointReader>* ck,
                        std::unique_ptr<StateDict>* f) {
      if (is_state_dict_file(p)) {
        *f = std::make_unique<StateDict>(read_state_dict(p));
      } else {
        OpenOptions oo;
        if (!model.empty()) oo.model_path = resolve_model_path(model);
        *ck = open_checkpoint(p, oo);
      }
    };
    open_side(a->a, a->model_a, &ca, &fa);
    open_side(a->b, a->model_b, &cb, &fb);

    std::vector<StateKind> states;
    const std::string st = a->state == "weights" ? "weight" : a->state;
    if (st == "all") {
      if (fa || fb) {
        const StateDict& f = fa ? *fa : *fb;
        states = {f.all_f32 ? StateKind::kMaster : StateKind::kWeight};
      } else {
        states = {StateKind::kWeight, StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq};
      }
    } else {
      states = {state_kind_from_name(st)};
    }

    // Each checkpoint side consolidated once (every state kind asked for, in memory, as float).
    ConsolidateOptions co;
    co.optimizer = false;
    for (StateKind s : states) co.optimizer |= s != StateKind::kWeight;
    std::unique_ptr<Consolidated> xa, xb;
    if (ca) xa = std::make_unique<Consolidated>(consolidate(*ca, co));
    if (cb) xb = std::make_unique<Consolidated>(consolidate(*cb, co));
    // Tensors of one state of one side, held, in the model's parameter order.
    auto side = [](const CheckpointReader* ck, Consolidated* x, StateDict* f, StateKind s,
                   std::vector<std::pair<std::string, Held>>* out) -> bool {
      if (f) {
        for (auto& [n, h] : f->tensors) out->push_back({n, h});
        return true;
      }
      auto& m = x->states[int(s)];
      if (m.empty()) return false;
      for (const auto& t : ck->source().layout.tensors) {
        auto it = m.find(t.name);
        if (it == m.end()) continue;
        out->push_back({t.name, hold(std::move(it->second))});
        m.erase(it);
      }
      for (auto& [n, t] : m) out->push_back({n, hold(std::move(t))});
      m.clear();
      return true;
    };

    std::vector<Compared> results;
    std::vector<std::string> header_notes;
    for (StateKind s : states) {
      const std::string sname = state_kind_name(s);
      std::vector<std::pair<std::string, Held>> la, lb;
      const bool a_has = side(ca.get(), xa.get(), fa.get(), s, &la);
      const bool b_has = side(cb.get(), xb.get(), fb.get(), s, &lb);
      std::map<std::string, Held> left;
      std::vector<std::string> order;
      for (auto& [n, h] : la) {
        order.push_back(n);
        left.emplace(n, std::move(h));
      }
      la.clear();
      if (!a_has || !b_has) {
        if (a_has || b_has) {
          Compared x;
          x.tensor = "*";
          x.state = sname;
          x.comparable = false;
          x.max_abs_diff = INFINITY;
          x.note = std::string("state ") + sname + " only in " + (a_has ? "A" : "B");
          results.push_back(x);
        }
        continue;
      }
      std::map<std::string, bool> seen;
      auto against = [&](const std::string& name, const Held& right) {
        auto it = left.find(name);
        seen[name] = true;
        if (it == left.end()) {
          Compared x;
          x.tensor = name;
          x.state = sname;
          x.comparable = false;
          x.max_abs_diff = INFINITY;
          x.note = "only in B";
          results.push_back(x);
          return;
        }
        results.push_back(compare(name, sname, it->second, right, a->atol));
        left.erase(it);  // free memory early
      };
      for (auto& [n, h] : lb) against(n, h);
      for (const auto& n : order)
        if (!seen.count(n)) {
          Compared x;
          x.tensor = n;
          x.state = sname;
          x.comparable = false;
          x.max_abs_diff = INFINITY;
          x.note = "only in A";
          results.push_back(x);
        }
    }
    if ((fa || fb) && !(fa && fb))
      header_notes.push_back(std::string("the safetensors file is compared with the checkpoint's ") +
                             state_kind_name(states[0]) + " state" +
                             (a->state == "all" ? " (chosen from the file's dtypes; --state to change)" : ""));

    size_t equal = 0, bitwise = 0;
    for (const auto& r : results) {
      equal += r.ok;
      bitwise += r.bitwise;
    }
    const bool all_ok = equal == results.size();
    if (a->json) {
      nlohmann::json j;
      j["a"] = a->a;
      j["b"] = a->b;
      j["atol"] = a->atol;
      j["equal"] = all_ok;
      j["notes"] = header_notes;
      j["tensors"] = nlohmann::json::array();
      for (const auto& r : results) {
        nlohmann::json t;
        t["tensor"] = r.tensor;
        t["state"] = r.state;
        t["max_abs_diff"] = std::isfinite(r.max_abs_diff) ? nlohmann::json(r.max_abs_diff) : nlohmann::json(nullptr);
        t["equal"] = r.ok;
        t["bitwise"] = r.bitwise;
        t["numel"] = r.numel;
        if (!r.note.empty()) t["note"] = r.note;
        j["tensors"].push_back(t);
      }
      j["compared"] = results.size();
      j["num_equal"] = equal;
      j["num_bitwise"] = bitwise;
      std::cout << j.dump(2) << std::endl;
    } else {
      for (const auto& n : header_notes) std::printf("note: %s\n", detail::one_line(n).c_str());
      for (const auto& r : results) {
        std::string d = r.comparable ? fmt(r.max_abs_diff) : "-";
        std::printf("%-8s %s (%s): max |diff| %s%s%s\n", r.ok ? "equal" : "DIFFERS", detail::one_line(r.tensor).c_str(), r.state.c_str(),
                    d.c_str(), r.bitwise ? " (bitwise)" : "", r.note.empty() ? "" : detail::one_line("  [" + r.note + "]").c_str());
      }
      std::printf("%zu tensor(s) compared: %zu equal (%zu bitwise), %zu differ%s\n", results.size(), equal, bitwise,
                  results.size() - equal, a->atol > 0 ? (" (atol " + fmt(a->atol) + ")").c_str() : "");
    }
    return all_ok ? 0 : 1;
  };
  return c;
}

}  // namespace reshard::cli
