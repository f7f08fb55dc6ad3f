// Lesson 14 on the GPU: the fast decode attention kernel (decode_attention_fast.cuh) against the CPU reference
// (lesson 10's split algorithm in fp32, cache_attention_cpu.h) and against lesson 10's kernel, over lesson 10's
// contiguous cache (shuffled slots) and lesson 12's pool (shuffled blocks) holding the SAME keys and values:
//   - head_dim 64, 80 and 128 (and 32, 256), GQA groups 1 to 16, batches of 1, 3, 64 and 130 sequences whose
//     contexts mix 1 key, partial blocks and thousands of keys; the op's own split count and pinned ones;
//   - every pinned split count 1..64 on Llama 3.2 1B's heads; blocks of 1 and 32 positions; a sequence without a
//     query; a sliding window (the kernel's first-key parameter, and the shape's window through the ops' hooks);
//   - paged and contiguous give the same bits (only the addresses differ), two runs give the same bits, and a
//     decode step captured in a CUDA graph (global capture mode: no allocation, no synchronisation inside)
//     replays the eager bits at the captured length and at the next one;
//   - use_fast_path makes Fast the backends' decode kernel, but leaves batch invariance's Flash alone.
// Rows of the pools and caches that no sequence owns hold NaN: a read of a wrong row shows in the output.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <iostream>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "common/cuda_stream.h"
#include "common/errors.h"
#include "common/random.h"
#include "common/validate.h"
#include "decode_attention_fast.h"
#include "fast_path.h"
#include "generate.h"
#include "kv_cache.h"
#include "paged_kv.h"
#include "testing/engine_fixture.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

// Against the CPU: P stays fp32 in both; the only bf16 rounding is the output's (2^-8 of it); fp32 sums in
// another order add ~1e-6 relative (lesson 10's tolerance). Against lesson 10's kernel: each kernel rounds its own
// fp32 result, so the two may sit one bf16 step apart (2^-7 of the value).
constexpr double kBf16Rounding = 1.0 / 256;
constexpr double kFp32Slack = 1e-4;
const Tolerance kVsCpu{kFp32Slack, kBf16Rounding + kFp32Slack};
const Tolerance kVsLesson10{kFp32Slack, 2 * kBf16Rounding + kFp32Slack};
const Tolerance kSameBits{0, 0};

enum class Layout { Contiguous, Paged };

std::vector<float> bf16_values(const std::vector<float>& x) {
  return to_f32_vector(Tensor::from_f32(x, {static_cast<int64_t>(x.size())}, DType::BF16, Device::CPU));
}

// One layer of keys and values for a batch of sequences, held four times: lesson 10's cache and lesson 12's pool,
// each on the CPU (fp32) and on the GPU (bf16), with the same values. Sequence b owns capacity[b] = k_len + extra
// positions (a later step may use them); every other row is NaN.
class Step {
 public:
  Step(const AttentionShape& s, std::vector<int64_t> q_lens, std::vector<int64_t> k_lens, uint64_t seed,
       int64_t block_size = 16, int64_t extra = 0)
      : s_(s), q_lens_(std::move(q_lens)), k_lens_(std::move(k_lens)), bs_(block_size) {
    const auto B = static_cast<int64_t>(k_lens_.size());
    Rng rng(seed);
    int64_t max_cap = 1, blocks = 5;  // 5 spare blocks nobody owns
    for (int64_t n : k_lens_) {
      cap_.push_back(n + extra);
      max_cap = std::max(max_cap, n + extra);
      blocks += (n + extra + bs_ - 1) / bs_;
    }
    // Shuffled slots and shuffled blocks: sequence b's rows are anywhere.
    slot_of_.resize(static_cast<size_t>(B));
    std::iota(slot_of_.begin(), slot_of_.end(), 0);
    for (int64_t i = B - 1; i > 0; --i) std::swap(slot_of_[i], slot_of_[rng.below(i + 1)]);
    std::vector<int32_t> order(static_cast<size_t>(blocks));
    std::iota(order.begin(), order.end(), 0);
    for (int64_t i = blocks - 1; i > 0; --i) std::swap(order[i], order[rng.below(i + 1)]);
    size_t next = 0;
    tables_.resize(static_cast<size_t>(B));
    for (int64_t b = 0; b < B; ++b)
      while (static_cast<int64_t>(tables_[b].size()) * bs_ < cap_[b]) tables_[b].push_back(order.at(next++));

    const int64_t kv = s_.kv_dim();
    cache_cpu_ = KvCache(s_, 1, B, max_cap, Device::CPU);
    pool_cpu_ = PagedKvPool(s_, 1, blocks, bs_, Device::CPU);
    for (const TensorView& t : {cache_cpu_.k(0), cache_cpu_.v(0), pool_cpu_.k(0), pool_cpu_.v(0)})
      std::fill(t.ptr<float>(), t.ptr<float>() + t.numel(), NAN);
    for (int64_t b = 0; b < B; ++b) {
      const std::vector<float> k = bf16_values(random_normal(static_cast<size_t>(cap_[b] * kv), seed + 10 + b));
      const std::vector<float> v = bf16_values(random_uniform(static_cast<size_t>(cap_[b] * kv), seed + 500 + b));
      for (int64_t p = 0; p < cap_[b]; ++p) {
        const int64_t crow = slot_of_[b] * max_cap + p;
        const int64_t prow = static_cast<int64_t>(tables_[b][p / bs_]) * bs_ + p % bs_;
        std::copy_n(k.begin() + p * kv, kv, cache_cpu_.k(0).ptr<float>() + crow * kv);
        std::copy_n(v.begin() + p * kv, kv, cache_cpu_.v(0).ptr<float>() + crow * kv);
        std::copy_n(k.begin() + p * kv, kv, pool_cpu_.k(0).ptr<float>() + prow * kv);
        std::copy_n(v.begin() + p * kv, kv, pool_cpu_.v(0).ptr<float>() + prow * kv);
      }
    }
    cache_gpu_ = KvCache(s_, 1, B, max_cap, Device::CUDA);
    pool_gpu_ = PagedKvPool(s_, 1, blocks, bs_, Device::CUDA);
    const TensorView cpu_views[] = {cache_cpu_.k(0), cache_cpu_.v(0), pool_cpu_.k(0), pool_cpu_.v(0)};
    const TensorView gpu_views[] = {cache_gpu_.k(0), cache_gpu_.v(0), pool_gpu_.k(0), pool_gpu_.v(0)};
    for (int i = 0; i < 4; ++i) {
      const TensorView& src = cpu_views[i];
      const std::vector<float> host(src.ptr<float>(), src.ptr<float>() + src.numel());
      copy_view(gpu_views[i], Tensor::from_f32(host, src.shape, DType::BF16, Device::CUDA).view());
    }
    tq_ = std::accumulate(q_lens_.begin(), q_lens_.end(), int64_t{0});
    q_ = bf16_values(random_normal(static_cast<size_t>(tq_ * s_.q_dim()), seed + 1, 2.f));
    TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
  }

  const AttentionShape& shape() const { return s_; }
  const std::vector<int64_t>& q_lens() const { return q_lens_; }
  const std::vector<int64_t>& k_lens() const { return k_lens_; }
  int64_t tq() const { return tq_; }
  const std::vector<float>& q() const { return q_; }
  const KvCache& cache(Device d) const { return d == Device::CUDA ? cache_gpu_ : cache_cpu_; }
  const PagedKvPool& pool(Device d) const { return d == Device::CUDA ? pool_gpu_ : pool_cpu_; }
  const std::vector<int32_t>& slots() const { return slot_of_; }
  const std::vector<std::vector<int32_t>>& tables() const { return tables_; }
  int64_t longest_table() const {
    size_t n = 1;
    for (const auto& t : tables_) n = std::max(n, t.size());
    return static_cast<int64_t>(n);
  }
  // The KV slot of each new token (a sequence's last q_len positions of `k_lens`), in token order.
  std::vector<int32_t> slot_mapping(const std::vector<int64_t>& k_lens) const {
    std::vector<int32_t> m;
    for (size_t b = 0; b < q_lens_.size(); ++b)
      for (int64_t p = k_lens[b] - q_lens_[b]; p < k_lens[b]; ++p)
        m.push_back(static_cast<int32_t>(tables_[b][p / bs_] * bs_ + p % bs_));
    return m;
  }

 private:
  AttentionShape s_;
  std::vector<int64_t> q_lens_, k_lens_, cap_;
  int64_t bs_ = 16, tq_ = 0;
  std::vector<int32_t> slot_of_;
  std::vector<std::vector<int32_t>> tables_;
  KvCache cache_cpu_, cache_gpu_;
  PagedKvPool pool_cpu_, pool_gpu_;
  std::vector<float> q_;
};

// The step's decode attention on device d over `layout` with `kernel` (the CPU computes lesson 10's split
// reference whatever the kernel). splits 0: the op's own choice (cached_attention / paged_attention), n > 0: n.
std::vector<float> attend(const Step& st, Device d, Layout layout, DecodeAttention kernel, int splits,
                          const std::vector<int64_t>* k_lens = nullptr) {
  const std::vector<int64_t>& lens = k_lens ? *k_lens : st.k_lens();
  const AttentionShape& s = st.shape();
  const auto B = static_cast<int64_t>(lens.size());
  const bool gpu = d == Device::CUDA;
  const DType dt = gpu ? DType::BF16 : DType::F32;
  AttentionBatch batch(B, d);
  batch.set_lengths(st.q_lens(), lens);
  DecodeWorkspace ws(s, B, d);
  const Tensor q = Tensor::from_f32(st.q(), {st.tq(), s.q_dim()}, dt, d);
  const Tensor out = Tensor::from_f32(std::vector<float>(st.q().size(), NAN), {st.tq(), s.q_dim()}, dt, d);
  if (layout == Layout::Contiguous) {
    const KvCache& c = st.cache(d);
    CacheSlots slots(B, B, d);
    slots.set(st.slots());
    if (gpu) TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
    if (splits > 0) decode_attention(out, q, c.k(0), c.v(0), batch, slots, s, splits, &ws, nullptr, kernel);
    else cached_attention(out, q, c.k(0), c.v(0), batch, slots, s, &ws, nullptr, kernel);
  } else {
    const PagedKvPool& p = st.pool(d);
    PagedStepTables t(std::max<int64_t>(st.tq(), 1), B, st.longest_table(), p.num_blocks(), p.block_size(), d);
    t.set(st.slot_mapping(lens), st.tables());
    if (gpu) TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
    if (splits > 0) paged_decode_attention(out, q, p.k(0), p.v(0), batch, t, s, splits, &ws, nullptr, kernel);
    else paged_attention(out, q, p.k(0), p.v(0), batch, t, s, &ws, nullptr, kernel);
  }
  if (gpu) TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
  return to_f32_vector(out);
}

std::vector<float> cpu_reference(const Step& st, const std::vector<int64_t>* k_lens = nullptr) {
  return attend(st, Device::CPU, Layout::Contiguous, DecodeAttention::Split, 1, k_lens);
}

void expect_close(const std::vector<float>& got, const std::vector<float>& want, const AttentionShape& s,
                  const Tolerance& tol, const std::string& name) {
  const CompareResult c = compare(name, got, want, tol);
  std::ostringstream o;
  o << c.name << ": max_abs " << c.max_abs << ", max_rel " << c.max_rel << ", bad " << c.bad << " of " << c.count;
  for (const Mismatch& m : c.first_mismatches)
    o << "\n  row " << m.index / s.q_dim() << " head " << (m.index % s.q_dim()) / s.head_dim << " dim "
      << m.index % s.head_dim << ": got " << m.actual << ", expected " << m.expected;
  if (!c.error.empty()) o << "\n  " << c.error;
  EXPECT_TRUE(c.pass()) << o.str();
}

std::string name_of(const AttentionShape& s, size_t B, const char* what, int splits) {
  return std::string(what) + ", D " + std::to_string(s.head_dim) + " heads " + std::to_string(s.n_heads) + "/" +
         std::to_string(s.n_kv_heads) + " B " + std::to_string(B) + " splits " + std::to_string(splits);
}

// Contexts that mix the edges: a long one (alone at B = 1), 1 key, a partial block, a block and one, exactly
// one block, two and one; the rest in [2, longest).
std::vector<int64_t> mixed_lengths(int64_t B, int64_t longest, uint64_t seed) {
  const std::vector<int64_t> edges{longest, 1, 15, 17, 16, 33};
  std::vector<int64_t> lens;
  Rng rng(seed);
  for (int64_t b = 0; b < B; ++b)
    lens.push_back(b < static_cast<int64_t>(edges.size()) ? edges[b] : 2 + rng.below(longest - 2));
  return lens;
}

// Fast with the other pipeline (v1, registers), then back to the default: the same arithmetic, the same bits.
std::vector<float> attend_v1(const Step& st, Layout layout, int splits) {
  set_fast_decode_pipeline(FastDecodePipeline::Registers);
  try {
    std::vector<float> r = attend(st, Device::CUDA, layout, DecodeAttention::Fast, splits);
    set_fast_decode_pipeline(FastDecodePipeline::Ring);
    return r;
  } catch (...) {
    set_fast_decode_pipeline(FastDecodePipeline::Ring);
    throw;
  }
}

// Where the splits are combined for as long as it lives (set_fast_decode_combine_in_kernel), then the default.
class CombineScope {
 public:
  explicit CombineScope(bool in_kernel) : before_(fast_decode_combine_in_kernel()) {
    set_fast_decode_combine_in_kernel(in_kernel);
  }
  ~CombineScope() { set_fast_decode_combine_in_kernel(before_); }
  CombineScope(const CombineScope&) = delete;
  CombineScope& operator=(const CombineScope&) = delete;

 private:
  bool before_;
};

// Everything a step is checked for: Fast over both layouts against the CPU and against lesson 10's kernel;
// paged == contiguous bit for bit; a second run == the first; pipeline v1 == v2 bit for bit; the combine by the
// last split block (opt-in) against the CPU and against the default combine kernel: two fp32 sums in different
// orders, each rounded to bf16 once, may sit one bf16 step apart (kVsLesson10's reasoning).
void check_step(const Step& st, int splits, const std::vector<float>& cpu) {
  const AttentionShape& s = st.shape();
  const size_t B = st.k_lens().size();
  const std::vector<float> fc = attend(st, Device::CUDA, Layout::Contiguous, DecodeAttention::Fast, splits);
  const std::vector<float> fp = attend(st, Device::CUDA, Layout::Paged, DecodeAttention::Fast, splits);
  expect_close(fc, cpu, s, kVsCpu, name_of(s, B, "fast contiguous vs cpu", splits));
  expect_close(fp, cpu, s, kVsCpu, name_of(s, B, "fast paged vs cpu", splits));
  expect_close(fp, fc, s, kSameBits, name_of(s, B, "fast paged == fast contiguous", splits));
  const std::vector<float> l10p = attend(st, Device::CUDA, Layout::Paged, DecodeAttention::Split, splits);
  const std::vector<float> l10c = attend(st, Device::CUDA, Layout::Contiguous, DecodeAttention::Split, splits);
  expect_close(fp, l10p, s, kVsLesson10, name_of(s, B, "fast paged vs lesson 10's kernel", splits));
  expect_close(fc, l10c, s, kVsLesson10, name_of(s, B, "fast contiguous vs lesson 10's kernel", splits));
  const std::vector<float> again = attend(st, Device::CUDA, Layout::Paged, DecodeAttention::Fast, splits);
  expect_close(again, fp, s, kSameBits, name_of(s, B, "fast paged, run twice", splits));
  expect_close(attend_v1(st, Layout::Paged, splits), fp, s, kSameBits, name_of(s, B, "v1 paged == v2 paged", splits));
  expect_close(attend_v1(st, Layout::Contiguous, splits), fc, s, kSameBits,
               name_of(s, B, "v1 contiguous == v2 contiguous", splits));
  const CombineScope in_kernel(true);
  const std::vector<float> kp = attend(st, Device::CUDA, Layout::Paged, DecodeAttention::Fast, splits);
  expect_close(kp, cpu, s, kVsCpu, name_of(s, B, "fast paged, combine in the decode kernel, vs cpu", splits));
  expect_close(kp, fp, s, kVsLesson10, name_of(s, B, "combine in the decode kernel vs combine kernel", splits));
  const std::vector<float> kc = attend(st, Device::CUDA, Layout::Contiguous, DecodeAttention::Fast, splits);
  expect_close(kc, kp, s, kSameBits, name_of(s, B, "combine in the decode kernel: paged == contiguous", splits));
}

TEST(FastDecode14Gpu, MatchesTheCpuAndLesson10AcrossHeadDimsGroupsAndBatches) {
  TVLLM_REQUIRE_GPU();
  install_fast_decode_attention();
  for (int64_t D : {64, 128, 80}) {
    for (int64_t group : {1, 4, 8}) {
      const AttentionShape s{2 * group, 2, D};
      for (int64_t B : {1, 3, 64, 130}) {
        // Few sequences: long contexts (many splits have work); many: shorter ones (the CPU reference's time).
        const int64_t longest = B <= 3 ? 4999 : 700;
        const Step st(s, std::vector<int64_t>(static_cast<size_t>(B), 1), mixed_lengths(B, longest, D + B),
                      1000 + D * 10 + group + B);
        const std::vector<float> cpu = cpu_reference(st);
        for (int splits : {0, 1, 5, 64}) check_step(st, splits, cpu);
      }
    }
  }
}

TEST(FastDecode14Gpu, HeadDims32And256AndGroupsOf3And16) {
  TVLLM_REQUIRE_GPU();
  install_fast_decode_attention();
  // 32: 4 lanes per key (8 keys per load round); 256: a whole warp per key. A group of 3 runs as 4 with a zero
  // query, a group of 16 as two blocks of 8 heads.
  for (const AttentionShape& s : {AttentionShape{6, 2, 32}, AttentionShape{32, 2, 256}, AttentionShape{32, 2, 64}}) {
    const Step st(s, {1, 1, 1, 1}, {1, 300, 2100, 47}, 77 + s.head_dim);
    const std::vector<float> cpu = cpu_reference(st);
    for (int splits : {0, 1, 9}) check_step(st, splits, cpu);
  }
}

TEST(FastDecode14Gpu, EveryPinnedSplitCountAgrees) {
  TVLLM_REQUIRE_GPU();
  install_fast_decode_attention();
  // What lesson 14's graphs do: any split count from 1 to kMaxDecodeSplits, for any context (more splits than
  // a sequence has keys included: the empty splits are skipped by the combine). Llama 3.2 1B's heads.
  const AttentionShape s{32, 8, 64};
  const Step st(s, {1, 1, 1}, {1, 200, 4097}, 5);
  const std::vector<float> cpu = cpu_reference(st);
  for (int splits = 1; splits <= DecodeWorkspace::kMaxDecodeSplits; ++splits) {
    const std::vector<float> fc = attend(st, Device::CUDA, Layout::Contiguous, DecodeAttention::Fast, splits);
    const std::vector<float> fp = attend(st, Device::CUDA, Layout::Paged, DecodeAttention::Fast, splits);
    expect_close(fc, cpu, s, kVsCpu, name_of(s, 3, "fast contiguous vs cpu", splits));
    expect_close(fp, fc, s, kSameBits, name_of(s, 3, "fast paged == fast contiguous", splits));
    expect_close(attend_v1(st, Layout::Paged, splits), fp, s, kSameBits, name_of(s, 3, "v1 == v2", splits));
    const CombineScope in_kernel(true);
    expect_close(attend(st, Device::CUDA, Layout::Paged, DecodeAttention::Fast, splits), fp, s, kVsLesson10,
                 name_of(s, 3, "combine in the decode kernel vs combine kernel", splits));
  }
}

TEST(FastDecode14Gpu, BlocksOf1And32AndASequenceWithoutAQuery) {
  TVLLM_REQUIRE_GPU();
  install_fast_decode_attention();
  // Blocks of 1 (every key its own table entry, a tile spans 16 blocks) and of 32 (a tile is half a block);
  // sequence 1 brings no query (q_len 0: nothing to compute, no output row).
  const AttentionShape s{32, 8, 64};
  for (int64_t bs : {1, 32}) {
    const Step st(s, {1, 0, 1, 1}, {1, 40, 1000, 333}, 30 + bs, bs);
    const std::vector<float> cpu = cpu_reference(st);
    for (int splits : {0, 1, 13}) {
      const std::vector<float> fp = attend(st, Device::CUDA, Layout::Paged, DecodeAttention::Fast, splits);
      expect_close(fp, cpu, s, kVsCpu, name_of(s, 4, bs == 1 ? "blocks of 1" : "blocks of 32", splits));
      expect_close(attend_v1(st, Layout::Paged, splits), fp, s, kSameBits, name_of(s, 4, "v1 == v2", splits));
    }
  }
}

// Attention of each sequence's query over its keys [first, k_len), first = max(0, k_len - window) (window 0: all),
// in double precision from the CPU cache: the sliding-window answer the kernel's first-key parameter must give.
std::vector<float> windowed_reference(const Step& st, int window) {
  const AttentionShape& s = st.shape();
  const KvCache& c = st.cache(Device::CPU);
  const int64_t D = s.head_dim, kv = s.kv_dim(), max_cap = c.max_context();
  std::vector<float> out(st.q().size(), 0.f);
  int64_t row = 0;
  for (size_t b = 0; b < st.k_lens().size(); ++b) {
    if (st.q_lens()[b] == 0) continue;
    const int64_t k_len = st.k_lens()[b];
    const int64_t first = window > 0 ? std::max<int64_t>(0, k_len - window) : 0;
    for (int64_t h = 0; h < s.n_heads; ++h) {
      const float* qh = st.q().data() + row * s.q_dim() + h * D;
      const int64_t col = (h / s.group_size()) * D;
      std::vector<double> p;
      double mx = -INFINITY;
      for (int64_t j = first; j < k_len; ++j) {
        const float* kj = c.k(0).ptr<float>() + (st.slots()[b] * max_cap + j) * kv + col;
        double dot = 0.0;
        for (int64_t d = 0; d < D; ++d) dot += static_cast<double>(qh[d]) * kj[d];
        p.push_back(dot * s.scale());
        mx = std::max(mx, p.back());
      }
      double sum = 0.0;
      for (double& x : p) sum += (x = std::exp(x - mx));
      for (int64_t d = 0; d < D; ++d) {
        double o = 0.0;
        for (int64_t j = first; j < k_len; ++j)
          o += p[j - first] * c.v(0).ptr<float>()[(st.slots()[b] * max_cap + j) * kv + col + d];
        out[row * s.q_dim() + h * D + d] = static_cast<float>(o / sum);
      }
    }
    ++row;
  }
  return out;
}

TEST(FastDecode14Gpu, AWindowReadsOnlyTheLastKeys) {
  TVLLM_REQUIRE_GPU();
  // The kernel's first-key parameter, called directly (the ops pass shape.window: the next test): window W keeps
  // keys [k_len - W, k_len); a W beyond the context keeps them all, as does 0.
  const AttentionShape s{32, 8, 64};
  const Step st(s, {1, 1, 1, 1}, {1, 100, 1000, 4097}, 41);
  const auto B = static_cast<int64_t>(st.k_lens().size());
  AttentionBatch batch(B, Device::CUDA);
  batch.set_lengths(st.q_lens(), st.k_lens());
  CacheSlots slots(B, B, Device::CUDA);
  slots.set(st.slots());
  PagedStepTables t(B, B, st.longest_table(), st.pool(Device::CUDA).num_blocks(), 16, Device::CUDA);
  t.set(st.slot_mapping(st.k_lens()), st.tables());
  DecodeWorkspace ws(s, B, Device::CUDA);
  const Tensor q = Tensor::from_f32(st.q(), {st.tq(), s.q_dim()}, DType::BF16, Device::CUDA);
  const Tensor out = Tensor::empty({st.tq(), s.q_dim()}, DType::BF16, Device::CUDA);
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
  for (int window : {0, 1, 37, 256, 5000}) {
    const std::vector<float> want = windowed_reference(st, window);
    for (int splits : {1, 4, 64}) {
      set_fast_decode_pipeline(splits == 4 ? FastDecodePipeline::Registers : FastDecodePipeline::Ring);
      const std::string what = "window " + std::to_string(window) + ", " +
                               fast_decode_pipeline_name(fast_decode_pipeline());
      fast_decode_attention_cuda(out, q, st.cache(Device::CUDA).k(0), st.cache(Device::CUDA).v(0), batch, slots, s,
                                 splits, window, ws, nullptr);
      expect_close(to_f32_vector(out), want, s, kVsCpu, name_of(s, 4, (what + ", contiguous").c_str(), splits));
      fast_paged_decode_attention_cuda(out, q, st.pool(Device::CUDA).k(0), st.pool(Device::CUDA).v(0), batch, t, s,
                                       splits, window, ws, nullptr);
      expect_close(to_f32_vector(out), want, s, kVsCpu, name_of(s, 4, (what + ", paged").c_str(), splits));
    }
  }
  set_fast_decode_pipeline(FastDecodePipeline::Ring);
  EXPECT_THROW(fast_decode_attention_cuda(out, q, st.cache(Device::CUDA).k(0), st.cache(Device::CUDA).v(0), batch,
                                          slots, s, 1, -1, ws, nullptr),
               InputError);
}

TEST(FastDecode14Gpu, TheOpsPassTheShapesSlidingWindowToTheKernel) {
  TVLLM_REQUIRE_GPU();
  install_fast_decode_attention();
  // Mistral's case: AttentionShape::window set, and DecodeAttention::Fast reached through lesson 10's and lesson
  // 12's ops (cached_attention / paged_attention pick the split count, decode_attention / paged_decode_attention
  // pin it), so the hooks must hand the kernel shape.window. Contexts below, at and past the window, and one far
  // past it; the windowed answer must differ from the full one, or this test could not see a dropped window.
  // The last: the tiny Mistral's heads (tests/data/models/mistral: head_dim 16, window 5).
  for (const AttentionShape& s :
       {AttentionShape{32, 8, 64, 300}, AttentionShape{16, 4, 128, 37}, AttentionShape{4, 2, 16, 5}}) {
    const Step st(s, {1, 1, 1, 1, 1}, {1, s.window - 1, s.window, s.window + 1, 2500}, 90 + s.window);
    const std::vector<float> cpu = cpu_reference(st);  // lesson 10's CPU reference applies the shape's window
    const std::vector<float> exact = windowed_reference(st, static_cast<int>(s.window));
    expect_close(cpu, exact, s, Tolerance{1e-5, 1e-5}, name_of(s, 5, "cpu reference == windowed double", 0));
    const AttentionShape full{s.n_heads, s.n_kv_heads, s.head_dim, 0};
    const Step unwindowed(full, {1, 1, 1, 1, 1}, st.k_lens(), 90 + s.window);  // the same seed: the same values
    const CompareResult differs = compare("full vs windowed", cpu_reference(unwindowed), cpu, kVsCpu);
    EXPECT_GT(differs.bad, 0) << "the window changes nothing here: the test would not catch a dropped window";
    for (int splits : {0, 1, 7}) {
      check_step(st, splits, cpu);  // Fast vs cpu and lesson 10's (windowed) kernel, paged == contiguous, v1 == v2
      expect_close(attend(st, Device::CUDA, Layout::Paged, DecodeAttention::Fast, splits), exact, s, kVsCpu,
                   name_of(s, 5, "fast paged, window, vs double", splits));
    }
  }
}

TEST(FastDecode14Gpu, AGraphReplaysTheEagerBitsAtTheCapturedAndTheNextLength) {
  // One Fast decode step over the pool (3 splits pinned), captured once in global mode (an allocation or a
  // synchronisation inside would fail the capture), replayed over a poisoned output: the eager bits. Then every
  // context grows by one in the same device buffers (sequence 0 crosses into a new block) and the SAME graph
  // replays it: the eager bits again, and the CPU's answer. Both combines: in the decode kernel (one node; its
  // per-head counters must be back at zero after every launch, or a replay would find no last block and leave
  // the poisoned output) and by a second kernel (two nodes).
  TVLLM_REQUIRE_GPU();
  install_fast_decode_attention();
  for (const bool in_kernel : {true, false}) {
    SCOPED_TRACE(in_kernel ? "combine in the decode kernel" : "combine kernel");
    const CombineScope combine(in_kernel);
    const AttentionShape s{32, 8, 64};
    const Step st(s, {1, 1, 1}, {48, 101, 8}, 21, 16, /*extra=*/1);
    const auto B = static_cast<int64_t>(st.k_lens().size());
    CudaStream stream;
    AttentionBatch batch(B, Device::CUDA);
    PagedStepTables t(B, B, st.longest_table(), st.pool(Device::CUDA).num_blocks(), 16, Device::CUDA);
    DecodeWorkspace ws(s, B, Device::CUDA);
    const Tensor q = Tensor::from_f32(st.q(), {st.tq(), s.q_dim()}, DType::BF16, Device::CUDA);
    const Tensor out = Tensor::empty({st.tq(), s.q_dim()}, DType::BF16, Device::CUDA);
    TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
    const auto set_lengths = [&](const std::vector<int64_t>& lens) {
      batch.set_lengths(st.q_lens(), lens, stream);
      t.set(st.slot_mapping(lens), st.tables(), stream);
    };
    const auto run = [&] {
      paged_decode_attention(out, q, st.pool(Device::CUDA).k(0), st.pool(Device::CUDA).v(0), batch, t, s, 3, &ws,
                             stream, DecodeAttention::Fast);
    };
    const auto poisoned_run = [&](const std::function<void()>& launch) {
      TVLLM_CUDA_CHECK(cudaMemsetAsync(out.data(), 0xFF, out.view().nbytes(), stream));  // bf16 0xFFFF: NaN
      launch();
      stream.synchronize();
      return to_f32_vector(out);
    };

    std::vector<int64_t> lens = st.k_lens();
    set_lengths(lens);
    const std::vector<float> eager1 = poisoned_run(run);
    expect_close(eager1, cpu_reference(st, &lens), s, kVsCpu, "step 1, eager vs cpu");
    const CudaGraph graph = CudaGraph::capture(stream, run);
    EXPECT_EQ(graph.num_nodes(), in_kernel ? 1u : 2u);  // the decode kernel (and the combine kernel)
    expect_close(poisoned_run([&] { graph.launch(stream); }), eager1, s, kSameBits, "step 1, replay == eager");

    for (int64_t& n : lens) ++n;  // 48 -> 49: sequence 0's 4th block
    set_lengths(lens);
    const std::vector<float> replay2 = poisoned_run([&] { graph.launch(stream); });
    expect_close(replay2, poisoned_run(run), s, kSameBits, "step 2, replay == eager");
    expect_close(replay2, cpu_reference(st, &lens), s, kVsCpu, "step 2, replay vs cpu");
    EXPECT_FALSE(compare("step 2 != step 1", replay2, eager1, kSameBits).pass())
        << "the replay did not see the new lengths";
    std::vector<int> arrivals(static_cast<size_t>(B * s.n_heads), -1);
    TVLLM_CUDA_CHECK(cudaMemcpy(arrivals.data(), ws.split_arrivals(), arrivals.size() * sizeof(int),
                                cudaMemcpyDeviceToHost));
    EXPECT_EQ(arrivals, std::vector<int>(arrivals.size(), 0)) << "a counter was left for the next launch";
  }
}

TEST(FastDecode14Gpu, FastBeforeItIsInstalledIsAClearError) {
  TVLLM_REQUIRE_GPU();
  if (installed_fast_decode().contiguous != nullptr || installed_fast_paged_decode() != nullptr)
    GTEST_SKIP() << "another test of this process installed the kernel already (ctest runs each test alone)";
  const Step st(AttentionShape{4, 2, 64}, {1}, {20}, 3);
  for (Layout layout : {Layout::Contiguous, Layout::Paged}) {
    try {
      attend(st, Device::CUDA, layout, DecodeAttention::Fast, 1);
      ADD_FAILURE() << "Fast ran without lesson 14's kernel installed";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("install_fast_decode_attention"), std::string::npos) << e.what();
    }
  }
}

TEST(FastDecode14Gpu, UseFastPathMakesFastTheDecodeKernelButKeepsBatchInvariance) {
  TVLLM_REQUIRE_GPU();
  const ModelWeights& w = testing::bundled_model<Device::CUDA>().w;
  const EngineLimits limits = Generator::limits_for(w.config, 64, 1, 64);
  Generator fast(w, limits), invariant(w, limits), off(w, limits);
  use_fast_path(fast);
  EXPECT_EQ(fast.attention().decode_kind(), DecodeAttention::Fast);
  invariant.set_batch_invariant(true);
  use_fast_path(invariant);
  EXPECT_EQ(invariant.attention().decode_kind(), DecodeAttention::Flash);
  FastPathOptions no_fast_attention;
  no_fast_attention.fast_attention = false;
  use_fast_path(off, no_fast_attention);
  EXPECT_EQ(off.attention().decode_kind(), DecodeAttention::Split);
}

// ---- the benchmark (run by name: --gtest_also_run_disabled_tests --gtest_filter='*Bench*') ---------------------

TEST(FastDecode14Gpu, DISABLED_BenchDecodeAttention1BShape) {
  TVLLM_REQUIRE_GPU();
  install_fast_decode_attention();
  // Llama 3.2 1B's attention (32 heads, 8 kv heads of 64), blocks of 16: lesson 10's kernel and lesson 14's over
  // the same pool and cache. Layers: 16, fewer where 16 layers of both caches would not fit in ~24 GB.
  const AttentionShape s{32, 8, 64};
  for (int64_t B : {1, 8, 64, 256}) {
    for (int64_t context : {128, 2048, 8192}) {
      const double per_layer = 2.0 * 2.0 * static_cast<double>(B * context * s.kv_dim()) * 2;  // k+v, both layouts
      const int64_t layers = std::clamp<int64_t>(static_cast<int64_t>(24e9 / per_layer), 1, 16);
      for (FastDecodePipeline pipeline : {FastDecodePipeline::Registers, FastDecodePipeline::Ring}) {
        set_fast_decode_pipeline(pipeline);
        std::printf("\nlesson 14 kernel: %s\n", fast_decode_pipeline_name(pipeline));
        const PagedDecodeBench r = bench_paged_decode(s, layers, B, context, 16, std::cout);
        EXPECT_GT(r.fast_paged_gbs, 0.0);
        std::printf("SUMMARY B %lld ctx %lld layers %lld: lesson 10 paged %.1f%%, contiguous %.1f%% | lesson 14 %s "
                    "(%d splits) paged %.1f%%, contiguous %.1f%% of copy (%.0f GB/s)\n",
                    static_cast<long long>(B), static_cast<long long>(context), static_cast<long long>(layers),
                    100.0 * r.paged_gbs / r.copy_gbs, 100.0 * r.contiguous_gbs / r.copy_gbs,
                    fast_decode_pipeline_name(pipeline), r.fast_splits, 100.0 * r.fast_paged_gbs / r.copy_gbs,
                    100.0 * r.fast_contiguous_gbs / r.copy_gbs, r.copy_gbs);
      }
      set_fast_decode_pipeline(FastDecodePipeline::Ring);
    }
  }
}

TEST(FastDecode14Gpu, DISABLED_BenchDecodeAttentionHeadDim128) {
  TVLLM_REQUIRE_GPU();
  install_fast_decode_attention();
  // Llama 3 8B's attention (32 heads, 8 kv heads of 128) and a group of 8 (64 heads / 8 kv heads of 128).
  for (const AttentionShape& s : {AttentionShape{32, 8, 128}, AttentionShape{64, 8, 128}}) {
    for (FastDecodePipeline pipeline : {FastDecodePipeline::Registers, FastDecodePipeline::Ring}) {
      set_fast_decode_pipeline(pipeline);
      std::printf("\nlesson 14 kernel: %s\n", fast_decode_pipeline_name(pipeline));
      const PagedDecodeBench r = bench_paged_decode(s, 8, 64, 2048, 16, std::cout);
      EXPECT_GT(r.fast_paged_gbs, 0.0);
    }
  }
  set_fast_decode_pipeline(FastDecodePipeline::Ring);
}

}  // namespace
}  // namespace tvllm
