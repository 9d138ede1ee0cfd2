// reshard._C: the Python face of the facade (include/reshard/reshard.h, native.h, config.h).
// The only translation unit that includes torch headers. Python wrappers with docstrings live in
// python/reshard/__init__.py; this module keeps to plain types, opaque Layout/Checkpoint handles
// and torch tensors at the edge.
#include <torch/extension.h>

#include <pybind11/stl.h>

#include <functional>
#include <optional>
#include <algorithm>
#include <map>
#include <type_traits>

#include "formats/native/layout_json.h"
#include "python/torch_comm.h"
#include "reshard/checkpoint.h"
#include "reshard/config.h"
#include "reshard/elastic.h"
#include "reshard/error.h"
#include "reshard/layout.h"
#include "reshard/native.h"
#include "reshard/reshard.h"
#include "reshard/units.h"

namespace py = pybind11;

namespace reshard::python {
namespace {

// ---- errors: one Python class per ErrorCode, all deriving from reshard.Error -------------------

struct ErrorClasses {
  PyObject* base = nullptr;
  PyObject* by_code[6] = {};
};
ErrorClasses g_errors;

PyObject* error_class(ErrorCode c) {
  int i = int(c);
  return (i >= 0 && i < 6 && g_errors.by_code[i]) ? g_errors.by_code[i] : g_errors.base;
}

void register_errors(py::module_& m) {
  g_errors.base = PyErr_NewExceptionWithDoc(
      "reshard._C.Error",
      "Base class of every reshard error. The message is the same as the CLI's and names the path, "
      "tensor, region, rank or field involved; `code` is the ErrorCode name.",
      PyExc_RuntimeError, nullptr);
  m.attr("Error") = py::handle(g_errors.base);
  const ErrorCode codes[] = {ErrorCode::kInvalidArgument, ErrorCode::kNotFound, ErrorCode::kDataLoss,
                             ErrorCode::kUnsupported, ErrorCode::kFailedPrecondition, ErrorCode::kInternal};
  for (ErrorCode c : codes) {
    std::string name = std::string("reshard._C.") + error_code_name(c);
    PyObject* cls = PyErr_NewException(name.c_str(), g_errors.base, nullptr);
    py::setattr(cls, "code", py::str(error_code_name(c)));
    g_errors.by_code[int(c)] = cls;
    m.attr(error_code_name(c)) = py::handle(cls);
  }
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      PyErr_SetString(error_class(e.code()), e.what());
    }
  });
}

// ---- small conversions ---------------------------------------------------------------------------

ModelConfig model_from_yaml(const std::string& text, const std::string& origin) {
  return parse_model_config(text, origin);
}

py::dict state_to_py(const NonTensorState& s) {
  py::dict d;
  d["iteration"] = s.iteration;
  d["consumed_samples"] = s.consumed_samples;
  d["step"] = s.step;
  d["json"] = s.json;
  py::dict pr;
  for (const auto& [r, blob] : s.per_rank) pr[py::int_(r)] = py::bytes(blob);
  d["per_rank"] = pr;
  return d;
}

// save()'s `state`: every key known and of its type, counters non-negative, per-rank blobs for
// ranks of the layout (a typo or a wrong type would otherwise be saved as "unknown" silently).
NonTensorState state_from_py(const py::dict& d, int world_size) {
  NonTensorState s;
  static const char* const kKeys[] = {"iteration", "consumed_samples", "step", "json", "per_rank"};
  for (auto item : d) {
    const std::string k = py::str(item.first).cast<std::string>();
    if (std::find_if(std::begin(kKeys), std::end(kKeys), [&](const char* x) { return k == x; }) == std::end(kKeys))
      fail(ErrorCode::kInvalidArgument, "save: unknown state key '", k,
           "' (known: iteration, consumed_samples, step, json, per_rank)");
  }
  auto counter = [&](const char* key, int64_t& out) {
    if (!d.contains(key)) return;
    py::object v = d[key];
    if (!py::isinstance<py::int_>(v) || py::isinstance<py::bool_>(v))
      fail(ErrorCode::kInvalidArgument, "save: state '", key, "' must be an int, got ", py::repr(v).cast<std::string>());
    try {
      out = v.cast<int64_t>();
    } catch (const py::cast_error&) {
      fail(ErrorCode::kInvalidArgument, "save: state '", key, "' does not fit in 64 bits: ", py::repr(v).cast<std::string>());
    }
    if (out < 0) fail(ErrorCode::kInvalidArgument, "save: state '", key, "' must be >= 0, got ", out);
  };
  counter("iteration", s.iteration);
  counter("consumed_samples", s.consumed_samples);
  counter("step", s.step);
  if (d.contains("json")) {
    if (!py::isinstance<py::str>(d["json"]))
      fail(ErrorCode::kInvalidArgument, "save: state 'json' must be a str holding one JSON object");
    s.json = d["json"].cast<std::string>();
    (void)native::state_to_json(s);  // one JSON object, checked before anything is written
  }
  if (d.contains("per_rank")) {
    if (!py::isinstance<py::dict>(d["per_rank"]))
      fail(ErrorCode::kInvalidArgument, "save: state 'per_rank' must be a dict {rank: bytes}");
    for (auto item : d["per_rank"].cast<py::dict>()) {
      if (!py::isinstance<py::int_>(item.first) || !py::isinstance<py::bytes>(item.second))
        fail(ErrorCode::kInvalidArgument, "save: state 'per_rank' must map int ranks to bytes, got ",
             py::repr(item.first).cast<std::string>(), ": ", py::str(py::type::of(item.second)).cast<std::string>());
      const int64_t r = item.first.cast<int64_t>();
      if (r < 0 || r >= world_size)
        fail(ErrorCode::kInvalidArgument, "save: state 'per_rank' names rank ", r, ", outside the layout's world size ",
             world_size);
      s.per_rank[int(r)] = item.second.cast<std::string>();
    }
  }
  return s;
}

py::dict tensor_spec_to_py(const TensorSpec& t) {
  py::dict d;
  d["name"] = t.name;
  d["shape"] = t.shape;
  d["split"] = split_name(t.split);
  d["reduction"] = t.reduction == Reduction::kPartialSum ? "partial_sum" : "replicated";
  const char* owner = "layer";
  switch (t.owner) {
    case Owner::kLayer: owner = "layer"; break;
    case Owner::kFirstStage: owner = "first_stage"; break;
    case Owner::kLastStage: owner = "last_stage"; break;
    case Owner::kFirstAndLast: owner = "first_and_last"; break;
  }
  d["owner"] = owner;
  d["layer"] = t.layer;
  d["no_weight_decay"] = t.no_weight_decay;
  d["real_rows"] = t.real_rows;
  return d;
}

py::list buffers_to_py(const Layout& L) {
  py::list out;
  for (const auto& b : L.buffers) {
    py::dict d;
    d["name"] = b.name;
    d["rank"] = b.rank;
    d["dtype"] = dtype_name(b.dtype);
    d["numel"] = b.numel;
    d["state"] = state_kind_name(b.state);
    d["group"] = b.group;
    out.append(d);
  }
  return out;
}

PlanOptions plan_options_from_py(const py::dict& d) {
  PlanOptions o;
  for (auto item : d) {
    const std::string k = py::str(item.first).cast<std::string>();
    py::handle v = item.second;
    // A value of the wrong type is the caller's mistake: InvalidArgument naming the policy.
    auto as = [&](auto* out, const char* type) {
      using T = std::remove_pointer_t<decltype(out)>;
      const bool is_bool = py::isinstance<py::bool_>(v);
      bool ok = false;
      if constexpr (std::is_same_v<T, bool>) ok = is_bool;
      else if constexpr (std::is_same_v<T, std::string>) ok = py::isinstance<py::str>(v);
      else if constexpr (std::is_floating_point_v<T>) ok = !is_bool && (py::isinstance<py::float_>(v) || py::isinstance<py::int_>(v));
      else ok = !is_bool && py::isinstance<py::int_>(v);
      if (ok) {
        try {
          *out = v.cast<T>();
        } catch (const py::cast_error&) {
          ok = false;  // e.g. a negative int for a byte count
        }
      }
      if (!ok)
        fail(ErrorCode::kInvalidArgument, "policy '", k, "' must be ", type, ", got ", py::repr(v).cast<std::string>());
    };
    std::string name;
    if (k == "replicas") { as(&name, "a string (error, average or first)"); o.replica_policy = replica_policy_from_name(name); }
    else if (k == "replica_atol") {
      as(&o.replica_atol, "a number");
      if (!(o.replica_atol >= 0)) fail(ErrorCode::kInvalidArgument, "policy 'replica_atol' must be >= 0, got ", o.replica_atol);
    }
    else if (k == "strict_missing") as(&o.strict_missing, "True or False");
    else if (k == "strict_unexpected") as(&o.strict_unexpected, "True or False");
    else if (k == "memory_budget_bytes") {
      as(&o.memory_budget, "a non-negative integer (bytes)");
      // make_plan refuses it too; here it is refused when the policies are read, which reshard.load
      // does before its ranks agree (a rank that refused it alone in planning left its peers waiting).
      if (o.memory_budget < kMinMemoryBudget)
        fail(ErrorCode::kInvalidArgument, "policy memory budget ", o.memory_budget, " bytes is below the minimum of ",
             kMinMemoryBudget, " bytes (64 KiB): a wave must hold at least one chunk of a piece");
    }
    else if (k == "dedup") as(&o.dedup, "True or False");
    else if (k == "compare_replicas") as(&o.compare_replicas, "True or False");
    else if (k == "weights_from_master") as(&o.weights_from_master, "True or False");
    else if (k == "node_local_reads") as(&o.node_local_reads, "True or False");
    else if (k == "vocab_padding") {
      as(&name, "a string (warn or refuse)");
      if (name != "warn" && name != "refuse")
        fail(ErrorCode::kInvalidArgument, "policy 'vocab_padding' must be warn or refuse, got '", name, "'");
      o.refuse_vocab_padding_change = name == "refuse";
    }
    else
      fail(ErrorCode::kInvalidArgument, "unknown policy '", k,
           "' (known: replicas, replica_atol, strict_missing, strict_unexpected, memory_budget_bytes, dedup, "
           "compare_replicas, weights_from_master, node_local_reads, vocab_padding)");
  }
  return o;
}

py::dict plan_options_to_py(const PlanOptions& o) {
  py::dict d;
  d["replicas"] = replica_policy_name(o.replica_policy);
  d["replica_atol"] = o.replica_atol;
  d["strict_missing"] = o.strict_missing;
  d["strict_unexpected"] = o.strict_unexpected;
  d["memory_budget_bytes"] = o.memory_budget;
  d["dedup"] = o.dedup;
  d["compare_replicas"] = o.compare_replicas;
  d["weights_from_master"] = o.weights_from_master;
  d["node_local_reads"] = o.node_local_reads;
  d["vocab_padding"] = o.refuse_vocab_padding_change ? "refuse" : "warn";
  return d;
}

DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kDouble: return DType::F64;
    case at::kFloat: return DType::F32;
    case at::kHalf: return DType::F16;
    case at::kBFloat16: return DType::BF16;
    case at::kLong: return DType::I64;
    case at::kInt: return DType::I32;
    case at::kShort: return DType::I16;
    case at::kChar: return DType::I8;
    case at::kByte: return DType::U8;
    case at::kBool: return DType::Bool;
    default: fail(ErrorCode::kUnsupported, "tensor dtype ", c10::toString(t.scalar_type()), " is not supported");
  }
}

// Checks the tensors given for this rank's buffers and returns their data pointers (null for
// other ranks' buffers). Raises before anything is read or written. `any_device`: check only
// (tensors on any device but meta; no pointers returned), for reshard.load's checks before its
// first collective (CUDA tensors are loaded through host copies).
std::vector<void*> buffer_pointers(const Layout& L, int rank, const std::vector<std::optional<at::Tensor>>& tensors,
                                   const char* what, bool any_device = false) {
  if (tensors.size() != L.buffers.size())
    fail(ErrorCode::kInvalidArgument, what, ": got ", tensors.size(), " tensors for a layout of ", L.buffers.size(),
         " buffers (index them like layout.buffers; None for other ranks' buffers)");
  std::vector<void*> ptrs(L.buffers.size(), nullptr);
  for (size_t i = 0; i < L.buffers.size(); ++i) {
    const Buffer& b = L.buffers[i];
    if (b.rank != rank) continue;
    if (!tensors[i].has_value() || !tensors[i]->defined())
      fail(ErrorCode::kInvalidArgument, what, ": rank ", rank, " has no tensor for its buffer ", b.name);
    const at::Tensor& t = *tensors[i];
    if (t.device().is_meta())
      fail(ErrorCode::kInvalidArgument, what, ": tensor for buffer ", b.name, " is on meta, which holds no data to ",
           "load into or save from");
    if (!any_device && !t.device().is_cpu())
      fail(ErrorCode::kUnsupported, what, ": buffer ", b.name, " is on ", t.device().str(),
           "; this build writes CPU tensors only (stage through a CPU tensor)");
    // Tensors without plain strided storage (mkldnn, sparse, nested, wrapper subclasses): their
    // data_ptr() is not the buffer's bytes, or there is none.
    if (t.layout() != c10::kStrided || !t.has_storage() || t.is_nested())
      fail(ErrorCode::kInvalidArgument, what, ": tensor for buffer ", b.name, " has no plain strided storage (layout ",
           c10::toString(t.layout()), t.is_nested() ? ", nested" : "", "); give a dense tensor");
    if (!t.is_contiguous())
      fail(ErrorCode::kInvalidArgument, what, ": tensor for buffer ", b.name, " is not contiguous");
    // A lazy negation or conjugation view (torch._neg_view, .conj()) reads back transformed: the
    // bytes under data_ptr() are not the values the tensor shows.
    if (t.is_neg() || t.is_conj())
      fail(ErrorCode::kInvalidArgument, what, ": tensor for buffer ", b.name, " is a ",
           t.is_neg() ? "negation" : "conjugation", " view (its bytes are not its values); pass ",
           t.is_neg() ? "t.resolve_neg()" : "t.resolve_conj()", " or a plain tensor");
    DType dt;
    try {
      dt = dtype_of(t);
    } catch (const Error& e) {
      fail(ErrorCode::kUnsupported, what, ": tensor for buffer ", b.name, ": ", e.what(), " (the layout says ",
           dtype_name(b.dtype), ")");
    }
    if (dt != b.dtype)
      fail(ErrorCode::kInvalidArgument, what, ": tensor for buffer ", b.name, " has dtype ", dtype_name(dt),
           " but the layout says ", dtype_name(b.dtype));
    if (t.numel() != b.numel)
      fail(ErrorCode::kInvalidArgument, what, ": tensor for buffer ", b.name, " has ", t.numel(),
           " elements but the layout says ", b.numel);
    // The storage must hold the tensor's bytes from its offset: a storage shrunk with
    // untyped_storage().resize_() (as FSDP frees parameters) keeps the tensor's size, and writing
    // its numel would run past the allocation (heap corruption).
    const uint64_t need = (uint64_t(t.storage_offset()) + uint64_t(t.numel())) * uint64_t(t.element_size());
    const uint64_t have = uint64_t(t.storage().nbytes());
    if (b.numel > 0 && (need > have || t.storage().data() == nullptr))
      fail(ErrorCode::kInvalidArgument, what, ": tensor for buffer ", b.name, " needs ", need, " bytes of storage from ",
           "its start but its storage holds ", have, " (freed or shrunk, e.g. untyped_storage().resize_()); give a ",
           "tensor with its memory");
    if (!any_device) ptrs[i] = t.data_ptr();
  }
  // No two buffers in the same memory, device by device (addresses of two devices may coincide).
  std::map<std::string, std::vector<const void*>> by_device;
  for (size_t i = 0; i < L.buffers.size(); ++i) {
    if (L.buffers[i].rank != rank || L.buffers[i].numel == 0) continue;
    std::vector<const void*>& mem = by_device[tensors[i]->device().str()];
    mem.resize(L.buffers.size(), nullptr);
    mem[i] = tensors[i]->data_ptr();
  }
  for (const auto& [device, mem] : by_device) {
    const std::string overlap = overlapping_buffers(L, rank, mem);
    if (!overlap.empty())
      fail(ErrorCode::kInvalidArgument, what, ": the tensors for ", overlap, "; each buffer needs memory of its own");
  }
  return ptrs;
}

struct PyCheckpoint {
  std::shared_ptr<CheckpointReader> reader;
};

py::dict inspect_dict(const CheckpointReader& r) {
  const SourceLayout& s = r.source();
  const Layout& L = s.layout;
  py::dict d;
  d["writer"] = r.writer();
  d["path"] = r.path();
  d["layout"] = L.topo.to_string();
  py::dict topo;
  topo["tp"] = L.topo.tp; topo["pp"] = L.topo.pp; topo["vpp"] = L.topo.vpp; topo["dp"] = L.topo.dp;
  topo["zero"] = L.topo.zero; topo["world_size"] = L.topo.world_size();
  d["topology"] = topo;
  py::dict model;
  const ModelConfig& m = L.model;
  model["name"] = m.name; model["num_layers"] = m.num_layers; model["hidden"] = m.hidden; model["ffn"] = m.ffn;
  model["heads"] = m.heads; model["query_groups"] = m.groups(); model["vocab"] = m.vocab;
  model["padded_vocab"] = m.vocab > 0 ? m.padded_vocab(L.topo.tp) : 0;
  model["swiglu"] = m.swiglu; model["tied_embeddings"] = m.tied_embeddings; model["bias"] = m.bias;
  model["norm"] = m.norm; model["param_dtype"] = dtype_name(m.param_dtype); model["qkv_version"] = m.qkv_version;
  model["qkv_order"] = m.qkv_order_known() ? qkv_order_name(m.qkv_layout()) : "unknown";
  model["tp_gt_groups"] = qkv_variant_name(m.tp_gt_groups);
  d["model"] = model;
  py::list tensors;
  for (const auto& t : L.tensors) tensors.append(tensor_spec_to_py(t));
  d["tensors"] = tensors;
  d["files"] = s.files;
  uint64_t bytes = 0;
  for (const auto& b : L.buffers) bytes += uint64_t(b.numel) * dtype_size(b.dtype);
  d["state_bytes"] = bytes;
  d["num_buffers"] = L.buffers.size();
  d["state"] = state_to_py(r.state());
  d["notes"] = r.notes();
  return d;
}

}  // namespace
}  // namespace reshard::python

PYBIND11_MODULE(_C, m) {
  using namespace reshard;
  using namespace reshard::python;
  m.doc() = "reshard native extension; use the `reshard` package, not this module directly.";
  register_errors(m);
  m.attr("DEFAULT_VERIFY") = py::str(kDefaultVerify);
  m.def("format_bytes", &format_bytes, py::arg("bytes"),
        "A byte count for people, as every text output writes it: '1.88 GB', '51.2 KB' (reshard/units.h).");
  register_torch_comm(m);

  py::class_<ModelConfig>(m, "ModelConfig")
      .def_readonly("name", &ModelConfig::name)
      .def_readonly("num_layers", &ModelConfig::num_layers)
      .def_readonly("hidden", &ModelConfig::hidden)
      .def_readonly("ffn", &ModelConfig::ffn)
      .def_readonly("heads", &ModelConfig::heads)
      .def_property_readonly("query_groups", &ModelConfig::groups)
      .def_readonly("vocab", &ModelConfig::vocab)
      .def_readonly("swiglu", &ModelConfig::swiglu)
      .def_readonly("tied_embeddings", &ModelConfig::tied_embeddings)
      .def_property_readonly("param_dtype", [](const ModelConfig& c) { return std::string(dtype_name(c.param_dtype)); })
      .def("padded_vocab", &ModelConfig::padded_vocab)
      .def("validate_for", &ModelConfig::validate_for, py::arg("tp"), py::arg("pp"), py::arg("vpp") = 1,
           py::arg("even_stages") = true);
  m.def("model_from_yaml", &model_from_yaml, py::arg("text"), py::arg("origin"));
  m.def("load_model_config", &load_model_config, py::arg("path"));
  m.def("model_tensors", [](const ModelConfig& c, int tp) {
    py::list out;
    for (const auto& t : model_tensors(c, tp)) out.append(tensor_spec_to_py(t));
    return out;
  });

  py::class_<Layout, std::shared_ptr<Layout>>(m, "Layout")
      .def_property_readonly("topology", [](const Layout& L) { return L.topo.to_string(); })
      .def_property_readonly("world_size", [](const Layout& L) { return L.topo.world_size(); })
      .def_property_readonly("buffers", &buffers_to_py,
                             "Every buffer of every rank, in layout order: a list of dicts {name, rank, dtype "
                             "('BF16', 'F32', ...), numel (elements), state ('weight', 'fp32', 'exp_avg', "
                             "'exp_avg_sq'), group}. Built anew on each access (O(number of buffers)): keep "
                             "it in a variable rather than indexing layout.buffers in a loop.")
      .def_property_readonly("tensors", [](const Layout& L) {
        py::list out;
        for (const auto& t : L.tensors) out.append(tensor_spec_to_py(t));
        return out;
      })
      .def_property_readonly("model", [](const Layout& L) { return L.model; })
      .def_property_readonly("total_bytes", &Layout::total_bytes)
      .def_property_readonly("num_pieces", [](const Layout& L) { return L.pieces.size(); })
      .def_property_readonly("flat_groups", [](const Layout& L) {
        py::list slots;
        for (const auto& gs : L.flat_groups) {
          py::list groups;
          for (const auto& g : gs) {
            py::dict d;
            py::list entries;
            for (const auto& e : g.entries) entries.append(py::make_tuple(e.tensor, e.offset, e.numel));
            d["entries"] = entries;
            d["numel"] = g.numel;
            d["partition_size"] = g.partition_size;
            d["no_weight_decay"] = g.no_weight_decay;
            groups.append(d);
          }
          slots.append(groups);
        }
        return slots;
      });

  m.def(
      "build_layout",
      [](const ModelConfig& cfg, const std::string& topo_s, py::object stages, py::object groups,
         bool weights_on_dp0_only, bool optimizer, int align_factor) {
        Topology topo = Topology::parse(topo_s);
        DeriveOptions opt;
        opt.weights_on_dp0_only = weights_on_dp0_only;
        opt.optimizer = optimizer;
        opt.align_factor = align_factor;
        std::map<std::string, std::vector<int>> st;
        if (!stages.is_none()) {
          st = stages.cast<std::map<std::string, std::vector<int>>>();
          // The trainer's partition of the layers (DeepSpeed's PipelineModule may split them
          // unevenly): each layer's stage from its tensors, which must agree and name one stage.
          std::vector<int> stage_of_layer(size_t(std::max(cfg.num_layers, 0)), -1);
          for (const TensorSpec& t : model_tensors(cfg, topo.tp)) {
            if (t.owner != Owner::kLayer || t.layer < 0 || t.layer >= cfg.num_layers) continue;
            auto it = st.find(t.name);
            if (it == st.end()) continue;
            if (it->second.size() != 1)
              fail(ErrorCode::kInvalidArgument, "stages gives ", it->second.size(), " stages for ", t.name,
                   "; a layer's tensors live on one pipeline stage");
            if (it->second[0] < 0 || it->second[0] >= topo.pp)
              fail(ErrorCode::kInvalidArgument, "stages puts ", t.name, " on stage ", it->second[0], ", not in [0, pp=",
                   topo.pp, ")");
            int& s = stage_of_layer[size_t(t.layer)];
            if (s >= 0 && s != it->second[0])
              fail(ErrorCode::kInvalidArgument, "stages puts ", t.name, " on stage ", it->second[0],
                   " but other tensors of layer ", t.layer, " on stage ", s);
            s = it->second[0];
          }
          // Layers it does not name keep the uniform split's stage, where there is one.
          const bool named = std::any_of(stage_of_layer.begin(), stage_of_layer.end(), [](int s) { return s >= 0; });
          if (named) {
            const int chunks = topo.pp * topo.vpp;
            const bool even = chunks <= cfg.num_layers && cfg.num_layers % chunks == 0;
            const std::vector<int> uniform = uniform_stage_of_layer(cfg.num_layers, topo.pp, topo.vpp);
            for (int l = 0; l < cfg.num_layers; ++l) {
              if (stage_of_layer[size_t(l)] >= 0) continue;
              if (!even)
                fail(ErrorCode::kInvalidArgument, "stages names no stage for layer ", l, ", and num_layers=",
                     cfg.num_layers, " is not divisible by pp*vpp=", chunks, ", so it has no uniform stage either");
              stage_of_layer[size_t(l)] = uniform[size_t(l)];
            }
            opt.stage_of_layer = std::move(stage_of_layer);
          }
        }
        LayoutRecipe r = default_recipe(cfg, topo, opt);
        if (!stages.is_none()) {
          for (size_t i = 0; i < r.tensors.size(); ++i) {
            auto it = st.find(r.tensors[i].name);
            if (it != st.end()) r.stages[i] = it->second;
          }
          for (const auto& [name, v] : st) {
            bool known = false;
            for (const auto& t : r.tensors) known |= t.name == name;
            if (!known) fail(ErrorCode::kInvalidArgument, "stages names tensor ", name, " that the model does not have");
          }
        }
        if (!groups.is_none()) {
          py::list slots = groups.cast<py::list>();
          if (int(slots.size()) != topo.pp * topo.tp)
            fail(ErrorCode::kInvalidArgument, "groups has ", slots.size(), " (pp, tp) slots; expected pp*tp=", topo.pp * topo.tp);
          r.groups.assign(slots.size(), {});
          for (size_t s = 0; s < slots.size(); ++s) {
            for (py::handle gh : slots[s].cast<py::list>()) {
              py::dict gd = gh.cast<py::dict>();
              FlatGroup g;
              for (py::handle eh : gd["entries"].cast<py::list>()) {
                auto e = eh.cast<py::tuple>();
                g.entries.push_back({e[0].cast<std::string>(), e[1].cast<int64_t>(), e[2].cast<int64_t>()});
              }
              g.numel = gd["numel"].cast<int64_t>();
              g.partition_size = gd["partition_size"].cast<int64_t>();
              if (gd.contains("no_weight_decay")) g.no_weight_decay = gd["no_weight_decay"].cast<bool>();
              r.groups[s].push_back(std::move(g));
            }
          }
        }
        return std::make_shared<Layout>(build_layout(cfg, topo, r, opt));
      },
      py::arg("model"), py::arg("topology"), py::arg("stages") = py::none(), py::arg("groups") = py::none(),
      py::arg("weights_on_dp0_only") = false, py::arg("optimizer") = true, py::arg("align_factor") = 2);

  m.def(
      "explicit_layout",
      [](const std::string& name, const std::string& topo_s, const py::list& arrays, const py::list& buffers) {
        std::vector<ExplicitArray> as;
        for (py::handle h : arrays) {
          auto t = h.cast<py::tuple>();
          as.push_back({t[0].cast<std::string>(), state_kind_from_name(t[1].cast<std::string>()),
                        t[2].cast<std::vector<int64_t>>()});
        }
        std::vector<ExplicitBuffer> bs;
        for (py::handle h : buffers) {
          auto t = h.cast<py::tuple>();
          ExplicitBuffer b;
          b.name = t[0].cast<std::string>();
          b.rank = t[1].cast<int>();
          b.dtype = dtype_from_name(t[2].cast<std::string>());
          b.array = t[3].cast<int32_t>();
          b.offsets = t[4].cast<std::vector<int64_t>>();
          b.sizes = t[5].cast<std::vector<int64_t>>();
          bs.push_back(std::move(b));
        }
        return std::make_shared<Layout>(explicit_layout(name, Topology::parse(topo_s), as, bs));
      },
      py::arg("name"), py::arg("topology"), py::arg("arrays"), py::arg("buffers"),
      "A layout given box by box (reshard::explicit_layout): arrays [(tensor, state, global shape)], buffers "
      "[(name, rank, dtype name, array index, offsets, sizes)]; each buffer one row-major box of its array.");

  py::class_<PyCheckpoint>(m, "Checkpoint")
      .def_property_readonly("writer", [](const PyCheckpoint& c) { return c.reader->writer(); })
      .def_property_readonly("path", [](const PyCheckpoint& c) { return c.reader->path(); })
      .def_property_readonly("layout", [](const PyCheckpoint& c) { return std::make_shared<Layout>(c.reader->source().layout); })
      .def_property_readonly("topology", [](const PyCheckpoint& c) { return c.reader->source().layout.topo.to_string(); })
      .def_property_readonly("model", [](const PyCheckpoint& c) { return c.reader->source().layout.model; })
      .def_property_readonly("state", [](const PyCheckpoint& c) { return state_to_py(c.reader->state()); })
      .def_property_readonly("notes", [](const PyCheckpoint& c) { return c.reader->notes(); })
      .def("inspect", [](const PyCheckpoint& c) { return inspect_dict(*c.reader); });

  m.def(
      "open_checkpoint",
      [](const std::string& path, const std::string& step, const std::string& model_path,
         std::optional<ModelConfig> model) {
        OpenOptions o;
        o.step = step;
        o.model_path = model_path;
        o.model = std::move(model);
        PyCheckpoint c;
        {
          py::gil_scoped_release nogil;
          c.reader = std::shared_ptr<CheckpointReader>(open_checkpoint(path, o));
        }
        return c;
      },
      py::arg("path"), py::arg("step") = "", py::arg("model_path") = "", py::arg("model") = py::none());

  m.def("plan_options", [](const py::dict& d) { return plan_options_to_py(plan_options_from_py(d)); });

  m.def(
      "plan",
      [](const PyCheckpoint& c, const Layout& target, const py::dict& options) {
        PlanOptions po = plan_options_from_py(options);
        double secs = 0;
        std::string out;
        {
          py::gil_scoped_release nogil;
          Plan p = plan_load(*c.reader, target, po, &secs);
          out = plan_summary_json(p, secs, target);
        }
        return out;
      },
      py::arg("checkpoint"), py::arg("target"), py::arg("options"));

  m.def(
      "load",
      [](const PyCheckpoint& c, const Layout& target, const std::vector<std::optional<at::Tensor>>& tensors,
         std::shared_ptr<Communicator> comm, const py::dict& options, int io_threads, const std::string& verify,
         const py::object& progress) {
        LoadOptions lo;
        lo.plan = plan_options_from_py(options);
        lo.io_threads = io_threads;
        lo.verify = verify;
        if (!progress.is_none()) {
          // Called on this thread with the GIL released around the load: take it back for the call.
          // A callback that raises must not fail one rank alone (its peers would wait for it in
          // the next collective): the exception is logged on logger "reshard" and the load goes on.
          auto warned = std::make_shared<bool>(false);
          lo.on_progress = [progress, warned](const LoadProgress& p) {
            py::gil_scoped_acquire gil;
            try {
              py::dict d;
              d["stage"] = p.stage;
              d["index"] = p.index;
              d["count"] = p.count;
              d["bytes_done"] = p.bytes_done;
              d["bytes_total"] = p.bytes_total;
              d["seconds"] = p.seconds;
              progress(d);
            } catch (py::error_already_set& e) {
              const std::string what = e.what();
              e.restore();
              PyErr_Clear();
              if (*warned) return;  // once per load
              *warned = true;
              try {
                py::module_::import("logging").attr("getLogger")("reshard").attr("warning")(
                    "reshard.load: the progress callback raised (ignored for the rest of this load): %s", what);
              } catch (py::error_already_set&) {
                PyErr_Clear();
              }
            }
          };
        }
        std::vector<void*> ptrs = buffer_pointers(target, comm->rank(), tensors, "reshard.load");
        LoadReport r;
        {
          py::gil_scoped_release nogil;
          r = load(*c.reader, target, ptrs, *comm, lo);
        }
        py::dict d = py::module_::import("json").attr("loads")(r.to_json());
        d["text"] = r.to_text();
        d["plan_seconds"] = r.plan_seconds;
        d["state"] = state_to_py(r.state);
        return d;
      },
      py::arg("checkpoint"), py::arg("target"), py::arg("tensors"), py::arg("comm"), py::arg("options"),
      py::arg("io_threads") = 0, py::arg("verify") = "free", py::arg("progress") = py::none());

  m.def(
      "check_buffers",
      [](const Layout& L, int rank, const std::vector<std::optional<at::Tensor>>& tensors, const std::string& what) {
        buffer_pointers(L, rank, tensors, what.c_str(), /*any_device=*/true);
      },
      py::arg("layout"), py::arg("rank"), py::arg("tensors"), py::arg("what"));
  m.def(
      "check_state", [](const py::dict& state, const Layout& L) { state_from_py(state, L.topo.world_size()); },
      py::arg("state"), py::arg("layout"));

  m.def(
      "save",
      [](const std::string& root, const std::string& step, const Layout& layout,
         const std::vector<std::optional<at::Tensor>>& tensors, const py::dict& state, std::shared_ptr<Communicator> comm) {
        std::vector<void*> ptrs = buffer_pointers(layout, comm->rank(), tensors, "reshard.save");
        std::vector<const void*> cptrs(ptrs.begin(), ptrs.end());
        NonTensorState s = state_from_py(state, layout.topo.world_size());
        py::gil_scoped_release nogil;
        save_native(root, step, layout, cptrs, s, *comm);
      },
      py::arg("root"), py::arg("step"), py::arg("layout"), py::arg("tensors"), py::arg("state"), py::arg("comm"));

  m.def(
      "save_all_ranks",
      [](const std::string& root, const std::string& step, const Layout& layout,
         const std::vector<std::optional<at::Tensor>>& tensors, const py::dict& state) {
        // Every buffer of every rank is given: check them all as if each rank were this one.
        std::vector<void*> ptrs(layout.buffers.size(), nullptr);
        for (int r = 0; r < layout.topo.world_size(); ++r) {
          std::vector<void*> pr = buffer_pointers(layout, r, tensors, "reshard.save_all_ranks");
          for (size_t i = 0; i < pr.size(); ++i)
            if (layout.buffers[i].rank == r) ptrs[i] = pr[i];
        }
        std::vector<const void*> cptrs(ptrs.begin(), ptrs.end());
        NonTensorState s = state_from_py(state, layout.topo.world_size());
        py::gil_scoped_release nogil;
        save_native_all_ranks(root, step, layout, cptrs, s);
      },
      py::arg("root"), py::arg("step"), py::arg("layout"), py::arg("tensors"), py::arg("state"));

  m.def(
      "synth_checkpoint",
      [](const std::string& root, const ModelConfig& model, const std::string& topo, uint64_t seed, const std::string& step) {
        py::gil_scoped_release nogil;
        synth_checkpoint(root, model, Topology::parse(topo), seed, step);
      },
      py::arg("root"), py::arg("model"), py::arg("topology"), py::arg("seed"), py::arg("step") = "step-1");

  m.def("load_resume_config", [](const std::string& path) {
    ResumeConfig rc = load_resume_config(path);
    py::dict d;
    d["checkpoint"] = rc.checkpoint;
    d["step"] = rc.step;
    d["model"] = rc.model;
    d["target"] = rc.target.to_string();
    py::dict t;
    t["tp"] = rc.target.tp; t["pp"] = rc.target.pp; t["vpp"] = rc.target.vpp; t["dp"] = rc.target.dp; t["zero"] = rc.target.zero;
    d["target_topology"] = t;
    d["policies"] = plan_options_to_py(rc.plan);
    d["verify"] = rc.verify;
    if (rc.target_auto) {
      d["target"] = "auto";
      d["target_topology"] = py::none();
    }
    py::dict el;
    el["policy"] = ElasticPolicy::kind_name(rc.elastic_policy);
    el["allowed"] = rc.elastic_allowed;
    d["elastic"] = el;
    return d;
  });

  m.def(
      "choose_layout",
      [](const std::string& saved_text, int64_t world, const std::string& policy, const std::vector<std::string>& allowed,
         int64_t global_batch, std::optional<ModelConfig> model) {
        const Topology saved = Topology::parse(saved_text);
        ElasticPolicy p;
        p.kind = ElasticPolicy::parse_kind(policy);
        for (const auto& a : allowed) p.allowed.push_back(parse_candidate(a, saved));
        std::function<std::string(const Topology&)> fits;
        if (model)
          fits = [&](const Topology& t) {
            try {
              model->validate_for(t.tp, t.pp, t.vpp);
            } catch (const Error& e) {
              return std::string(e.what());
            }
            return std::string();
          };
        const LayoutChoice c = choose_layout(saved, world, p, global_batch, fits);
        py::dict d;
        d["target"] = c.target.to_string();
        d["reason"] = c.reason;
        d["tried"] = c.tried;
        return d;
      },
      py::arg("saved"), py::arg("world_size"), py::arg("policy") = "keep", py::arg("allowed") = std::vector<std::string>{},
      py::arg("global_batch") = 0, py::arg("model") = py::none());
  m.def(
      "plan_batch",
      [](int64_t global_batch, int64_t micro_batch, int64_t dp) {
        const BatchPlan b = plan_batch(global_batch, micro_batch, dp);
        py::dict d;
        d["global_batch"] = b.global_batch;
        d["micro_batch"] = b.micro_batch;
        d["grad_accum"] = b.grad_accum;
        d["reason"] = b.reason;
        return d;
      },
      py::arg("global_batch"), py::arg("micro_batch"), py::arg("dp"));

  m.def("parse_topology", [](const std::string& s) {
    Topology t = Topology::parse(s);
    py::dict d;
    d["tp"] = t.tp; d["pp"] = t.pp; d["vpp"] = t.vpp; d["dp"] = t.dp; d["zero"] = t.zero;
    d["world_size"] = t.world_size();
    d["text"] = t.to_string();
    return d;
  });
  m.def("describe_change", [](const std::string& a, const std::string& b) {
    return describe_change(Topology::parse(a), Topology::parse(b));
  });

  // Raw memory as a uint8 tensor (no copy): used by the torch communicator's callbacks.
  m.def("tensor_from_ptr", [](uintptr_t ptr, int64_t nbytes) {
    return torch::from_blob(reinterpret_cast<void*>(ptr), {nbytes}, torch::TensorOptions().dtype(torch::kUInt8));
  });
  // Communicator conformance helpers (tests): the C++ entry points with tensors as memory.
  m.def("_comm_all_to_all_v", [](Communicator& c, const at::Tensor& send, std::vector<uint64_t> sc, std::vector<uint64_t> sd,
                                 at::Tensor recv, std::vector<uint64_t> rc, std::vector<uint64_t> rd) {
    const void* s = send.data_ptr();
    void* r = recv.data_ptr();
    py::gil_scoped_release nogil;
    c.all_to_all_v(s, sc, sd, r, rc, rd);
  });
  m.def("_comm_broadcast", [](Communicator& c, at::Tensor t, int root, std::vector<int> group) {
    void* p = t.data_ptr();
    uint64_t n = uint64_t(t.numel()) * t.element_size();
    py::gil_scoped_release nogil;
    c.broadcast(p, n, root, group);
  });
}
