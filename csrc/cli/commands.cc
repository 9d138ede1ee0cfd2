#include "cli/commands.h"

#include <sys/stat.h>
#include <unistd.h>

#include <climits>
#include <cstdlib>

#include "io/file.h"
#include "reshard/checkpoint.h"
#include "reshard/error.h"

namespace reshard::cli {

namespace {
bool exists(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0;
}

// Directory holding the configs: $RESHARD_HOME/configs, else ../configs beside the binary (the
// installed package: reshard/bin/reshard and reshard/configs), else the source tree the binary
// was built from.
std::string configs_dir() {
  if (const char* h = std::getenv("RESHARD_HOME")) return std::string(h) + "/configs";
  char exe[4096];
  const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (n > 0) {
    std::string dir(exe, size_t(n));
    dir = dir.substr(0, dir.find_last_of('/'));
    const std::string installed = dir + "/../configs";
    if (exists(installed + "/models")) return installed;
  }
#ifdef RESHARD_SOURCE_DIR
  return std::string(RESHARD_SOURCE_DIR) + "/configs";
#else
  return "configs";
#endif
}
}  // namespace

std::vector<int> same_pp_stages(const Layout& source, const Topology& target) {
  if (target.pp != source.topo.pp || target.vpp != 1 || source.topo.vpp != 1) return {};
  return stage_of_layer_in(source);
}

uint64_t parse_size(const std::string& s, const char* what) {
  // Exact, in integers: digits, an optional fraction (with a unit: 1.5GiB), an optional unit. A
  // double lost bytes above 2^53 and took "4096.5" and " 4096".
  size_t i = 0;
  unsigned __int128 whole = 0, frac = 0, scale = 1;
  const size_t digits_at = i;
  for (; i < s.size() && s[i] >= '0' && s[i] <= '9'; ++i) {
    whole = whole * 10 + unsigned(s[i] - '0');
    if (whole > ~uint64_t(0)) fail(ErrorCode::kInvalidArgument, what, " '", s, "' is too large (at most 2^64 - 1 bytes)");
  }
  if (i == digits_at) fail(ErrorCode::kInvalidArgument, what, " '", s, "' is not a size (e.g. 4096, 64KiB, 1.5GiB)");
  bool has_fraction = false;
  if (i < s.size() && s[i] == '.') {
    has_fraction = true;
    const size_t at = ++i;
    for (; i < s.size() && s[i] >= '0' && s[i] <= '9'; ++i) {
      if (i - at >= 9) fail(ErrorCode::kInvalidArgument, what, " '", s, "': at most 9 digits after the point");
      frac = frac * 10 + unsigned(s[i] - '0');
      scale *= 10;
    }
    if (i == at) fail(ErrorCode::kInvalidArgument, what, " '", s, "' is not a size (e.g. 4096, 64KiB, 1.5GiB)");
  }
  const std::string unit = s.substr(i);
  uint64_t mult = 1;
  if (unit == "" || unit == "B") mult = 1;
  else if (unit == "KiB") mult = uint64_t(1) << 10;
  else if (unit == "MiB") mult = uint64_t(1) << 20;
  else if (unit == "GiB") mult = uint64_t(1) << 30;
  else if (unit == "KB") mult = 1000;
  else if (unit == "MB") mult = 1000 * 1000;
  else if (unit == "GB") mult = 1000 * 1000 * 1000;
  else fail(ErrorCode::kInvalidArgument, what, " '", s, "': unknown unit '", unit, "' (B, KiB, MiB, GiB, KB, MB, GB)");
  // bytes = (whole + frac / scale) * mult, which must be a whole number of bytes.
  const unsigned __int128 num = (whole * scale + frac) * mult;
  if (has_fraction && num % scale != 0)
    fail(ErrorCode::kInvalidArgument, what, " '", s, "' is not a whole number of bytes");
  const unsigned __int128 bytes = num / scale;
  if (bytes > ~uint64_t(0)) fail(ErrorCode::kInvalidArgument, what, " '", s, "' is too large (at most 2^64 - 1 bytes)");
  if (bytes == 0) fail(ErrorCode::kInvalidArgument, what, " '", s, "' must be positive");
  return uint64_t(bytes);
}

std::string resolve_model_path(const std::string& model) {
  if (exists(model)) return model;
  for (const std::string& cand : {configs_dir() + "/models/" + model, configs_dir() + "/models/" + model + ".yaml"})
    if (exists(cand)) return cand;
  fail(ErrorCode::kNotFound, "model file '", model, "' not found (give a path or a name under ", configs_dir(), "/models)");
}

std::vector<Command> all_commands() {
  std::vector<Command> v;
  v.push_back(plan_command());
  for (auto f : {inspect_command, verify_command, convert_command, synth_command, diff_command, bench_command}) {
    Command c = f();
    if (c.add) v.push_back(c);
  }
  return v;
}

ResumeConfig read_config_request(const std::string& command, const std::string& path,
                                 std::initializer_list<std::pair<bool, const char*>> flags) {
  for (const auto& [given, flag] : flags)
    if (given)
      fail(ErrorCode::kInvalidArgument, command, " --config ", path, " sets the checkpoint, target and policies; ", flag,
           " cannot be given with it (edit the config, or ", command, " without --config)");
  return load_resume_config(path);
}

LayoutChoice choose_config_target(const ResumeConfig& rc, int64_t world, int64_t global_batch, const std::string& path,
                                  std::string* step_out) {
  if (world == 0)
    fail(ErrorCode::kInvalidArgument, path, ": target is auto (chosen at restart from the job's world size); give ",
         "--world-size N, the ranks of the job that restarts");
  if (world < 1) fail(ErrorCode::kInvalidArgument, "--world-size ", world, " must be at least 1");
  if (global_batch < 0) fail(ErrorCode::kInvalidArgument, "--global-batch ", global_batch, " must be at least 1");
  OpenOptions oo;
  oo.step = rc.step.empty() ? std::string(kNewestStep) : rc.step;
  if (!rc.model.empty()) oo.model_path = resolve_model_path(rc.model);
  auto ckpt = open_checkpoint(rc.checkpoint, oo);
  const SourceLayout& src = ckpt->source();
  ElasticPolicy p;
  p.kind = rc.elastic_policy;
  for (const auto& a : rc.elastic_allowed) p.allowed.push_back(parse_candidate(a, src.layout.topo));
  const ModelConfig& m = src.layout.model;
  auto fits = [&m](const Topology& t) {
    try {
      m.validate_for(t.tp, t.pp, t.vpp);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  if (step_out) *step_out = io::base_name(ckpt->path());
  return choose_layout(src.layout.topo, world, p, global_batch, fits);
}

}  // namespace reshard::cli
