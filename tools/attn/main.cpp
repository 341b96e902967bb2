// attn: the command line of the attn library.
//   attn bench    speed of the fused forward vs the machine's peak and a cblas baseline
//   attn check    verify the kernels against the float64 reference on this machine
//   attn explain  print the attention matrix of a small sentence (a worked example)
//   attn demo     train a date-translation model and draw what it attends to
//   attn train    train a model on a built-in task; attn translate / attn plot use it
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <new>
#include <string>
#include <vector>

#include "attn/attention.hpp"
#include "baseline.hpp"
#include "commands.hpp"

int main(int argc, char** argv) {
  // The benchmark's baseline must run OpenBLAS on its AVX-512 kernels (see baseline.hpp).
  attn::bench::ensure_fast_openblas(argv);

  CLI::App app{"attn: fused attention kernels, their float64 reference and tools"};
  app.set_version_flag("--version", "attn 0.1.0");
  app.require_subcommand(1);
  std::vector<attn::cli::Command> commands = {attn::cli::add_bench_command(app),
                                              attn::cli::add_check_command(app),
                                              attn::cli::add_explain_command(app),
                                              attn::cli::add_demo_command(app),
                                              attn::cli::add_train_command(app),
                                              attn::cli::add_translate_command(app),
                                              attn::cli::add_plot_command(app)};
  // CLI11 would say "argument not expected"; name the commands instead.
  std::string known;
  bool is_known = false;
  for (const auto& c : commands) {
    known += (known.empty() ? "" : ", ") + c.sub->get_name();
    is_known = is_known || (argc > 1 && c.sub->get_name() == argv[1]);
  }
  if (argc > 1 && argv[1][0] != '-' && !is_known) {
    std::fprintf(stderr, "attn: error: unknown command \"%s\" (known: %s; see attn --help)\n", argv[1], known.c_str());
    return 2;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version exit 0; every usage error exits 2, as the other errors do.
    return app.exit(e) == 0 ? 0 : 2;
  }
  try {
    for (auto& c : commands) {
      if (app.got_subcommand(c.sub)) return c.run();
    }
  } catch (const attn::Error& e) {
    std::fprintf(stderr, "attn: error: %s\n", e.what());
    return 2;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "attn: error: out of memory (a size in the arguments or the checkpoint is too large)\n");
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "attn: error: %s\n", e.what());
    return 2;
  } catch (...) {
    std::fprintf(stderr, "attn: error: unexpected failure\n");
    return 2;
  }
  return 1;
}
