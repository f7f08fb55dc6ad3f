// Issue 18, the sliding window (Mistral) on the CPU. A query at position pos sees keys pos - W < j <= pos
// (transformers' sliding_window_causal mask: kv_idx > q_idx - sliding_window, kv_idx <= q_idx).
//
//   1. Every CPU attention path with a window equals a brute-force reference that builds the mask matrix
//      element by element: lesson 07's attention_cpu (prefill, chunks, decode), lesson 10's cache (the double
//      prefill twin and the fp32 split decode, splits 1..9), lesson 12's pool (blocks of 1, 3 and 4). Keys no
//      query sees are NaN: a path that reads (or weights by 0) a key outside the window returns NaN and fails.
//   2. The tiny transformers-written Mistral (tests/data/models/mistral: head_dim 16, window 5, an 11-token
//      prompt): lesson 10's Generator gives transformers' greedy ids exactly, with and without chunked prefill,
//      and the prompt's last-row logits within fp32 tolerance; with the window switched off the ids differ (so the
//      comparison can tell).
//   3. The engine (lesson 11 contiguous, lesson 12 paged with prefix caching on, blocks of 4 < the window) gives
//      the same ids, for the reference prompt and for requests that share a prefix.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "attention.h"
#include "common/errors.h"
#include "common/random.h"
#include "common/validate.h"
#include "engine.h"
#include "engine_check.h"
#include "engine_paged.h"
#include "generate.h"
#include "json_strict.h"
#include "kv_cache.h"
#include "model_dir.h"
#include "model_weights.h"
#include "paged_kv.h"
#include "testing/engine_fixture.h"
#include "testing/testing.h"
#include "transformer.h"

namespace tvllm {
namespace {

// ---- 1. the attention paths vs the mask, element by element -------------------------------------------------

struct Case {
  AttentionShape shape;
  std::vector<int64_t> q_lens, k_lens;
};

// Packed rows: q [Tq, q_dim], k and v [Tk, kv_dim] (sequence b's keys at rows cu_k[b]..).
struct Data {
  std::vector<float> q, k, v;
};

int64_t total(const std::vector<int64_t>& x) { return std::accumulate(x.begin(), x.end(), int64_t{0}); }

Data random_data(const Case& c, uint64_t seed) {
  const AttentionShape& s = c.shape;
  return {random_normal(static_cast<size_t>(total(c.q_lens) * s.q_dim()), seed, 2.f),
          random_normal(static_cast<size_t>(total(c.k_lens) * s.kv_dim()), seed + 1),
          random_uniform(static_cast<size_t>(total(c.k_lens) * s.kv_dim()), seed + 2)};
}

// The mask of transformers' sliding_window_causal, written as a predicate of its own (not shape.first_key).
bool visible(int64_t query_pos, int64_t key_pos, int64_t window) {
  const bool causal = key_pos <= query_pos;
  const bool in_window = window == 0 || key_pos > query_pos - window;
  return causal && in_window;
}

// Softmax over every key, masked ones at -inf, in double: the slowest, plainest statement of the definition.
std::vector<float> brute_force(const Case& c, const Data& d) {
  const AttentionShape& s = c.shape;
  const int64_t D = s.head_dim;
  std::vector<float> out(static_cast<size_t>(total(c.q_lens) * s.q_dim()), 0.f);
  int64_t q_row = 0, k_row = 0;
  for (size_t b = 0; b < c.q_lens.size(); ++b) {
    const int64_t q_len = c.q_lens[b], k_len = c.k_lens[b];
    for (int64_t i = 0; i < q_len; ++i) {
      const int64_t pos = k_len - q_len + i;
      for (int64_t h = 0; h < s.n_heads; ++h) {
        const int64_t kvh = h / s.group_size();
        std::vector<double> score(static_cast<size_t>(k_len), -INFINITY);
        double max_score = -INFINITY;
        for (int64_t j = 0; j < k_len; ++j) {
          if (!visible(pos, j, s.window)) continue;
          double dot = 0.0;
          for (int64_t e = 0; e < D; ++e)
            dot += static_cast<double>(d.q[(q_row + i) * s.q_dim() + h * D + e]) *
                   d.k[(k_row + j) * s.kv_dim() + kvh * D + e];
          score[j] = dot / std::sqrt(static_cast<double>(D));
          max_score = std::max(max_score, score[j]);
        }
        double sum = 0.0;
        std::vector<double> acc(static_cast<size_t>(D), 0.0);
        for (int64_t j = 0; j < k_len; ++j) {
          if (score[j] == -INFINITY) continue;
          const double p = std::exp(score[j] - max_score);
          sum += p;
          for (int64_t e = 0; e < D; ++e) acc[e] += p * d.v[(k_row + j) * s.kv_dim() + kvh * D + e];
        }
        for (int64_t e = 0; e < D; ++e) out[(q_row + i) * s.q_dim() + h * D + e] = static_cast<float>(acc[e] / sum);
      }
    }
    q_row += q_len;
    k_row += k_len;
  }
  return out;
}

// Keys that no query of their sequence sees (before the first query's window) become NaN in k and v.
Data poison_unseen_keys(const Case& c, Data d) {
  int64_t k_row = 0;
  for (size_t b = 0; b < c.q_lens.size(); ++b) {
    const int64_t first_query_pos = c.k_lens[b] - c.q_lens[b];
    for (int64_t j = 0; j < c.k_lens[b]; ++j) {
      bool seen = false;
      for (int64_t pos = first_query_pos; pos < c.k_lens[b]; ++pos) seen = seen || visible(pos, j, c.shape.window);
      if (seen) continue;
      for (int64_t e = 0; e < c.shape.kv_dim(); ++e) {
        d.k[(k_row + j) * c.shape.kv_dim() + e] = NAN;
        d.v[(k_row + j) * c.shape.kv_dim() + e] = NAN;
      }
    }
    k_row += c.k_lens[b];
  }
  return d;
}

Tensor cpu_tensor(const std::vector<float>& x, Shape shape) { return Tensor::from_f32(x, shape, DType::F32, Device::CPU); }

std::vector<float> lesson07(const Case& c, const Data& d) {
  const AttentionShape& s = c.shape;
  const int64_t Tq = total(c.q_lens), Tk = total(c.k_lens);
  const Tensor q = cpu_tensor(d.q, {Tq, s.q_dim()}), k = cpu_tensor(d.k, {Tk, s.kv_dim()}),
               v = cpu_tensor(d.v, {Tk, s.kv_dim()});
  const Tensor out = cpu_tensor(std::vector<float>(d.q.size(), NAN), {Tq, s.q_dim()});
  attention(out, q, k, v, AttentionBatch::with_lengths(c.q_lens, c.k_lens, Device::CPU), s);
  return to_f32_vector(out);
}

// Lesson 10's contiguous cache: sequence b in slot b. splits 0: cached_attention's own choice (the prefill twin
// for chunks, decode_splits for decode); n > 0: decode_attention with n splits.
std::vector<float> lesson10(const Case& c, const Data& d, int splits) {
  const AttentionShape& s = c.shape;
  const auto B = static_cast<int64_t>(c.q_lens.size());
  const int64_t C = *std::max_element(c.k_lens.begin(), c.k_lens.end()), Tq = total(c.q_lens);
  KvCache cache(s, 1, B, C, Device::CPU);
  int64_t k_row = 0;
  for (int64_t b = 0; b < B; ++b) {
    std::copy_n(d.k.begin() + k_row * s.kv_dim(), c.k_lens[b] * s.kv_dim(), cache.k(0).ptr<float>() + b * C * s.kv_dim());
    std::copy_n(d.v.begin() + k_row * s.kv_dim(), c.k_lens[b] * s.kv_dim(), cache.v(0).ptr<float>() + b * C * s.kv_dim());
    k_row += c.k_lens[b];
  }
  CacheSlots slots(B, B, Device::CPU);
  std::vector<int32_t> ids(static_cast<size_t>(B));
  std::iota(ids.begin(), ids.end(), 0);
  slots.set(ids);
  const AttentionBatch batch = AttentionBatch::with_lengths(c.q_lens, c.k_lens, Device::CPU);
  const Tensor q = cpu_tensor(d.q, {Tq, s.q_dim()});
  const Tensor out = cpu_tensor(std::vector<float>(d.q.size(), NAN), {Tq, s.q_dim()});
  if (splits > 0) decode_attention(out, q, cache.k(0), cache.v(0), batch, slots, s, splits, nullptr);
  else cached_attention(out, q, cache.k(0), cache.v(0), batch, slots, s, nullptr);
  return to_f32_vector(out);
}

// Lesson 12's pool: blocks of `bs` handed out in reverse order (so that no sequence's blocks are in order).
std::vector<float> lesson12(const Case& c, const Data& d, int64_t bs, int splits) {
  const AttentionShape& s = c.shape;
  const auto B = static_cast<int64_t>(c.q_lens.size());
  const int64_t Tq = total(c.q_lens);
  int64_t blocks = 0, longest = 1;
  for (int64_t k_len : c.k_lens) {
    blocks += (k_len + bs - 1) / bs;
    longest = std::max(longest, (k_len + bs - 1) / bs);
  }
  PagedKvPool pool(s, 1, blocks, bs, Device::CPU);
  std::vector<std::vector<int32_t>> tables(static_cast<size_t>(B));
  std::vector<int32_t> slot_mapping;
  int32_t next = static_cast<int32_t>(blocks);
  int64_t k_row = 0;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t pos = 0; pos < c.k_lens[b]; ++pos) {
      if (pos % bs == 0) tables[b].push_back(--next);
      const int64_t slot = tables[b].back() * bs + pos % bs;
      std::copy_n(d.k.begin() + (k_row + pos) * s.kv_dim(), s.kv_dim(), pool.k(0).ptr<float>() + slot * s.kv_dim());
      std::copy_n(d.v.begin() + (k_row + pos) * s.kv_dim(), s.kv_dim(), pool.v(0).ptr<float>() + slot * s.kv_dim());
      if (pos >= c.k_lens[b] - c.q_lens[b]) slot_mapping.push_back(static_cast<int32_t>(slot));
    }
    k_row += c.k_lens[b];
  }
  PagedStepTables t(std::max<int64_t>(Tq, 1), B, longest, blocks, bs, Device::CPU);
  t.set(slot_mapping, tables);
  const AttentionBatch batch = AttentionBatch::with_lengths(c.q_lens, c.k_lens, Device::CPU);
  const Tensor q = cpu_tensor(d.q, {Tq, s.q_dim()});
  const Tensor out = cpu_tensor(std::vector<float>(d.q.size(), NAN), {Tq, s.q_dim()});
  if (splits > 0) paged_decode_attention(out, q, pool.k(0), pool.v(0), batch, t, s, splits, nullptr);
  else paged_attention(out, q, pool.k(0), pool.v(0), batch, t, s, nullptr);
  return to_f32_vector(out);
}

// The double references round once to fp32: within an ulp or two of the brute force. The fp32 split decode
// (exp2 in base-2 units, fp32 sums over at most a few dozen keys) is within ~1e-6 relative; 1e-5 leaves room.
const Tolerance kDoubleTol{1e-6, 1e-6};
const Tolerance kFp32Tol{1e-5, 1e-5};

void expect_close(const std::vector<float>& got, const std::vector<float>& want, const Tolerance& tol,
                  const std::string& name) {
  const CompareResult r = compare(name, got, want, tol);
  std::ostringstream o;
  for (const Mismatch& m : r.first_mismatches) o << "\n  [" << m.index << "] got " << m.actual << ", expected " << m.expected;
  EXPECT_TRUE(r.pass()) << name << ": max_abs " << r.max_abs << ", bad " << r.bad << " of " << r.count << o.str();
}

std::string name_of(const char* path, const Case& c) {
  return std::string(path) + " window " + std::to_string(c.shape.window) + " D " + std::to_string(c.shape.head_dim) +
         " group " + std::to_string(c.shape.group_size());
}

// Windows 1 (a query sees itself only), 2, 5, 13 (shorter than the longest context, longer than some) and 40
// (longer than every context: the causal mask alone), on heads of 12 (Mistral's tiny model) and 16 with GQA.
std::vector<AttentionShape> shapes() {
  std::vector<AttentionShape> out;
  for (int64_t window : {1, 2, 5, 13, 40})
    for (const AttentionShape& base : {AttentionShape{4, 2, 12}, AttentionShape{6, 1, 16}}) {
      AttentionShape s = base;
      s.window = window;
      out.push_back(s);
    }
  return out;
}

TEST(SlidingWindow12Cpu, AttentionEqualsBruteForceMask) {
  // Prefill (q_len == k_len), chunks after earlier keys, a single query, and an empty sequence, in one batch.
  for (const AttentionShape& s : shapes()) {
    const Case c{s, {11, 4, 1, 0, 7}, {11, 30, 19, 3, 7}};
    const Data d = random_data(c, 3 + s.window);
    const std::vector<float> want = brute_force(c, d);
    const Data poisoned = poison_unseen_keys(c, d);
    expect_close(lesson07(c, poisoned), want, kDoubleTol, name_of("lesson 07 attention_cpu", c));
    expect_close(lesson10(c, poisoned, 0), want, kDoubleTol, name_of("lesson 10 cached prefill", c));
    for (int64_t bs : {1, 3, 4})
      expect_close(lesson12(c, poisoned, bs, 0), want, kDoubleTol, name_of("lesson 12 paged prefill", c));
  }
}

TEST(SlidingWindow12Cpu, SplitDecodeOverTheWindowEqualsBruteForceMask) {
  // Decode steps (every q_len 1) of contexts 1..40: with a window the splits share only the last W keys, so with
  // 9 splits over a window of 2 most splits are empty. Everything before the window is NaN.
  for (const AttentionShape& s : shapes()) {
    const Case c{s, {1, 1, 1, 1, 1}, {1, 6, 13, 29, 40}};
    const Data d = random_data(c, 5 + s.window);
    const std::vector<float> want = brute_force(c, d);
    const Data poisoned = poison_unseen_keys(c, d);
    for (int splits : {1, 2, 3, 9}) {
      const std::string n = " splits " + std::to_string(splits);
      expect_close(lesson10(c, poisoned, splits), want, kFp32Tol, name_of("lesson 10 decode", c) + n);
      expect_close(lesson12(c, poisoned, 4, splits), want, kFp32Tol, name_of("lesson 12 paged decode", c) + n);
    }
    expect_close(lesson10(c, poisoned, 0), want, kFp32Tol, name_of("lesson 10 decode, own splits", c));
  }
}

TEST(SlidingWindow12Cpu, AWindowAtLeastTheContextChangesNothing) {
  // W >= every k_len: the same bits as no window (the mask is the causal one; the loops are the same).
  const Case no_window{AttentionShape{4, 2, 12}, {9, 1, 5}, {9, 20, 12}};
  Case wide = no_window;
  wide.shape.window = 20;
  const Data d = random_data(no_window, 17);
  expect_close(lesson07(wide, d), lesson07(no_window, d), Tolerance{0, 0}, "lesson 07, window 20 vs none");
  expect_close(lesson12(wide, d, 4, 0), lesson12(no_window, d, 4, 0), Tolerance{0, 0}, "lesson 12, window 20 vs none");
  // ...and a window that bites changes the answer (the comparison above could tell).
  Case narrow = no_window;
  narrow.shape.window = 3;
  EXPECT_FALSE(compare("window 3 vs none", lesson07(narrow, d), lesson07(no_window, d), Tolerance{1e-3, 1e-3}).pass());
}

TEST(SlidingWindow12Cpu, ShapeCarriesTheWindow) {
  AttentionShape a{4, 2, 12}, b = a;
  b.window = 5;
  EXPECT_FALSE(a == b);  // a cache or workspace made for one is not the other's
  EXPECT_EQ(b.first_key(0), 0);
  EXPECT_EQ(b.first_key(4), 0);
  EXPECT_EQ(b.first_key(5), 1);  // position 5 sees 1..5: five keys
  EXPECT_EQ(b.first_key(10), 6);
  EXPECT_EQ(a.first_key(10), 0);
  b.window = -1;
  try {
    b.validate();
    ADD_FAILURE() << "a negative window was accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("window"), std::string::npos) << e.what();
  }
  const ModelDir mistral = ModelDir::open(testing::test_data_dir() / "models" / "mistral");
  EXPECT_EQ(AttentionShape::from_config(mistral.config).window, 5);
}

TEST(SlidingWindow12Cpu, DecodeSplitsCountOnlyTheWindow) {
  // The split choice (host code) sees min(context, window) keys (what lesson 14 pins for its graphs as well).
  AttentionShape s{32, 8, 64};
  const int many = decode_splits(s, 1, 8192, 132);
  s.window = 64;
  EXPECT_EQ(decode_splits(s, 1, 8192, 132), 1);  // 64 keys: one split's worth
  s.window = 8192;
  EXPECT_EQ(decode_splits(s, 1, 8192, 132), many);
  EXPECT_GT(many, 1);
}

// ---- 2. the tiny Mistral through lesson 10's Generator ---------------------------------------------------------

struct MistralReference {
  std::vector<int32_t> prompt, greedy;
  std::vector<float> last_logits;  // the prompt's last row, as transformers printed it (6 significant digits)
};

const MistralReference& reference() {
  static const MistralReference r = [] {
    const auto path = testing::test_data_dir() / "models" / "mistral" / "reference.json";
    std::ifstream f(path);
    std::stringstream text;
    text << f.rdbuf();
    const nlohmann::json j = parse_json_strict(text.str(), path.string());
    MistralReference m;
    m.prompt = j.at("prompt_ids").get<std::vector<int32_t>>();
    m.greedy = j.at("greedy_ids").get<std::vector<int32_t>>();
    m.last_logits = j.at("last_logits").get<std::vector<float>>();
    return m;
  }();
  return r;
}

struct Mistral {
  ModelDir model = ModelDir::open(testing::test_data_dir() / "models" / "mistral");
  ModelWeights w = ModelWeights::bind(model, Device::CPU);
};
const Mistral& mistral() {
  static const Mistral m;
  return m;
}

GenerateOptions greedy(int64_t n) {
  GenerateOptions o;
  o.max_new_tokens = n;
  return o;
}

TEST(SlidingWindow12Cpu, MistralReferenceIsAWindowShorterThanThePrompt) {
  const MistralReference& r = reference();
  EXPECT_EQ(mistral().model.config.sliding_window, 5);
  EXPECT_GT(static_cast<int64_t>(r.prompt.size()), mistral().model.config.sliding_window);
  ASSERT_EQ(r.greedy.size(), 12u);
  ASSERT_EQ(static_cast<int64_t>(r.last_logits.size()), mistral().model.config.vocab_size);
}

TEST(SlidingWindow12Cpu, MistralGreedyIdsEqualTransformers) {
  const MistralReference& r = reference();
  const auto n = static_cast<int64_t>(r.greedy.size());
  // One prefill, then decode steps through the cache.
  Generator whole(mistral().w, Generator::limits_for(mistral().model.config, 64));
  EXPECT_EQ(whole.generate(r.prompt, greedy(n)).ids, r.greedy);
  // Prefill in chunks of 3: later chunks attend to earlier ones through the cache, across the window's edge.
  Generator chunked(mistral().w, Generator::limits_for(mistral().model.config, 64, 1, 3));
  EXPECT_EQ(chunked.generate(r.prompt, greedy(n)).ids, r.greedy);
}

TEST(SlidingWindow12Cpu, MistralLastRowLogitsEqualTransformers) {
  // Row 0 of forced_logits is the prompt's last row after the prefill. The reference holds 6 significant digits
  // of logits below 10 in size (rounding: <= 5e-6), and transformers summed in another order in fp32 (~1e-6
  // over 2 layers of width 32): 2e-5 absolute bounds both (measured: 5.5e-6), and is 250x below what the window
  // changes (see below: > 5e-3).
  const MistralReference& r = reference();
  Generator gen(mistral().w, Generator::limits_for(mistral().model.config, 64));
  const Tensor logits = gen.forced_logits(r.prompt, r.greedy);
  const std::vector<float> all = to_f32_vector(logits);
  const int64_t V = mistral().model.config.vocab_size;
  ASSERT_EQ(all.size(), r.greedy.size() * static_cast<size_t>(V));
  const std::vector<float> last(all.begin(), all.begin() + V);
  const CompareResult c = compare("mistral last-row logits vs transformers", last, r.last_logits, Tolerance{2e-5, 0});
  EXPECT_TRUE(c.pass()) << "max_abs " << c.max_abs << ", bad " << c.bad;
  std::printf("mistral last-row logits vs transformers: max_abs %.3g\n", c.max_abs);
  // Every forced row's argmax is the next reference id (decode through the cache with the window).
  for (size_t i = 0; i < r.greedy.size(); ++i) {
    const auto row = all.begin() + static_cast<int64_t>(i) * V;
    EXPECT_EQ(std::max_element(row, row + V) - row, r.greedy[i]) << "step " << i;
  }
}

TEST(SlidingWindow12Cpu, WithoutTheWindowTheMistralAnswersDiffer) {
  // The same weights with sliding_window 0: a plain causal Llama. The ids and logits must differ from the
  // reference, or the tests above could not tell a window from none.
  const MistralReference& r = reference();
  ModelDir model = ModelDir::open(testing::test_data_dir() / "models" / "mistral");
  model.config.sliding_window = 0;
  const ModelWeights w = ModelWeights::bind(model, Device::CPU);
  Generator gen(w, Generator::limits_for(model.config, 64));
  EXPECT_NE(gen.generate(r.prompt, greedy(static_cast<int64_t>(r.greedy.size()))).ids, r.greedy);
  const std::vector<float> all = to_f32_vector(gen.forced_logits(r.prompt, r.greedy));
  const std::vector<float> last(all.begin(), all.begin() + model.config.vocab_size);
  EXPECT_GT(compare("no window", last, r.last_logits, Tolerance{0, 0}).max_abs, 5e-3);
}

// ---- 3. the engines ---------------------------------------------------------------------------------------------

constexpr int64_t kMaxContext = 64;

// The reference prompt, then 15 requests of prompts 1..20 tokens behind a shared 9-token prefix (prefix caching
// hits two blocks of 4; their keys lie partly outside later positions' windows), greedy, 1..14 new ids.
std::vector<CheckRequest> requests() {
  std::vector<CheckRequest> out = make_check_requests(15, 1, 20, 1, 14, 200, 41, 9);
  CheckRequest ref;
  ref.prompt = reference().prompt;
  ref.params.sampling = SamplingParams{0.0f, 0, 1.0f, 0};
  ref.params.max_tokens = static_cast<int64_t>(reference().greedy.size());
  out.insert(out.begin(), ref);
  return out;
}

EngineConfig engine_config(int64_t budget, int64_t max_sequences) {
  return testing::engine_config(budget, max_sequences, kMaxContext);
}

KvFactory paged(bool prefix_caching) {
  PagedKvOptions o;
  o.num_blocks = 8 * 16;
  o.block_size = 4;  // shorter than the window: whole blocks fall outside it as a sequence grows
  o.prefix_caching = prefix_caching;
  return paged_kv(o);
}

TEST(SlidingWindow12Cpu, EnginesGiveTheReferenceAndTheGeneratorsIds) {
  const std::vector<CheckRequest> reqs = requests();
  static const AloneResults alone = run_alone(mistral().w, reqs, kMaxContext);
  ASSERT_EQ(alone.ids[0], reference().greedy);
  struct Run {
    const char* name;
    EngineConfig config;
    KvFactory kv;
  };
  // Budget 512: whole prompts; budget 6 (4 sequences): prompts in chunks (chunk boundaries inside the window).
  const Run runs[] = {
      {"contiguous", engine_config(512, 8), contiguous_kv(8)},
      {"contiguous, chunks", engine_config(6, 4), contiguous_kv(4)},
      {"paged, prefix caching", engine_config(512, 8), paged(true)},
      {"paged, prefix caching, chunks", engine_config(6, 4), paged(true)},
  };
  for (const Run& run : runs) {
    SCOPED_TRACE(run.name);
    Engine engine(mistral().w, run.config, run.kv);
    const EngineRunResult result = run_requests(engine, reqs);
    EXPECT_TRUE(result.events_ok) << result.events_error;
    EXPECT_EQ(result.ids[0], reference().greedy);
    const AloneCheck check = check_against_alone(mistral().w, reqs, result, alone, kMaxContext);
    EXPECT_TRUE(check.pass()) << check.summary();
    EXPECT_EQ(check.exact, static_cast<int>(reqs.size()));
    if (std::string(run.name).find("prefix") != std::string::npos) {
      EXPECT_GT(engine.stats().kv.prefix_hit_tokens, 0);
    }
  }
}

}  // namespace
}  // namespace tvllm
