// CLI subcommands. Each subcommand lives in its own cmd_*.cc and registers itself in
// all_commands() (commands.cc). A command's options live in a struct captured by its callbacks.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "reshard/config.h"
#include "reshard/elastic.h"
#include "reshard/layout.h"

namespace reshard::cli {

struct Command {
  std::function<CLI::App*(CLI::App&)> add;  // registers the subcommand and its options
  std::function<int()> run;                 // runs it after parsing; returns the exit code
};

Command plan_command();
Command inspect_command();
Command verify_command();
Command convert_command();
Command synth_command();
Command diff_command();
Command bench_command();

std::vector<Command> all_commands();

/// Parses a byte size such as "1GiB", "512MiB", "2GB", "1.5GiB" or "65536" (units B, KiB, MiB,
/// GiB, KB, MB, GB; GB = 10^9, GiB = 2^30): digits, a fraction only where it gives a whole number
/// of bytes, no spaces or signs, 1 to 2^64 - 1 bytes. Anything else is Error(kInvalidArgument)
/// naming `what` (the option).
uint64_t parse_size(const std::string& text, const char* what);

/// The target's pipeline stage per layer when no --target-stages is given: the source's own split
/// (stage_of_layer_in) where the target keeps its pp (vpp 1 on both sides), so a tp or dp change
/// of an unevenly split checkpoint keeps its stages; empty (the uniform split) otherwise.
std::vector<int> same_pp_stages(const Layout& source, const Topology& target);

/// Resolves a --model argument: a path, or a name under configs/models/ ("tiny-gpt").
std::string resolve_model_path(const std::string& model);

/// `plan --config` / `convert --config`: the resume config at `path` (load_resume_config) is the
/// whole request, so each flag of `flags` ({given, name}) that was given is refused first:
/// Error(kInvalidArgument) naming `command`, the config and the flag.
ResumeConfig read_config_request(const std::string& command, const std::string& path,
                                 std::initializer_list<std::pair<bool, const char*>> flags);

/// A resume config's `target: auto` (elastic): opens its checkpoint (its step, else the newest
/// complete one) and returns choose_layout's pick for a job of `world` ranks under the config's
/// elastic policy, the model asked about each candidate and `global_batch` (> 0) kept, as the
/// trainer's restart would. `step_out` gets the step folder opened. Error(kInvalidArgument)
/// naming --world-size when `world` is 0 (not given) or below 1, else choose_layout's.
LayoutChoice choose_config_target(const ResumeConfig& rc, int64_t world, int64_t global_batch, const std::string& path,
                                  std::string* step_out);

}  // namespace reshard::cli
