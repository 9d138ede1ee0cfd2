#include "cli/commands.h"

#include <sys/stat.h>
#include <unistd.h>

#include <climits>
#include <cstdlib>

#include "reshard/error.h"

namespace reshard::cli {

namespace {
bool exists(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0;
}

// Directory holding the configs: $RESHARD_HOME, else the source tree the binary was built from.
std::string configs_dir() {
  if (const char* h = std::getenv("RESHARD_HOME")) return std::string(h) + "/configs";
#ifdef RESHARD_SOURCE_DIR
  return std::string(RESHARD_SOURCE_DIR) + "/configs";
#else
  return "configs";
#endif
}
}  // namespace

uint64_t parse_size(const std::string& s, const char* what) {
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  std::string unit = end ? end : "";
  double mult = 1;
  if (unit == "" || unit == "B") mult = 1;
  else if (unit == "KiB") mult = 1024.0;
  else if (unit == "MiB") mult = 1024.0 * 1024;
  else if (unit == "GiB") mult = 1024.0 * 1024 * 1024;
  else if (unit == "KB") mult = 1e3;
  else if (unit == "MB") mult = 1e6;
  else if (unit == "GB") mult = 1e9;
  else fail(ErrorCode::kInvalidArgument, what, " '", s, "': unknown unit '", unit, "' (B, KiB, MiB, GiB, KB, MB, GB)");
  if (!(v > 0)) fail(ErrorCode::kInvalidArgument, what, " '", s, "' must be positive");
  // 2^64 and above would wrap (a tester's 18446744073709551616 became "0 bytes").
  if (!(v * mult < 18446744073709551616.0))
    fail(ErrorCode::kInvalidArgument, what, " '", s, "' is too large (at most 2^64 - 1 bytes)");
  return uint64_t(v * mult);
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

}  // namespace reshard::cli
