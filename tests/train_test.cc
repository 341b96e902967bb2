// Training pieces: the loss and optimizers against hand-computed values, schedules,
// tokenizers, task generators, a tiny model overfitting a tiny dataset, thread-count
// independence, end-to-end training with its maps and files, corrupt checkpoints.
#include <gtest/gtest.h>
#include <png.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "attn/attention.hpp"
#include "attn/error.hpp"
#include "attn/io/heatmap.hpp"
#include "attn/train/trainer.hpp"
#include "nn_test_util.hpp"

namespace attn::testing {
namespace {

namespace fs = std::filesystem;

std::string temp_dir(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("attn_train_" + name + "_" + std::to_string(base_seed() % 100000));
  fs::remove_all(p);
  return p.string();
}

TEST(CrossEntropy, MatchesHandComputationWithIgnoreAndSmoothing) {
  const float logits[] = {1.0f, 2.0f, 0.5f, 0.0f, 0.0f, 0.0f, 3.0f, -1.0f, 0.0f};
  const std::vector<int32_t> targets{1, -100, 0};
  for (float eps_f : {0.0f, 0.1f}) {
    auto r = train::cross_entropy(TensorView(logits, DType::f32, {3, 3}), targets, -100, eps_f);
    const double eps = eps_f;
    double want = 0;
    for (int n : {0, 2}) {
      const float* x = logits + n * 3;
      const double x0 = x[0], x1 = x[1], x2 = x[2];
      const double lse = std::log(std::exp(x0) + std::exp(x1) + std::exp(x2));
      const double nll = lse - x[targets[n]];
      const double smooth = lse - (x0 + x1 + x2) / 3.0;
      want += (1 - eps) * nll + eps * smooth;
      for (int v = 0; v < 3; ++v) {
        const double g = (std::exp(double(x[v]) - lse) - (v == targets[n] ? 1 - eps : 0) - eps / 3.0) / 2.0;
        EXPECT_NEAR(r.dlogits.data_as<float>()[n * 3 + v], g, 1e-7);
      }
    }
    EXPECT_NEAR(r.loss, want / 2, 1e-9);
    EXPECT_EQ(r.counted, 2);
    for (int v = 0; v < 3; ++v) EXPECT_EQ(r.dlogits.data_as<float>()[3 + v], 0.0f);  // ignored row
  }
  // Stable for huge logits.
  const float big[] = {1e4f, 0.0f};
  auto r = train::cross_entropy(TensorView(big, DType::f32, {1, 2}), {1});
  EXPECT_NEAR(r.loss, 1e4, 1e-3);
  EXPECT_THROW(train::cross_entropy(TensorView(big, DType::f32, {1, 2}), {2}), Error);
  EXPECT_THROW(train::cross_entropy(TensorView(big, DType::f32, {1, 2}), {0, 1}), Error);
}

nn::Parameter param(std::vector<float> value, std::vector<float> grad) {
  nn::Parameter p;
  p.shape = {int64_t(value.size())};
  p.value = std::move(value);
  p.grad = std::move(grad);
  return p;
}

TEST(Optimizers, SgdMomentumAndNesterovStepsByHand) {
  nn::Parameter p = param({1.0f, -2.0f}, {0.5f, 1.0f});
  train::SGD sgd({&p}, 0.1, 0.9, 0.01);
  sgd.step();  // buf = g + wd·p = (0.51, 0.98); p -= 0.1·buf
  EXPECT_NEAR(p.value[0], 1.0 - 0.1 * 0.51, 1e-7);
  EXPECT_NEAR(p.value[1], -2.0 - 0.1 * 0.98, 1e-7);
  const double w0 = p.value[0];
  sgd.step();  // buf = 0.9·0.51 + (0.5 + 0.01·w0)
  EXPECT_NEAR(p.value[0], w0 - 0.1 * (0.9 * 0.51 + 0.5 + 0.01 * w0), 1e-6);
  nn::Parameter q = param({1.0f}, {2.0f});
  train::SGD nesterov({&q}, 0.1, 0.5, 0.0, true);
  nesterov.step();  // buf = 2, update g + μ·buf = 3
  EXPECT_NEAR(q.value[0], 1.0 - 0.3, 1e-7);
}

TEST(Optimizers, AdamAndAdamWStepsByHand) {
  for (bool decoupled : {false, true}) {
    nn::Parameter p = param({1.0f}, {0.5f});
    train::Adam adam({&p}, 0.01, 0.9, 0.999, 1e-8, 0.1, decoupled);
    double w = 1.0, m = 0, v = 0;
    for (int t = 1; t <= 3; ++t) {
      adam.step();
      double g = 0.5;
      if (decoupled) w -= 0.01 * 0.1 * w;
      else g += 0.1 * w;
      m = 0.9 * m + 0.1 * g;
      v = 0.999 * v + 0.001 * g * g;
      w -= 0.01 * (m / (1 - std::pow(0.9, t))) / (std::sqrt(v / (1 - std::pow(0.999, t))) + 1e-8);
      EXPECT_NEAR(p.value[0], w, 1e-6) << "step " << t << " decoupled " << decoupled;
    }
  }
  nn::Parameter p = param({1.0f}, {1.0f});
  train::Adam adam({&p}, 0.1);
  adam.step();
  io::SafeTensors state = adam.state();
  train::Adam copy({&p}, 0.1);
  copy.load_state(state);
  EXPECT_EQ(copy.steps(), 1);
}

TEST(Optimizers, ClipGradNorm) {
  nn::Parameter a = param({0, 0}, {3.0f, 0.0f}), b = param({0}, {4.0f});
  EXPECT_NEAR(train::clip_grad_norm({&a, &b}, 1.0), 5.0, 1e-9);
  EXPECT_NEAR(a.grad[0], 3.0 / (5.0 + 1e-6), 1e-7);
  EXPECT_NEAR(b.grad[0], 4.0 / (5.0 + 1e-6), 1e-7);
  EXPECT_NEAR(train::clip_grad_norm({&a, &b}, 10.0), 1.0, 1e-5);  // below the bar: unchanged
}

TEST(Schedules, WarmupCosineAndInverseSqrt) {
  EXPECT_DOUBLE_EQ(train::warmup_cosine_lr(5, 1.0, 10, 110), 0.5);
  EXPECT_DOUBLE_EQ(train::warmup_cosine_lr(10, 1.0, 10, 110), 1.0);
  EXPECT_NEAR(train::warmup_cosine_lr(60, 1.0, 10, 110, 0.1), 0.1 + 0.45 * (1 + std::cos(M_PI * 0.5)), 1e-12);
  EXPECT_DOUBLE_EQ(train::warmup_cosine_lr(500, 1.0, 10, 110, 0.1), 0.1);
  // Vaswani et al.: peak at step = warmup, d_model^-0.5 · warmup^-0.5.
  EXPECT_NEAR(train::inverse_sqrt_lr(4000, 512, 4000), 1 / std::sqrt(512.0) / std::sqrt(4000.0), 1e-12);
  EXPECT_LT(train::inverse_sqrt_lr(100, 512, 4000), train::inverse_sqrt_lr(4000, 512, 4000));
  EXPECT_LT(train::inverse_sqrt_lr(16000, 512, 4000), train::inverse_sqrt_lr(4000, 512, 4000));
}

TEST(Tokenizer, RoundTripsCharAndWordAndJson) {
  const auto chars = train::Tokenizer::build(train::Tokenizer::Kind::character, {"héllo wörld", "abc"});
  EXPECT_EQ(chars.decode(chars.encode("hé wörld")), "hé wörld");
  int64_t unknown = 0;
  const auto ids = chars.encode("héz", &unknown);
  EXPECT_EQ(ids[2], train::kUnk);
  EXPECT_EQ(unknown, 1);
  EXPECT_EQ(chars.token(train::kPad), "<pad>");
  const auto back = train::Tokenizer::from_json(chars.to_json());
  EXPECT_EQ(back.encode("wörld"), chars.encode("wörld"));
  const auto words = train::Tokenizer::build(train::Tokenizer::Kind::word, {"the cat sat", "the mat"});
  EXPECT_EQ(words.size(), 4 + 4);
  EXPECT_EQ(words.decode(words.encode("the  mat sat")), "the mat sat");
  EXPECT_THROW(train::Tokenizer::from_json(nlohmann::json::parse(R"({"kind":"char","tokens":["a"]})")), Error);
  EXPECT_THROW(train::Tokenizer::from_json(nlohmann::json::parse(R"([1,2])")), Error);
}

TEST(Tasks, DeterministicValidAndDisjoint) {
  const auto a = train::make_task("dates", 5, 2000, 100, 300), b = train::make_task("dates", 5, 2000, 100, 300);
  ASSERT_EQ(a.train.size(), 2000u);
  for (size_t i = 0; i < a.train.size(); ++i) EXPECT_EQ(a.train[i].source, b.train[i].source);
  EXPECT_NE(train::make_task("dates", 6, 10, 0, 0).train[0].source, a.train[0].source);
  std::set<std::string> held;
  for (const auto& e : a.test) held.insert(e.source);
  for (const auto& e : a.validation) held.insert(e.source);
  for (const auto& e : a.train) EXPECT_EQ(held.count(e.source), 0u) << e.source;
  static const char* days[] = {"monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"};
  for (const auto& e : a.train) {
    int y, m, d;
    ASSERT_EQ(std::sscanf(e.target.c_str(), "%4d-%2d-%2d", &y, &m, &d), 3) << e.target;
    ASSERT_EQ(e.target.size(), 10u);
    EXPECT_TRUE(y >= 1950 && y <= 2049 && m >= 1 && m <= 12 && d >= 1 && d <= 31) << e.target;
    std::string lower = e.source;
    for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    for (int w = 0; w < 7; ++w)  // a weekday in the text is the date's weekday (full or 3-letter)
      if (lower.rfind(std::string(days[w]).substr(0, 3), 0) == 0) EXPECT_EQ(train::day_of_week(y, m, d), w) << e.source;
  }
  EXPECT_EQ(train::day_of_week(2026, 11, 22), 6);  // a Sunday
  EXPECT_EQ(train::day_of_week(2000, 2, 29), 1);   // a Tuesday
  const auto r = train::make_task("reverse", 1, 10, 0, 0);
  EXPECT_EQ(std::string(r.train[0].source.rbegin(), r.train[0].source.rend()), r.train[0].target);
  const auto s = train::make_task("sort", 1, 10, 0, 0);
  EXPECT_TRUE(std::is_sorted(s.train[0].target.begin(), s.train[0].target.end()));
  EXPECT_THROW(train::make_task("poetry", 1, 1, 1, 1), Error);
}

train::ModelConfig small_rnn() {
  train::ModelConfig mc;
  mc.kind = "rnn";
  mc.embed_dim = 16;
  mc.hidden = 32;
  mc.attn_dim = 16;
  return mc;
}

TEST(Training, TinyModelOverfitsTinyDataAndLossFalls) {
  nn::set_blas_threads(1);
  for (const char* kind : {"rnn", "transformer"}) {
    train::TaskData data = train::make_task("reverse", 3, 8, 0, 0);
    data.validation = data.train;
    train::ModelConfig mc = small_rnn();
    mc.kind = kind;
    if (mc.kind == "transformer") mc.embed_dim = 32, mc.hidden = 64, mc.layers = 1, mc.heads = 2;
    train::TrainOptions o;
    o.steps = 400;
    o.batch_size = 8;
    o.lr = 5e-3;
    o.warmup = 20;
    o.eval_every = 0;
    std::vector<double> losses;
    o.on_progress = [&](const train::Progress& p) { losses.push_back(p.loss); };
    train::Session s = train::new_session(data, mc, o);
    train::train(s, data, o);
    ASSERT_GE(losses.size(), 3u);
    EXPECT_LT(losses.back(), 0.2 * losses.front()) << kind;
    EXPECT_EQ(train::evaluate(s, data.train), 1.0) << kind;
  }
}

TEST(Training, BitwiseReproducibleForAnyThreadCount) {
  nn::set_blas_threads(1);
  const train::TaskData data = train::make_task("dates", 2, 500, 0, 0);
  std::vector<std::vector<float>> runs;
  const int before = attn::num_threads();
  for (int threads : {1, 2}) {
    attn::set_num_threads(threads);
    train::TrainOptions o;
    o.steps = 15;
    o.batch_size = 16;
    train::ModelConfig mc = small_rnn();
    for (const char* kind : {"rnn", "transformer"}) {
      mc.kind = kind;
      if (mc.kind == "transformer") mc.embed_dim = 32, mc.hidden = 32, mc.layers = 1, mc.heads = 4;
      train::Session s = train::new_session(data, mc, o);
      train::train(s, data, o);
      std::vector<float> all;
      for (auto& [n, p] : s.model->module().named_parameters()) all.insert(all.end(), p->value.begin(), p->value.end());
      runs.push_back(all);
    }
  }
  attn::set_num_threads(before);
  EXPECT_EQ(runs[0], runs[2]);  // rnn, 1 vs 2 threads
  EXPECT_EQ(runs[1], runs[3]);  // transformer
}

TEST(Training, ResumingFromACheckpointContinuesTheSameRun) {
  nn::set_blas_threads(1);
  const train::TaskData data = train::make_task("dates", 3, 500, 0, 0);
  train::TrainOptions o;
  o.steps = 20;
  o.batch_size = 16;
  o.eval_every = 0;
  train::Session whole = train::new_session(data, small_rnn(), o);
  train::train(whole, data, o);
  train::TrainOptions half = o;
  half.max_seconds = 1e-9;  // stops after the first step: an interrupted run
  train::Session first = train::new_session(data, small_rnn(), o);
  train::train(first, data, half);
  ASSERT_LT(first.step, o.steps);
  const std::string dir = temp_dir("resume");
  train::save_checkpoint(first, dir);
  train::Session resumed = train::load_checkpoint(dir, o);
  train::train(resumed, data, o);
  EXPECT_EQ(resumed.step, whole.step);
  auto a = whole.model->module().named_parameters(), b = resumed.model->module().named_parameters();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i].second->value, b[i].second->value) << a[i].first;
  fs::remove_all(dir);
}

bool valid_png(const std::string& path, int* w, int* h) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return false;
  png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, nullptr, nullptr, nullptr);
  png_infop info = png_create_info_struct(png);
  bool ok = false;
  if (setjmp(png_jmpbuf(png)) == 0) {
    png_init_io(png, f);
    png_read_png(png, info, PNG_TRANSFORM_IDENTITY, nullptr);  // decodes every row: CRCs and zlib checked
    *w = static_cast<int>(png_get_image_width(png, info));
    *h = static_cast<int>(png_get_image_height(png, info));
    ok = true;
  }
  png_destroy_read_struct(&png, &info, nullptr);
  std::fclose(f);
  return ok;
}

TEST(Training, EndToEndDatesWithMapsAndCheckpoint) {
  nn::set_blas_threads(1);
  const train::TaskData data = train::make_task("dates", 4, 20000, 200, 300);
  train::ModelConfig mc;  // the demo's RNN preset, trained briefly
  mc.embed_dim = 32, mc.hidden = 64, mc.attn_dim = 64;
  train::TrainOptions o;
  o.steps = 300;
  o.lr = 3e-3;
  o.warmup = 50;
  o.eval_every = 0;
  train::Session s = train::new_session(data, mc, o);
  train::train(s, data, o);
  const double acc = train::evaluate(s, data.test);
  EXPECT_GT(acc, 0.9) << seed_note();
  auto t = train::translate(s, {"november 22, 2026"})[0];
  EXPECT_EQ(s.tgt_tok.decode(t.tokens), "2026-11-22");
  ASSERT_EQ(t.maps.size(), 1u);
  for (const auto& row : t.maps[0]) {
    ASSERT_EQ(row.size(), std::string("november 22, 2026").size());
    double sum = 0;
    for (float a : row) {
      EXPECT_GE(a, 0.0f);
      sum += a;
    }
    EXPECT_NEAR(sum, 1.0, 1e-5);
  }
  const std::string dir = temp_dir("e2e");
  train::save_checkpoint(s, dir);
  io::Heatmap h{t.maps[0], {}, {}, "attention"};
  for (char c : std::string("november 22, 2026")) h.col_labels.push_back(std::string(1, c));
  for (size_t r = 0; r < h.values.size(); ++r) h.row_labels.push_back(r < t.tokens.size() ? s.tgt_tok.token(t.tokens[r]) : "<eos>");
  io::write_heatmap_png(dir + "/map.png", {h, h}, 2, "caption");
  io::write_heatmap_svg(dir + "/map.svg", {h}, 1, "caption <&>");
  int w = 0, hgt = 0;
  EXPECT_TRUE(valid_png(dir + "/map.png", &w, &hgt));
  EXPECT_GT(w, 2 * 17 * 20);
  std::ifstream svg(dir + "/map.svg");
  const std::string text((std::istreambuf_iterator<char>(svg)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text.rfind("<svg", 0), 0u);
  EXPECT_NE(text.find("</svg>"), std::string::npos);
  EXPECT_NE(text.find("caption &lt;&amp;&gt;"), std::string::npos);
  EXPECT_EQ(std::count(text.begin(), text.end(), '<') - std::count(text.begin(), text.end(), '>'), 0);
  // The checkpoint translates the same way.
  train::Session back = train::load_checkpoint(dir);
  EXPECT_EQ(back.tgt_tok.decode(train::translate(back, {"november 22, 2026"})[0].tokens), "2026-11-22");
  EXPECT_EQ(back.step, s.step);
  fs::remove_all(dir);
}

TEST(Training, CorruptCheckpointsGiveClearErrors) {
  nn::set_blas_threads(1);
  const train::TaskData data = train::make_task("sort", 1, 50, 0, 0);
  train::TrainOptions o;
  o.steps = 1;
  train::Session s = train::new_session(data, small_rnn(), o);
  const std::string dir = temp_dir("corrupt");
  auto expect_error = [&](const char* what, const char* needle) {
    try {
      train::load_checkpoint(dir);
      ADD_FAILURE() << what << ": no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << what << ": " << e.what();
    }
  };
  expect_error("missing directory", "cannot open");
  train::save_checkpoint(s, dir);
  EXPECT_NO_THROW(train::load_checkpoint(dir));
  // Truncated weights.
  fs::resize_file(dir + "/model.safetensors", fs::file_size(dir + "/model.safetensors") / 2);
  expect_error("truncated weights", "safetensors");
  train::save_checkpoint(s, dir);
  // Weights from another save (of another shape): the manifest catches them first.
  train::ModelConfig bigger = small_rnn();
  bigger.hidden = 40;
  train::Session other = train::new_session(data, bigger, o);
  io::save_safetensors(dir + "/model.safetensors", io::module_state(other.model->module()));
  expect_error("weights of another save", "different saves");
  train::save_checkpoint(s, dir);
  // Broken JSON, unknown format, bad model kind.
  std::ofstream(dir + "/config.json") << "{\"format\": ";
  expect_error("bad JSON", "not valid JSON");
  std::ofstream(dir + "/config.json") << R"({"format": "something-else"})";
  expect_error("unknown format", "not an attn checkpoint");
  std::ofstream(dir + "/config.json") << R"({"format": "attn-checkpoint-2", "task": "sort", "step": 1, "training": {}, "model": {"kind": "lstm"}, "source_vocabulary": {}, "target_vocabulary": {}})";
  expect_error("bad model", "config.json");
  fs::remove_all(dir);
}

}  // namespace
}  // namespace attn::testing
