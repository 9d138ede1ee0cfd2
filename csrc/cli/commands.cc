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
