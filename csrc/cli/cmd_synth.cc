// reshard synth: a checkpoint with deterministic pseudo-random weights and optimizer state
// (16-bit weights, fp32 master, exp_avg, exp_avg_sq, step) at any layout, written by one process.
// Every element is a pure function of (seed, tensor, state, logical index), so synth at two
// layouts with the same seed holds the same consolidated model (native.h synth_checkpoint).
#include <cstdio>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "io/file.h"
#include "reshard/config.h"
#include "reshard/error.h"
#include "reshard/layout.h"
#include "reshard/native.h"
#include "reshard/units.h"

namespace reshard::cli {

namespace {
struct SynthArgs {
  std::string out, model, layout, step;
  uint64_t seed = 0;
  bool json = false;
};
}  // namespace

Command synth_command() {
  auto a = std::make_shared<SynthArgs>();
  Command c;
  c.add = [a](CLI::App& app) {
    CLI::App* s = app.add_subcommand("synth", "Write a checkpoint with deterministic pseudo-random state");
    s->add_option("OUT", a->out, "Checkpoint root to write (created; `latest` names the new step)")->required();
    s->add_option("--model", a->model, "Model YAML (path or name under configs/models)")->required();
    s->add_option("--layout", a->layout, "Layout, e.g. tp=2,pp=2,dp=2,zero=1")->required();
    s->add_option("--seed", a->seed, "Seed of the values (default 0)")
        ->check(CLI::Validator(
            [](std::string& v) { return v.find('-') == std::string::npos ? std::string() : "must be >= 0, got " + v; },
            "SEED"));
    s->add_flag("--json", a->json, "Print one JSON object (what was written) instead of text");
    s->add_option("--out-step", a->step, "Step folder name to write (default step-<iteration>, iteration = 1 + seed % 1000)");
    return s;
  };
  c.run = [a]() {
    ModelConfig m = load_model_config(resolve_model_path(a->model));
    Topology t = Topology::parse(a->layout);
    t.validate();
    DeriveOptions o;
    o.weights_on_dp0_only = true;
    const Layout L = derive_layout(m, t, o);  // validates model against layout before writing
    if (io::exists(a->out) && !io::is_dir(a->out))
      fail(ErrorCode::kInvalidArgument, "synth: ", a->out, " is a file; give a folder to write the checkpoint into");
    const std::string step = a->step.empty() ? "step-" + std::to_string(1 + a->seed % 1000) : a->step;
    synth_checkpoint(a->out, m, t, a->seed, step);
    if (a->json) {
      nlohmann::ordered_json j;
      j["output"] = io::join(a->out, step);
      j["model"] = m.name;
      j["layout"] = t.to_string();
      j["ranks"] = t.world_size();
      j["state_bytes"] = L.total_bytes();
      j["seed"] = a->seed;
      j["iteration"] = 1 + a->seed % 1000;
      std::printf("%s\n", j.dump(1).c_str());
      return 0;
    }
    std::printf("wrote %s/%s: model %s, layout %s, %d rank file(s), %s of state, seed %llu\n", a->out.c_str(),
                step.c_str(), detail::one_line(m.name).c_str(), t.to_string().c_str(), t.world_size(),
                format_bytes(L.total_bytes()).c_str(),
                (unsigned long long)a->seed);
    return 0;
  };
  return c;
}

}  // namespace reshard::cli
