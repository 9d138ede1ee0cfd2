// open_checkpoint: detects the format of a path and resolves the step folder to open.
#include <algorithm>
#include <cctype>
#include <filesystem>

#include "formats/dcp/dcp_reader.h"
#include "formats/deepspeed/deepspeed_reader.h"
#include "formats/native/native_internal.h"
#include "io/file.h"
#include "reshard/checkpoint.h"
#include "reshard/config.h"
#include "reshard/consolidate.h"
#include "reshard/error.h"
#include "reshard/native.h"
#include "reshard/plan.h"

namespace reshard {
namespace {

bool ends_with(const std::string& s, const std::string& suf) {
  return s.size() >= suf.size() && s.compare(s.size() - suf.size(), suf.size(), suf) == 0;
}


std::string trim(std::string s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  size_t i = 0;
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  return s.substr(i);
}

std::string join_list(const std::vector<std::string>& v) {
  if (v.empty()) return "(none)";
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) {
    if (i == 20) {
      out += ", ... (" + std::to_string(v.size()) + " in all)";
      break;
    }
    out += (i ? ", " : "") + v[i];
  }
  return out;
}

// Trailing decimal number of a step folder name ("global_step20" -> 20, "iter_0000020" -> 20).
bool trailing_number(const std::string& s, unsigned long long* out) {
  size_t i = s.size();
  while (i > 0 && std::isdigit(static_cast<unsigned char>(s[i - 1]))) --i;
  if (i == s.size() || s.size() - i > 18) return false;
  *out = std::stoull(s.substr(i));
  return true;
}

bool all_digits(const std::string& s) {
  return !s.empty() && s.size() <= 18 && std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isdigit(c); });
}

bool plain_name(const std::string& s) {
  const bool printable = std::all_of(s.begin(), s.end(), [](char c) { return uint8_t(c) >= 0x20 && c != 127; });
  return !s.empty() && printable && s != "." && s != ".." && s.find('/') == std::string::npos;
}

// Step folders in a root, sorted by trailing number then name.
std::vector<std::string> list_steps(const std::string& root) {
  std::vector<std::string> steps;
  for (const auto& n : io::list_dir(root)) {
    if (n.empty() || n[0] == '.') continue;  // temporaries of unfinished saves
    const std::string d = io::join(root, n);
    if (io::is_dir(d) && (is_native_step(d) || is_deepspeed_step(d) || is_dcp_step(d))) steps.push_back(n);
  }
  // A total order: folders without a step number first (they cannot be placed in time), then by
  // number, then by name; "newest" tries the last first.
  std::sort(steps.begin(), steps.end(), [](const std::string& a, const std::string& b) {
    unsigned long long x = 0, y = 0;
    const bool hx = trailing_number(a, &x), hy = trailing_number(b, &y);
    if (hx != hy) return !hx;
    if (hx && x != y) return x < y;
    return a < b;
  });
  return steps;
}

std::string resolve_step(const std::string& root, const std::string& asked, const std::vector<std::string>& steps) {
  if (plain_name(asked) && io::is_dir(io::join(root, asked))) return asked;
  if (all_digits(asked)) {
    const unsigned long long want = std::stoull(asked);
    std::vector<std::string> hits;
    for (const auto& s : steps) {
      unsigned long long n;
      if (trailing_number(s, &n) && n == want) hits.push_back(s);
    }
    if (hits.size() == 1) return hits[0];
    if (hits.size() > 1)
      fail(ErrorCode::kInvalidArgument, "step ", asked, " is ambiguous in ", root, ": ", join_list(hits),
           "; give the folder name");
  }
  fail(ErrorCode::kNotFound, "step '", asked, "' not found in ", root, "; available steps: ", join_list(steps));
}

std::unique_ptr<CheckpointReader> open_step(const std::string& dir, const OpenOptions& opt,
                                            std::vector<std::string> notes) {
  if (is_native_step(dir)) {
    if (!gives_model(opt)) return open_native(dir, std::move(notes));
    // A native step records its model; a model file given too must describe the same model,
    // or the caller believes in shapes and cuts the load does not use (DeepSpeed sources refuse
    // the same contradiction against the trainer's `args`).
    const ModelConfig given = given_model(opt);
    notes.push_back(given_model_name(opt) + " agrees with the model the checkpoint records");
    auto reader = open_native(dir, std::move(notes));
    const std::string differ = model_differences(reader->source().layout.model, given);
    if (!differ.empty())
      fail(ErrorCode::kInvalidArgument, io::join(dir, native::kMetadataFile), ": ", given_model_name(opt),
           " disagrees with the model this checkpoint records (recorded vs model file): ", differ,
           ". A native checkpoint's own record decides its shapes and cuts; leave the model file out, or give the one "
           "it was saved with");
    return reader;
  }
  if (is_deepspeed_step(dir)) return open_deepspeed(dir, opt, std::move(notes));
  if (is_dcp_step(dir)) return open_dcp(dir, opt, std::move(notes));
  const std::string meta = io::join(dir, native::kMetadataFile);
  if (io::exists(meta) && !io::is_file(meta))
    fail(ErrorCode::kDataLoss, meta, " is not a regular file (a folder?); a native step's metadata is a JSON file");
  fail(ErrorCode::kInvalidArgument, dir, " is not a step folder: it holds neither ", native::kMetadataFile,
       " (native) nor *_model_states.pt (DeepSpeed) nor .metadata (torch.distributed.checkpoint)");
}

// "" when an opened step is complete, else why not: a data file its metadata names is missing,
// or some tensor's elements are covered by no file (a save killed before every rank wrote).
std::string incomplete_reason(const CheckpointReader& r) {
  for (const auto& n : r.notes())
    if (is_missing_file_note(n)) return n;
  const SourceLayout& src = r.source();
  Topology t1;
  t1.tp = src.layout.topo.tp;
  const std::vector<CoverageGap> gaps = find_coverage_gaps(src, layout_like(src, t1));
  if (gaps.empty()) return "";
  return "tensor " + gaps[0].tensor + " (" + state_kind_name(gaps[0].state) + "): elements " +
         gaps[0].region.to_string() + " covered by no file" +
         (gaps.size() > 1 ? " (and " + std::to_string(gaps.size() - 1) + " more gaps)" : std::string());
}

// The newest complete step of a root (OpenOptions::newest_complete).
std::unique_ptr<CheckpointReader> open_newest_complete(const std::string& root, const std::vector<std::string>& steps,
                                                       const OpenOptions& opt, const std::string& latest_names) {
  // The model file is read first: its own errors (a missing file) are not a step's.
  if (gives_model(opt)) (void)given_model(opt);
  std::vector<std::string> skipped;
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    std::vector<std::string> notes = skipped;
    notes.push_back("newest complete step: " + *it +
                    (latest_names.empty() || latest_names == *it ? std::string()
                                                                 : " (`latest` names " + latest_names.substr(0, 64) + ")"));
    std::string why;
    try {
      auto r = open_step(io::join(root, *it), opt, notes);
      why = incomplete_reason(*r);
      if (why.empty()) return r;
    } catch (const Error& e) {
      // Damaged or partial files are what an unfinished save leaves; any other error (a model
      // that disagrees, an unsupported format) is the caller's to see, not a reason to go back.
      if (e.code() != ErrorCode::kDataLoss && e.code() != ErrorCode::kNotFound) throw;
      why = e.what();
    }
    skipped.push_back("skipped step " + *it + ", not complete (a save that did not finish?): " + why);
  }
  std::string list;  // one line: error messages are single-line (control characters escaped)
  for (const auto& s : skipped) list += " " + s + ";";
  if (!list.empty()) list.pop_back();
  fail(ErrorCode::kNotFound, "no complete step in ", root, " (", steps.size(), " step folder(s) found)",
       steps.empty() ? std::string() : ":" + list);
}

}  // namespace

bool is_missing_file_note(const std::string& note) {
  return note.rfind("missing data file ", 0) == 0 || note.rfind("missing file: ", 0) == 0;
}

bool gives_model(const OpenOptions& opt) { return opt.model.has_value() || !opt.model_path.empty(); }

ModelConfig given_model(const OpenOptions& opt) {
  if (opt.model && !opt.model_path.empty())
    fail(ErrorCode::kInvalidArgument, "open: give a model description or a model file (", opt.model_path, "), not both");
  return opt.model ? *opt.model : load_model_config(opt.model_path);
}

std::string given_model_name(const OpenOptions& opt) {
  return opt.model ? std::string("the given model description") : "the model file " + opt.model_path;
}


bool is_native_step(const std::string& dir) { return io::is_file(io::join(dir, native::kMetadataFile)); }

bool is_deepspeed_step(const std::string& dir) {
  if (!io::is_dir(dir)) return false;
  for (const auto& n : io::list_dir(dir))
    if (ends_with(n, "_model_states.pt")) return true;
  return false;
}

std::unique_ptr<CheckpointReader> open_checkpoint(const std::string& path_in, const OpenOptions& opt) {
  std::string path = path_in;
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  if (path.empty()) fail(ErrorCode::kInvalidArgument, "empty checkpoint path");
  if (!io::exists(path)) fail(ErrorCode::kNotFound, "checkpoint path ", path, " does not exist");
  if (!io::is_dir(path)) fail(ErrorCode::kInvalidArgument, path, " is a file; give the checkpoint folder");

  // A step folder given directly.
  const bool native_step = is_native_step(path), ds_step = !native_step && is_deepspeed_step(path);
  if (native_step || ds_step || is_dcp_step(path)) {
    const std::string name = io::base_name(path);
    if (!opt.step.empty() && opt.step != name) {
      unsigned long long n;
      if (!(all_digits(opt.step) && trailing_number(name, &n) && n == std::stoull(opt.step)))
        fail(ErrorCode::kInvalidArgument, path, " is the step folder '", name, "' but step '", opt.step,
             "' was asked; give the checkpoint root to choose a step");
    }
    return open_step(path, opt, {"a step folder was given; loading that step (" + name + ")"});
  }

  const std::vector<std::string> entries = io::list_dir(path);
  if (entries.empty()) fail(ErrorCode::kInvalidArgument, path, " is an empty folder; no checkpoint there");
  const std::vector<std::string> steps = list_steps(path);

  std::string step;
  std::vector<std::string> notes;
  const std::string latest = io::join(path, native::kLatestFile);
  const std::string megatron_latest = io::join(path, "latest_checkpointed_iteration.txt");
  // `--step newest` (CLI, resume YAML, Python) asks the same, unless a folder has that name.
  const bool newest = (opt.newest_complete && opt.step.empty()) ||
                      (opt.step == kNewestStep && !io::is_dir(io::join(path, kNewestStep)));
  if (newest) {
    std::string named;
    if (io::is_file(latest)) named = trim(io::read_text(latest, 4096));
    else if (io::is_file(megatron_latest)) named = "iteration " + trim(io::read_text(megatron_latest, 4096));
    if (steps.empty())
      fail(ErrorCode::kInvalidArgument, path, " is not a checkpoint folder: no step folders (it holds ",
           join_list(entries), ")");
    return open_newest_complete(path, steps, opt, named);
  }
  if (!opt.step.empty()) {
    step = resolve_step(path, opt.step, steps);
    notes.push_back("loading the asked step " + step);
  } else if (io::is_file(latest)) {
    step = trim(io::read_text(latest, 4096));
    const std::string shown = native::quoted_cut(step);  // it may be a link to any file
    if (!plain_name(step)) fail(ErrorCode::kDataLoss, latest, " holds ", shown, ", which is not a step folder name");
    if (!io::is_dir(io::join(path, step)))
      fail(ErrorCode::kNotFound, latest, " names step ", shown, " but no such folder exists in ", path,
           "; available steps: ", join_list(steps));
    notes.push_back("`latest` names " + step);
  } else if (io::is_file(megatron_latest)) {
    std::string it = trim(io::read_text(megatron_latest, 4096));
    if (!all_digits(it)) fail(ErrorCode::kDataLoss, megatron_latest, " holds '", it, "', not an iteration number");
    char iter_name[64];
    std::snprintf(iter_name, sizeof iter_name, "iter_%07llu", std::stoull(it));
    const std::vector<std::string> candidates = {"global_step" + it, iter_name};
    for (const auto& c : candidates)
      if (io::is_dir(io::join(path, c))) step = c;
    if (step.empty())
      fail(ErrorCode::kNotFound, megatron_latest, " names iteration ", it, " but neither ",
           io::join(path, candidates[0]), " nor ", io::join(path, candidates[1]), " exists; available steps: ",
           join_list(steps));
    notes.push_back("latest_checkpointed_iteration.txt names " + step);
  } else if (std::error_code ec; std::filesystem::exists(std::filesystem::symlink_status(latest, ec))) {
    // Something named `latest` that is not a readable regular file: say so, not "no latest".
    fail(ErrorCode::kDataLoss, latest, " is not a regular file (a folder, FIFO, device or a link to none of a file); "
         "it should hold the name of the step to load. Steps found: ", join_list(steps), "; choose one (--step)");
  } else if (!steps.empty()) {
    fail(ErrorCode::kNotFound, path, " has no `latest` file and no step was asked; steps found: ", join_list(steps),
         "; choose one (--step)");
  } else {
    fail(ErrorCode::kInvalidArgument, path, " is not a checkpoint folder: no ", native::kMetadataFile,
         ", no `latest`, no step folders, no *_model_states.pt, no .metadata (it holds ", join_list(entries), ")");
  }
  return open_step(io::join(path, step), opt, std::move(notes));
}

}  // namespace reshard
