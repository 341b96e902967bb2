// `attn demo`, `attn train`, `attn translate`, `attn plot`: train the built-in tasks,
// use a checkpoint, and draw what the model attends to.
#include <chrono>
#include <cstdio>
#include <filesystem>

#include "attn/attention.hpp"
#include "attn/error.hpp"
#include "attn/io/heatmap.hpp"
#include "attn/nn/module.hpp"
#include "attn/train/data.hpp"
#include "commands.hpp"
#include "train_support.hpp"

namespace attn::cli {

namespace {

struct DataArgs {
  std::string task = "dates";
  uint64_t seed = 1;
  int64_t train_size = 50000, validation_size = 500, test_size = 1000;
};

train::TaskData make_data(const DataArgs& d) {
  return train::make_task(d.task, d.seed, d.train_size, d.validation_size, d.test_size);
}

nlohmann::json data_json(const DataArgs& d) {
  return {{"task", d.task}, {"seed", d.seed}, {"train_size", d.train_size}, {"validation_size", d.validation_size},
          {"test_size", d.test_size}};
}

void print_written(const std::vector<std::string>& files) {
  for (const std::string& f : files) std::printf("  wrote %s\n", f.c_str());
}

// Translates a few examples and prints them; returns the number wrong.
int show_examples(train::Session& s, const std::vector<std::string>& texts, const std::vector<std::string>& want) {
  int wrong = 0;
  std::vector<train::Translation> out = train::translate(s, texts);
  for (size_t i = 0; i < texts.size(); ++i) {
    const std::string got = s.tgt_tok.decode(out[i].tokens);
    const bool ok = i >= want.size() || got == want[i];
    wrong += !ok;
    const std::string note = ok ? "" : "   (expected " + want[i] + ")";
    std::printf("  %-30s → %s%s\n", texts[i].c_str(), got.c_str(), note.c_str());
  }
  return wrong;
}

}  // namespace

Command add_demo_command(CLI::App& app) {
  struct Args {
    std::string model = "rnn", out = "attn-demo";
    uint64_t seed = 1;
    int64_t steps = 0;
  };
  auto a = std::make_shared<Args>();
  CLI::App* sub = app.add_subcommand(
      "demo", "Train a model to translate human-written dates to ISO 8601 and show what it attends to");
  sub->add_option("--model", a->model, "rnn (Bahdanau's encoder-decoder) or transformer")
      ->check(CLI::IsMember({"rnn", "transformer"}))
      ->capture_default_str();
  sub->add_option("--out", a->out, "directory for the checkpoint and the maps")->capture_default_str();
  sub->add_option("--seed", a->seed, "data and weights seed")->capture_default_str();
  sub->add_option("--steps", a->steps, "training steps (default: the model's preset)")
      ->check(CLI::Range(int64_t{1}, train::kMaxSteps));
  return {sub, [a]() -> int {
            nn::set_blas_threads(1);
            ensure_writable_directory(a->out, "--out");  // before minutes of training, not after
            const auto t0 = std::chrono::steady_clock::now();
            train::ModelConfig mc;
            train::TrainOptions o;
            preset(a->model, mc, o);
            mc.seed = a->seed;
            o.seed = a->seed;
            if (a->steps > 0) o.steps = a->steps;
            DataArgs d;
            d.seed = a->seed;
            std::printf("attn demo: teaching a%s to write dates as YYYY-MM-DD (%d threads)\n",
                        a->model == "rnn" ? "n attention RNN (Bahdanau et al. 2014)" : " Transformer",
                        attn::num_threads());
            train::TaskData data = make_data(d);
            std::printf("  data: %zu training, %zu validation, %zu held-out test dates, e.g. \"%s\" → \"%s\"\n",
                        data.train.size(), data.validation.size(), data.test.size(), data.train[0].source.c_str(),
                        data.train[0].target.c_str());
            const bool tty = stdout_is_tty();
            o.on_progress = progress_printer(tty);
            train::Session s = train::new_session(data, mc, o);
            s.training = {{"data", data_json(d)}, {"steps", o.steps}, {"lr", o.lr}, {"batch_size", o.batch_size}};
            std::printf("  model: %s, %lld weights\n", a->model.c_str(),
                        static_cast<long long>(s.model->module().num_parameters()));
            const train::Progress p = train::train(s, data, o);
            const double train_s = p.elapsed_seconds;
            const double acc = train::evaluate(s, data.test);
            std::printf("\n  held-out accuracy: %.1f%% exact match on %zu unseen dates (trained %lld steps in %.1f s)\n\n",
                        100.0 * acc, data.test.size(), static_cast<long long>(s.step), train_s);
            show_examples(s, {"22 November 2026", "nov 22, 2026", "Sunday, November 22, 2026", "11/22/26", "22.11.2026"},
                          {"2026-11-22", "2026-11-22", "2026-11-22", "2026-11-22", "2026-11-22"});
            train::save_checkpoint(s, a->out);
            const std::string example = "november 22, 2026";
            std::printf("\n  what the model looks at while writing \"%s\" (rows: output, columns: input):\n\n",
                        example.c_str());
            train::Translation t = train::translate(s, {example})[0];
            std::vector<std::string> files = draw_maps(s, example, t, a->out + "/attention", true);
            std::printf("  files:\n");
            print_written({a->out + "/model.safetensors", a->out + "/optimizer.safetensors", a->out + "/config.json"});
            print_written(files);
            const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            std::printf("\n  done in %.1f s. Try: attn translate --ckpt %s \"3rd of May 1999\" --map\n", total,
                        a->out.c_str());
            return acc >= 0.99 ? 0 : 1;
          }};
}

Command add_train_command(CLI::App& app) {
  struct Args {
    DataArgs data;
    std::string model = "rnn", out;
    int64_t steps = 0, batch = 0;
    double seconds = 0, lr = 0;
    bool resume = false;
  };
  auto a = std::make_shared<Args>();
  CLI::App* sub = app.add_subcommand("train", "Train a model on a built-in task and save a checkpoint");
  sub->add_option("--task", a->data.task, "dates, reverse or sort")->capture_default_str();
  sub->add_option("--model", a->model, "rnn or transformer")->check(CLI::IsMember({"rnn", "transformer"}))
      ->capture_default_str();
  sub->add_option("--steps", a->steps, "total training steps (default: the model's preset)")
      ->check(CLI::Range(int64_t{1}, train::kMaxSteps));
  sub->add_option("--time", a->seconds, "stop after this many seconds")->check(finite_non_negative());
  sub->add_option("--batch", a->batch, "batch size")->check(CLI::Range(int64_t{1}, train::kMaxBatchSize));
  sub->add_option("--lr", a->lr, "peak learning rate")->check(finite_positive(1000.0));
  sub->add_option("--seed", a->data.seed, "data, weights and batch-order seed")->capture_default_str();
  sub->add_option("--out", a->out, "checkpoint directory")->required();
  sub->add_flag("--resume", a->resume, "continue the run saved in --out");
  return {sub, [a]() -> int {
            nn::set_blas_threads(1);
            train::ModelConfig mc;
            train::TrainOptions o;
            preset(a->model, mc, o);
            mc.seed = o.seed = a->data.seed;
            train::Session s;
            DataArgs d = a->data;
            ensure_writable_directory(a->out, "--out");  // before training, not after
            if (a->resume) {
              s = train::load_checkpoint(a->out, o);
              const nlohmann::json& dj = s.training.value("data", nlohmann::json::object());
              d.task = dj.value("task", s.task);
              d.seed = dj.value("seed", d.seed);
              d.train_size = dj.value("train_size", d.train_size);
              d.validation_size = dj.value("validation_size", d.validation_size);
              d.test_size = dj.value("test_size", d.test_size);
              o.steps = s.training.value("steps", o.steps);
              o.lr = s.training.value("lr", o.lr);
              o.batch_size = s.training.value("batch_size", o.batch_size);
              o.seed = d.seed;
              std::printf("attn train: resuming %s at step %lld\n", a->out.c_str(), static_cast<long long>(s.step));
            }
            if (a->steps > 0) o.steps = a->steps;
            // A resumed run trains from its step to --steps: a checkpoint already there
            // (or past it) has nothing left to train, which is a usage error rather than a
            // silent re-save with a progress line of 0 steps.
            if (a->resume && s.step >= o.steps) {
              const std::string more = "; pass --steps N with N > " + std::to_string(s.step);
              throw Error(a->steps > 0 ? "--steps " + std::to_string(o.steps) + " is not past the checkpoint's step " +
                                             std::to_string(s.step) + ": a resumed run trains from its step to --steps" + more
                                       : "the run in --out is complete (step " + std::to_string(s.step) + " of its " +
                                             std::to_string(o.steps) + "): nothing is left to train" + more);
            }
            if (a->batch > 0) o.batch_size = a->batch;
            if (a->lr > 0) o.lr = a->lr;
            o.max_seconds = a->seconds;
            train::TaskData data = make_data(d);
            if (!a->resume) s = train::new_session(data, mc, o);
            s.optimizer->set_lr(o.lr);
            s.training = {{"data", data_json(d)}, {"steps", o.steps}, {"lr", o.lr}, {"batch_size", o.batch_size}};
            std::printf("attn train: task %s, model %s (%lld weights), %lld steps\n", d.task.c_str(),
                        s.model->config().kind.c_str(), static_cast<long long>(s.model->module().num_parameters()),
                        static_cast<long long>(o.steps));
            o.on_progress = progress_printer(stdout_is_tty());
            train::train(s, data, o);
            const double acc = train::evaluate(s, data.test);
            std::printf("  test accuracy: %.2f%% on %zu held-out examples\n", 100.0 * acc, data.test.size());
            train::save_checkpoint(s, a->out);
            print_written({a->out + "/model.safetensors", a->out + "/optimizer.safetensors", a->out + "/config.json"});
            return 0;
          }};
}

namespace {
void warn_unknown(int64_t unknown) {
  if (unknown > 0)
    std::fprintf(stderr, "attn: warning: %lld character(s) are not in the model's vocabulary and were read as <unk>\n",
                 static_cast<long long>(unknown));
}
}  // namespace

Command add_translate_command(CLI::App& app) {
  struct Args {
    std::string ckpt;
    std::vector<std::string> texts;
    bool map = false;
  };
  auto a = std::make_shared<Args>();
  CLI::App* sub = app.add_subcommand("translate", "Translate text with a trained checkpoint");
  sub->add_option("--ckpt", a->ckpt, "checkpoint directory (from attn demo or attn train)")->required();
  sub->add_option("text", a->texts, "text(s) to translate")->required();
  sub->add_flag("--map", a->map, "also print the attention map in the terminal");
  return {sub, [a]() -> int {
            nn::set_blas_threads(1);
            if (a->ckpt.empty()) throw Error("--ckpt is empty: give a checkpoint directory");
            train::Session s = train::load_checkpoint(a->ckpt, {}, train::CheckpointUse::inference);
            int64_t unknown = 0;
            std::vector<train::Translation> out = train::translate(s, a->texts, &unknown);
            warn_unknown(unknown);
            for (size_t i = 0; i < a->texts.size(); ++i) {
              std::printf("%s\n", s.tgt_tok.decode(out[i].tokens).c_str());
              if (a->map) {
                const bool tty = stdout_is_tty();
                std::printf("%s", io::render_heatmap_text(heatmap_of(s, a->texts[i], out[i], 0), tty, tty).c_str());
              }
            }
            return 0;
          }};
}

Command add_plot_command(CLI::App& app) {
  struct Args {
    std::string ckpt, text, out = "attention";
  };
  auto a = std::make_shared<Args>();
  CLI::App* sub = app.add_subcommand(
      "plot", "Draw the attention maps of a translation as PNG and SVG (one panel per layer and head)");
  sub->add_option("--ckpt", a->ckpt, "checkpoint directory")->required();
  sub->add_option("text", a->text, "the text to translate")->required();
  sub->add_option("--out", a->out, "output path prefix (writes PREFIX.png and PREFIX.svg)")->capture_default_str();
  return {sub, [a]() -> int {
            nn::set_blas_threads(1);
            if (a->ckpt.empty()) throw Error("--ckpt is empty: give a checkpoint directory");
            if (a->out.empty()) throw Error("--out is empty: give a path prefix such as maps/attention");
            const std::filesystem::path parent = std::filesystem::path(a->out).parent_path();
            ensure_writable_directory(parent.empty() ? "." : parent.string(), "--out");
            train::Session s = train::load_checkpoint(a->ckpt, {}, train::CheckpointUse::inference);
            int64_t unknown = 0;
            train::Translation t = train::translate(s, {a->text}, &unknown)[0];
            warn_unknown(unknown);
            std::printf("%s\n", s.tgt_tok.decode(t.tokens).c_str());
            print_written(draw_maps(s, a->text, t, a->out, false));
            return 0;
          }};
}

}  // namespace attn::cli
