// Subcommands of the `attn` command line. Each registers its options on the
// CLI11 app and returns the exit code when run.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

namespace attn::cli {

/// A registered subcommand: call `run` when app.got_subcommand(sub).
struct Command {
  CLI::App* sub = nullptr;
  std::function<int()> run;
};

Command add_bench_command(CLI::App& app);
Command add_check_command(CLI::App& app);
Command add_explain_command(CLI::App& app);
Command add_demo_command(CLI::App& app);
Command add_train_command(CLI::App& app);
Command add_translate_command(CLI::App& app);
Command add_plot_command(CLI::App& app);

/// "AMD EPYC ..." from /proc/cpuinfo, or "unknown CPU".
std::string cpu_model();

}  // namespace attn::cli
