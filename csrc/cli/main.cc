// build/bin/reshard: the command-line face. Exit codes (DESIGN.md): 0 success; 1 when `verify` or
// `diff` ran and found a problem; 2 when an input is invalid or unreadable. Errors print one line
// "reshard: error: <message>" to stderr, never a stack trace.
#include <CLI/CLI.hpp>

#include <csignal>
#include <cstdio>
#include <iostream>

#include "cli/commands.h"
#include "reshard/error.h"

int main(int argc, char** argv) {
  // A write past the file size limit (ulimit -f) fails with EFBIG, which the writers report naming
  // the file, instead of killing the process with no message (SIGXFSZ's default).
  std::signal(SIGXFSZ, SIG_IGN);
  CLI::App app{"reshard: reshard checkpoints (weights and optimizer state) between parallel layouts"};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "Show help for every subcommand");
  std::vector<reshard::cli::Command> commands = reshard::cli::all_commands();
  std::vector<std::pair<CLI::App*, reshard::cli::Command*>> subs;
  for (auto& c : commands) subs.push_back({c.add(app), &c});
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int code = app.exit(e);
    return code == 0 ? 0 : 2;
  }
  try {
    for (auto& [sub, cmd] : subs)
      if (sub->parsed()) return cmd->run();
  } catch (const reshard::Error& e) {
    std::fprintf(stderr, "reshard: error: %s\n", e.what());
    return e.code() == reshard::ErrorCode::kInternal ? 3 : 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "reshard: error: %s\n", e.what());
    return 2;
  }
  return 2;
}
