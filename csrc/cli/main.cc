// build/bin/reshard: the command-line face. Exit codes (docs/cli.md): 0 success; 1 when `verify`,
// `diff` or `inspect` ran and found a problem; 2 when an input or the command line is invalid or
// unreadable. Errors print one line "reshard: error: <message>" to stderr, never a stack trace.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/progress.h"
#include "reshard/error.h"
#include "reshard_version.h"

namespace {

// Edit distance (insertions, deletions, substitutions) for suggesting a subcommand.
size_t distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

}  // namespace

int main(int argc, char** argv) {
  // A write past the file size limit (ulimit -f) fails with EFBIG, which the writers report naming
  // the file, instead of killing the process with no message (SIGXFSZ's default).
  std::signal(SIGXFSZ, SIG_IGN);
  CLI::App app{"reshard: reshard checkpoints (weights and optimizer state) between parallel layouts"};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "Show help for every subcommand");
  app.set_version_flag("--version", std::string("reshard ") + RESHARD_VERSION + " (commit " + RESHARD_GIT_COMMIT + ")",
                       "Print the version and the commit it was built from");
  // Global, also after the subcommand's own options (fallthrough): `reshard convert A B --quiet`.
  bool quiet = false;
  app.add_flag("-q,--quiet", quiet, "No progress lines; convert and verify print nothing on success (errors and warnings still go to stderr)");
  app.fallthrough();
  std::vector<reshard::cli::Command> commands = reshard::cli::all_commands();
  std::vector<std::pair<CLI::App*, reshard::cli::Command*>> subs;
  for (auto& c : commands) subs.push_back({c.add(app), &c});
  std::string topic;
  CLI::App* help = app.add_subcommand("help", "Show help for the tool, or for one subcommand");
  help->add_option("command", topic, "The subcommand");
  // An unknown subcommand: say so and suggest the nearest (CLI11 alone answers "A subcommand is
  // required" or "arguments were not expected").
  if (argc > 1 && argv[1][0] != '-') {
    const std::string given = argv[1];
    std::vector<std::string> names;
    for (const CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) names.push_back(sub->get_name());
    if (std::find(names.begin(), names.end(), given) == names.end()) {
      std::string best, all;
      size_t best_d = 3;  // suggest only what is at most 2 edits away
      for (const auto& n : names) {
        all += (all.empty() ? "" : ", ") + n;
        const size_t d = distance(given, n);
        if (d < best_d) best_d = d, best = n;
      }
      std::fprintf(stderr, "reshard: error: unknown command '%s'%s; commands: %s (reshard help COMMAND)\n",
                   given.c_str(), best.empty() ? "" : (" (did you mean '" + best + "'?)").c_str(), all.c_str());
      return 2;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version print and exit 0 as CLI11 does; a usage error is one line, like every
    // other error, pointing at the command's help.
    if (e.get_exit_code() == 0) return app.exit(e);
    std::string where;
    for (const CLI::App* sub : app.get_subcommands()) where = " " + sub->get_name();
    std::fprintf(stderr, "reshard: error: %s (reshard%s --help)\n", e.what(), where.c_str());
    return 2;
  }
  if (help->parsed()) {
    if (topic.empty()) {  // the tool's own help (App::help would show the selected `help`'s)
      std::cout << app.get_formatter()->make_help(&app, app.get_name(), CLI::AppFormatMode::Normal);
      return 0;
    }
    for (auto& [sub, cmd] : subs)
      if (sub->get_name() == topic) {
        std::cout << sub->help(app.get_name());
        return 0;
      }
    std::fprintf(stderr, "reshard: error: unknown command '%s' (reshard help lists them)\n", topic.c_str());
    return 2;
  }
  reshard::cli::set_quiet(quiet);
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
