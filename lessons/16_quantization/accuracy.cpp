// Teacher-forced comparison of two models' logits (see accuracy.h).
#include "accuracy.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include "common/errors.h"
#include "common/random.h"
#include "engine_paged.h"  // load_kv_scales
#include "fp8_gemm.h"      // fake_quantize_activations (the FP8 lm_head row)
#include "generate.h"
#include "model_weights.h"
#include "paged_attention.h"
#include "tokenizer.h"

namespace tvllm {

namespace fs = std::filesystem;

// One sequence through forward() with PagedAttention over a pool of `kv` (FP8 or BF16): blocks 0, 1, ... in order.
struct PagedKvRun {
  static constexpr int64_t kBlock = 16;
  EngineLimits limits;
  ExecContext ctx;
  StepInputs step;
  PagedKvPool pool;
  PagedAttention attention;
  PagedKvRun(const ModelDir& model, const ModelWeights& w, int64_t max_ids, KvCacheDtype kv)
      : limits(EngineLimits{1, 1, 1, max_ids + 1}.resolved(w.config)),
        ctx(w.config, limits, w.device),
        step(w.config, limits, w.device),
        pool(PagedKvPool::for_model(w.config, (max_ids + kBlock) / kBlock, kBlock, w.device, kv)),
        attention(pool, limits) {
    PagedKvOptions scales;
    if (load_kv_scales(model, scales)) pool.set_scales(scales.k_scales, scales.v_scales);
  }
  // Feeds ids[0..n-2] one step each (the first a one-token prefill); row i of the result predicts ids[i + 1].
  Tensor logits(const ModelWeights& w, const std::vector<int32_t>& ids) {
    const auto n = static_cast<int64_t>(ids.size());
    Tensor out = Tensor::empty({n - 1, w.config.vocab_size}, DType::F32, Device::CPU);
    std::vector<int32_t> table;
    for (int64_t b = 0; b * kBlock < n; ++b) table.push_back(static_cast<int32_t>(b));
    for (int64_t i = 0; i + 1 < n; ++i) {
      step.set({ids[static_cast<size_t>(i)]}, {1}, {i + 1}, {0}, ctx.stream());
      attention.set_tables({static_cast<int32_t>(i)}, {std::vector<int32_t>(table.begin(), table.begin() + i / kBlock + 1)},
                           ctx.stream());
      const TensorView logits = forward(ctx, w, step, attention);
      ctx.synchronize();
      copy_view(out.view().rows(i, 1), logits.rows(0, 1));
    }
    ctx.check_tokens();
    return out;
  }
};

TeacherForcing::TeacherForcing(const ModelDir& model, Device device, int64_t max_ids, KvCacheDtype kv)
    : weights_(std::make_unique<ModelWeights>(ModelWeights::bind(model, device))), max_ids_(max_ids) {
  if (kv != KvCacheDtype::Auto) paged_ = std::make_unique<PagedKvRun>(model, *weights_, max_ids, kv);
  else generator_ = std::make_unique<Generator>(*weights_, Generator::limits_for(model.config, max_ids + 1));
}

TeacherForcing::~TeacherForcing() = default;

Tensor TeacherForcing::logits(const std::vector<int32_t>& ids) {
  TVLLM_REQUIRE(ids.size() >= 2 && static_cast<int64_t>(ids.size()) <= max_ids_,
                "TeacherForcing::logits: needs 2.." + std::to_string(max_ids_) + " ids, got " + std::to_string(ids.size()));
  if (paged_) return paged_->logits(*weights_, ids);
  const std::vector<int32_t> prompt(ids.begin(), ids.begin() + 1), forced(ids.begin() + 1, ids.end());
  return generator_->forced_logits(prompt, forced);
}

void TeacherForcing::simulate_fp8_lm_head() {
  TVLLM_REQUIRE(weights_->device == Device::CPU,
                "TeacherForcing::simulate_fp8_lm_head: a CPU simulation (the GPU runs the real one: --fp8-lm-head)");
  const TensorView head = weights_->lm_head;
  lm_head_fp8_ = Tensor::empty(head.shape, DType::F32, Device::CPU);
  fake_quantize_activations(lm_head_fp8_.view(), head);  // per row: a vocabulary entry's own scale
  weights_->lm_head = lm_head_fp8_.view();  // the embedding (weights_->embed) is left as it is
}

namespace {

// log p(target) under softmax(row), in double: max-subtracted log-sum-exp.
double log_prob(const float* row, int64_t vocab, int32_t target) {
  const double m = *std::max_element(row, row + vocab);
  double sum = 0.0;
  for (int64_t v = 0; v < vocab; ++v) sum += std::exp(static_cast<double>(row[v]) - m);
  return static_cast<double>(row[target]) - m - std::log(sum);
}

}  // namespace

LogitsComparison compare_logits(const TensorView& candidate, const TensorView& reference, const std::vector<int32_t>& ids) {
  TVLLM_REQUIRE(candidate.dtype == DType::F32 && reference.dtype == DType::F32 && candidate.shape == reference.shape &&
                    candidate.shape.size() == 2 && candidate.device == Device::CPU && reference.device == Device::CPU,
                "compare_logits: expects two host F32 [rows, vocab] views of one shape, got " + candidate.describe() +
                    " and " + reference.describe());
  const int64_t rows = candidate.shape[0], vocab = candidate.shape[1];
  TVLLM_REQUIRE(static_cast<int64_t>(ids.size()) == rows + 1, "compare_logits: ids must be rows + 1 long");
  LogitsComparison c;
  c.positions = rows;
  double nll_ref = 0, nll_cand = 0, sq_err = 0, sq_ref = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const float* a = candidate.ptr<float>() + r * vocab;
    const float* b = reference.ptr<float>() + r * vocab;
    c.top1_agree += (std::max_element(a, a + vocab) - a) == (std::max_element(b, b + vocab) - b);
    const int32_t next = ids[static_cast<size_t>(r + 1)];
    TVLLM_REQUIRE(next >= 0 && next < vocab, "compare_logits: id outside the vocabulary");
    nll_cand -= log_prob(a, vocab, next);
    nll_ref -= log_prob(b, vocab, next);
    for (int64_t v = 0; v < vocab; ++v) {
      const double d = static_cast<double>(a[v]) - b[v];
      c.max_abs_error = std::max(c.max_abs_error, std::fabs(d));
      sq_err += d * d;
      sq_ref += static_cast<double>(b[v]) * b[v];
    }
  }
  c.candidate_perplexity = std::exp(nll_cand / static_cast<double>(rows));
  c.reference_perplexity = std::exp(nll_ref / static_cast<double>(rows));
  c.rms_error = std::sqrt(sq_err / static_cast<double>(rows * vocab));
  c.reference_rms = std::sqrt(sq_ref / static_cast<double>(rows * vocab));
  return c;
}

void accumulate(LogitsComparison& a, const LogitsComparison& b) {
  const double n = static_cast<double>(a.positions + b.positions);
  if (n == 0) return;
  auto geo = [&](double x, double y) {  // perplexity is exp(mean nll): combine the nll sums
    const double lx = a.positions ? std::log(x) * a.positions : 0.0, ly = b.positions ? std::log(y) * b.positions : 0.0;
    return std::exp((lx + ly) / n);
  };
  auto quad = [&](double x, double y) {  // rms over all logits (the same vocab for both)
    return std::sqrt((x * x * a.positions + y * y * b.positions) / n);
  };
  a.reference_perplexity = geo(a.reference_perplexity, b.reference_perplexity);
  a.candidate_perplexity = geo(a.candidate_perplexity, b.candidate_perplexity);
  a.rms_error = quad(a.rms_error, b.rms_error);
  a.reference_rms = quad(a.reference_rms, b.reference_rms);
  a.max_abs_error = std::max(a.max_abs_error, b.max_abs_error);
  a.top1_agree += b.top1_agree;
  a.positions += b.positions;
}

std::vector<std::vector<int32_t>> corpus_windows(const fs::path& model_dir, const fs::path& corpus_dir, int64_t window,
                                                 int64_t max_windows) {
  TVLLM_REQUIRE(window >= 2 && max_windows >= 1, "corpus_windows: window >= 2 and max_windows >= 1");
  const ModelConfig config = load_model_config(model_dir);
  std::vector<std::vector<int32_t>> windows;
  if (!has_tokenizer(model_dir)) {
    Rng rng(1616);
    for (int64_t w = 0; w < max_windows; ++w) {
      std::vector<int32_t> ids(static_cast<size_t>(window));
      for (int32_t& id : ids) id = static_cast<int32_t>(rng.next_u64() % static_cast<uint64_t>(config.vocab_size));
      windows.push_back(std::move(ids));
    }
    return windows;
  }
  const Tokenizer tok = Tokenizer::from_file(model_dir / "tokenizer.json");
  std::vector<fs::path> files;
  std::error_code ec;
  for (const fs::directory_entry& f : fs::directory_iterator(corpus_dir, ec))
    if (f.is_regular_file() && f.path().extension() == ".txt") files.push_back(f.path());
  if (ec || files.empty()) throw InputError(corpus_dir.string() + ": no .txt files to measure on");
  std::sort(files.begin(), files.end());
  for (const fs::path& p : files) {
    std::ifstream in(p, std::ios::binary);
    std::stringstream text;
    text << in.rdbuf();
    std::vector<int32_t> ids;
    if (config.bos_token_id >= 0) ids.push_back(static_cast<int32_t>(config.bos_token_id));
    const std::vector<int32_t> body = tok.encode(text.str());
    ids.insert(ids.end(), body.begin(), body.end());
    if (static_cast<int64_t>(ids.size()) > window) ids.resize(static_cast<size_t>(window));
    if (ids.size() >= 2) windows.push_back(std::move(ids));
    if (static_cast<int64_t>(windows.size()) == max_windows) break;
  }
  return windows;
}

bool has_tokenizer(const fs::path& model_dir) {
  std::error_code ec;
  return fs::exists(model_dir / "tokenizer.json", ec);
}

}  // namespace tvllm
