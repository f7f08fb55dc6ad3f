// Lesson 15, step 5: flash_wgmma() against lesson 07 (flash_check.h).
#include "flash_check.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "common/errors.h"
#include "common/random.h"
#include "flash_paged.h"
#include "flash_wgmma.h"
#include "hopper.h"
#include "matmul_check.h"  // compare_rows, kF32OutVsCpu (lesson 06)
#include "paged_kv.h"

namespace tvllm {
namespace {

int64_t total(const std::vector<int64_t>& v) {
  int64_t t = 0;
  for (int64_t n : v) t += n;
  return t;
}

std::vector<float> round_to_bf16(const std::vector<float>& x) {
  return to_f32_vector(Tensor::from_f32(x, {static_cast<int64_t>(x.size())}, DType::BF16, Device::CPU));
}

std::string list(const std::vector<int64_t>& v) {
  std::string s;
  for (int64_t n : v) s += (s.empty() ? "" : ",") + std::to_string(n);
  return s;
}

// The device copy of [rows, cols] values as columns [offset, offset + cols) of a [rows, width] bf16 buffer
// whose other columns hold `fill`.
Tensor widened(const std::vector<float>& x, int64_t rows, int64_t cols, int64_t offset, int64_t width,
               float fill) {
  std::vector<float> wide(static_cast<size_t>(rows * width), fill);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) wide[r * width + offset + c] = x[r * cols + c];
  return Tensor::from_f32(wide, {rows, width}, DType::BF16, Device::CUDA);
}

constexpr int64_t kOutOffset = 8, kOutExtra = 16;  // out sits at columns 8.. of a buffer 16 columns wider

// Runs one GPU path into a fresh NaN-filled wider buffer and reads out back: (values, changed outside).
template <class Run>
std::pair<std::vector<float>, int64_t> run_into_poisoned(int64_t Tq, int64_t q_dim, Run&& run) {
  const int64_t width = q_dim + kOutExtra;
  const Tensor storage = Tensor::empty({Tq, width}, DType::BF16, Device::CUDA);
  TVLLM_CUDA_CHECK(cudaMemset(storage.data(), 0xFF, storage.view().nbytes()));  // 0xFFFF: a bf16 NaN
  run(storage.view().columns(kOutOffset, q_dim));
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<uint16_t> bits(static_cast<size_t>(Tq * width));
  TVLLM_CUDA_CHECK(cudaMemcpy(bits.data(), storage.data(), bits.size() * 2, cudaMemcpyDeviceToHost));
  std::vector<float> out(static_cast<size_t>(Tq * q_dim));
  int64_t outside = 0;
  for (int64_t t = 0; t < Tq; ++t)
    for (int64_t c = 0; c < width; ++c) {
      const uint16_t b = bits[t * width + c];
      if (c >= kOutOffset && c < kOutOffset + q_dim) {
        const uint32_t f = static_cast<uint32_t>(b) << 16;
        std::memcpy(&out[t * q_dim + c - kOutOffset], &f, 4);
      } else {
        outside += b != 0xFFFF;
      }
    }
  return {out, outside};
}

}  // namespace

FlashCheck check_flash_wgmma(const std::vector<int64_t>& q_lens, const std::vector<int64_t>& k_lens,
                             const AttentionShape& s, uint64_t seed, bool fused_qkv,
                             const FlashConfig* config) {
  require_hopper("check_flash_wgmma");
  const int64_t Tq = total(q_lens), Tk = total(k_lens);
  const std::vector<float> q = round_to_bf16(random_normal(static_cast<size_t>(Tq * s.q_dim()), seed));
  const std::vector<float> k = round_to_bf16(random_normal(static_cast<size_t>(Tk * s.kv_dim()), seed + 1));
  const std::vector<float> v = round_to_bf16(random_uniform(static_cast<size_t>(Tk * s.kv_dim()), seed + 2));

  // The oracle: lesson 07's CPU reference on the bf16-exact values.
  const AttentionBatch cpu_batch = AttentionBatch::with_lengths(q_lens, k_lens, Device::CPU);
  const Tensor expected = Tensor::empty({Tq, s.q_dim()}, DType::F32, Device::CPU);
  attention(expected, Tensor::from_f32(q, {Tq, s.q_dim()}, DType::F32, Device::CPU),
            Tensor::from_f32(k, {Tk, s.kv_dim()}, DType::F32, Device::CPU),
            Tensor::from_f32(v, {Tk, s.kv_dim()}, DType::F32, Device::CPU), cpu_batch, s);
  const std::vector<float> want = to_f32_vector(expected);

  // The device inputs: packed, or one fused QKV buffer (q | k | v columns; needs q_lens == k_lens), its NaN
  // padding columns never read by a correct kernel.
  Tensor q_dev, k_dev, v_dev, qkv_dev;
  TensorView qv, kv, vv;
  if (fused_qkv) {
    TVLLM_REQUIRE(Tq == Tk, "check_flash_wgmma: a fused QKV buffer needs q_len == k_len");
    const int64_t width = s.qkv_dim() + 8;  // 8 NaN columns at the end: rows stay 16-byte aligned
    std::vector<float> qkv(static_cast<size_t>(Tq * width), NAN);
    for (int64_t t = 0; t < Tq; ++t) {
      for (int64_t c = 0; c < s.q_dim(); ++c) qkv[t * width + c] = q[t * s.q_dim() + c];
      for (int64_t c = 0; c < s.kv_dim(); ++c) {
        qkv[t * width + s.q_dim() + c] = k[t * s.kv_dim() + c];
        qkv[t * width + s.q_dim() + s.kv_dim() + c] = v[t * s.kv_dim() + c];
      }
    }
    qkv_dev = Tensor::from_f32(qkv, {Tq, width}, DType::BF16, Device::CUDA);
    const QkvViews views = split_qkv(qkv_dev.view().columns(0, s.qkv_dim()), s);
    qv = views.q, kv = views.k, vv = views.v;
  } else {
    q_dev = Tensor::from_f32(q, {Tq, s.q_dim()}, DType::BF16, Device::CUDA);
    k_dev = Tensor::from_f32(k, {Tk, s.kv_dim()}, DType::BF16, Device::CUDA);
    v_dev = Tensor::from_f32(v, {Tk, s.kv_dim()}, DType::BF16, Device::CUDA);
    qv = q_dev.view(), kv = k_dev.view(), vv = v_dev.view();
  }
  AttentionBatch batch(static_cast<int64_t>(q_lens.size()), Device::CUDA);
  batch.set_lengths(q_lens, k_lens);
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());

  double max_v = 0.0;
  for (float x : v) max_v = std::max(max_v, static_cast<double>(std::fabs(x)));
  const Tolerance tol{kFlashRounding * max_v, kFlashRounding};
  const FlashConfig& c = config ? *config : flash_default_config(s.head_dim, batch.max_q_len());
  const std::string name = std::string(c.name) + (fused_qkv ? " fused qkv" : " packed") + " heads " +
                           std::to_string(s.n_heads) + "/" + std::to_string(s.n_kv_heads) + " dim " +
                           std::to_string(s.head_dim) +
                           (s.window > 0 ? " window " + std::to_string(s.window) : "") + " q_len {" +
                           list(q_lens) + "} k_len {" + list(k_lens) + "}";

  FlashCheck r;
  auto [ours, outside] = run_into_poisoned(
      Tq, s.q_dim(), [&](const TensorView& out) { flash_wgmma(out, qv, kv, vv, batch, s, nullptr, c); });
  for (float x : ours) r.non_finite += !std::isfinite(x);
  r.written_outside = outside;
  r.ours = compare("flash_wgmma " + name, ours, want, tol);
  auto [theirs, theirs_outside] = run_into_poisoned(Tq, s.q_dim(), [&](const TensorView& out) {
    attention(out, qv, kv, vv, batch, s, AttentionKernel::V2Flash);
  });
  (void)theirs_outside;
  r.lesson07 = compare("lesson 07 v2 " + name, theirs, want, tol);
  return r;
}

FlashCheck check_flash_wgmma_paged(const std::vector<int64_t>& q_lens, const std::vector<int64_t>& k_lens,
                                   const AttentionShape& s, int64_t bs, uint64_t seed, int share_from,
                                   int64_t share_keys, const FlashConfig* config, cudaStream_t stream) {
  require_hopper("check_flash_wgmma_paged");
  TVLLM_REQUIRE(q_lens.size() == k_lens.size() && !q_lens.empty() && bs >= 1 && share_keys % bs == 0,
                "check_flash_wgmma_paged: one k_len per q_len, and a shared prefix of whole blocks");
  const auto B = static_cast<int64_t>(q_lens.size());
  const int64_t Tq = total(q_lens), kv = s.kv_dim();
  // The tables: blocks handed out from a shuffled pool (a long-running server's free list).
  int64_t num_blocks = 7;
  for (int64_t k : k_lens) num_blocks += (k + bs - 1) / bs;
  std::vector<int32_t> order(static_cast<size_t>(num_blocks));
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
  Rng rng(seed);
  for (size_t i = order.size() - 1; i > 0; --i)
    std::swap(order[i], order[rng.below(static_cast<int64_t>(i) + 1)]);
  std::vector<std::vector<int32_t>> tables(static_cast<size_t>(B));
  size_t next = 0, longest = 1;
  for (int64_t b = 0; b < B; ++b) {
    auto& t = tables[static_cast<size_t>(b)];
    if (share_from >= 0 && b + 1 == B) {
      const auto& from = tables.at(static_cast<size_t>(share_from));
      t.assign(from.begin(), from.begin() + share_keys / bs);
    }
    while (static_cast<int64_t>(t.size()) * bs < k_lens[b]) t.push_back(order.at(next++));
    longest = std::max(longest, t.size());
  }
  // Which slots hold a key (NaN elsewhere), and the new tokens' slots (the last q_len positions of each
  // sequence).
  std::vector<char> used(static_cast<size_t>(num_blocks * bs), 0);
  std::vector<int32_t> slots;
  for (int64_t b = 0; b < B; ++b) {
    const auto& t = tables[static_cast<size_t>(b)];
    for (int64_t pos = 0; pos < k_lens[b]; ++pos) {
      const int64_t slot = t[static_cast<size_t>(pos / bs)] * bs + pos % bs;
      used[static_cast<size_t>(slot)] = 1;
      if (pos >= k_lens[b] - q_lens[b]) slots.push_back(static_cast<int32_t>(slot));
    }
  }
  const auto n = static_cast<size_t>(num_blocks * bs * kv);
  std::vector<float> k = round_to_bf16(random_normal(n, seed + 1)),
                     v = round_to_bf16(random_uniform(n, seed + 2));
  double max_v = 0.0;
  for (size_t i = 0; i < n; ++i) {
    if (!used[i / static_cast<size_t>(kv)])
      k[i] = v[i] = NAN;
    else
      max_v = std::max(max_v, static_cast<double>(std::fabs(v[i])));
  }
  const std::vector<float> q =
      round_to_bf16(random_normal(static_cast<size_t>(Tq * s.q_dim()), seed + 3, 2.f));

  // The oracle: lesson 12's CPU paged prefill (double precision) over a CPU pool holding the same values.
  std::vector<float> want;
  {
    PagedKvPool pool(s, 1, num_blocks, bs, Device::CPU);
    std::copy(k.begin(), k.end(), pool.k(0).ptr<float>());
    std::copy(v.begin(), v.end(), pool.v(0).ptr<float>());
    const AttentionBatch batch = AttentionBatch::with_lengths(q_lens, k_lens, Device::CPU);
    PagedStepTables t(std::max<int64_t>(Tq, 1), B, static_cast<int64_t>(longest), num_blocks, bs,
                      Device::CPU);
    t.set(slots, tables);
    const Tensor out = Tensor::empty({Tq, s.q_dim()}, DType::F32, Device::CPU);
    paged_prefill_attention_cpu(out, Tensor::from_f32(q, {Tq, s.q_dim()}, DType::F32, Device::CPU), pool.k(0),
                                pool.v(0), batch, t, s);
    want = to_f32_vector(out);
  }
  PagedKvPool pool(s, 1, num_blocks, bs, Device::CUDA);
  copy_view(pool.k(0), Tensor::from_f32(k, pool.k(0).shape, DType::BF16, Device::CUDA).view());
  copy_view(pool.v(0), Tensor::from_f32(v, pool.k(0).shape, DType::BF16, Device::CUDA).view());
  AttentionBatch batch(B, Device::CUDA);
  batch.set_lengths(q_lens, k_lens);
  PagedStepTables t(std::max<int64_t>(Tq, 1), B, static_cast<int64_t>(longest), num_blocks, bs, Device::CUDA);
  t.set(slots, tables);
  const Tensor q_dev = Tensor::from_f32(q, {Tq, s.q_dim()}, DType::BF16, Device::CUDA);
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());

  const Tolerance tol{kFlashRounding * max_v, kFlashRounding};
  const FlashConfig& c = config ? *config : flash_default_config(s.head_dim, batch.max_q_len());
  const std::string name =
      std::string(c.name) + " paged, blocks of " + std::to_string(bs) + ", heads " +
      std::to_string(s.n_heads) + "/" + std::to_string(s.n_kv_heads) + " dim " + std::to_string(s.head_dim) +
      (s.window > 0 ? " window " + std::to_string(s.window) : "") + " q_len {" + list(q_lens) + "} k_len {" +
      list(k_lens) + "}" + (share_from >= 0 ? " (a shared prefix)" : "");
  FlashCheck r;
  auto [ours, outside] = run_into_poisoned(Tq, s.q_dim(), [&](const TensorView& out) {
    TVLLM_CUDA_CHECK(
        cudaDeviceSynchronize());  // the NaN fill ran on the legacy stream; `stream` may not wait
    flash_wgmma_paged(out, q_dev, pool.k(0), pool.v(0), batch, t, s, stream, c);
    TVLLM_CUDA_CHECK(cudaStreamSynchronize(stream));
  });
  for (float x : ours) r.non_finite += !std::isfinite(x);
  r.written_outside = outside;
  r.ours = compare("flash_wgmma_paged " + name, ours, want, tol);
  auto [theirs, theirs_outside] = run_into_poisoned(Tq, s.q_dim(), [&](const TensorView& out) {
    paged_flash_attention_cuda(out, q_dev, pool.k(0), pool.v(0), batch, t, s, nullptr);
  });
  (void)theirs_outside;
  r.lesson07 = compare("lesson 12 paged flash " + name, theirs, want, tol);
  return r;
}

CompareResult check_wgmma_pv_tile(int64_t n, bool small_integers, uint64_t seed) {
  require_hopper("check_wgmma_pv_tile");
  const auto values = [&](size_t count, uint64_t s) {
    std::vector<float> x = small_integers ? std::vector<float>(count) : random_uniform(count, s);
    if (small_integers) {
      Rng rng(s);
      for (float& e : x) e = static_cast<float>(rng.below(17)) - 8.0f;
    }
    return round_to_bf16(x);
  };
  const std::vector<float> p = values(64 * 128, seed), v = values(static_cast<size_t>(128 * n), seed + 1);
  const Tensor p_dev = Tensor::from_f32(p, {64, 128}, DType::BF16, Device::CUDA);
  const Tensor v_dev = Tensor::from_f32(v, {128, n}, DType::BF16, Device::CUDA);
  const Tensor d = Tensor::empty({64, n}, DType::F32, Device::CUDA);
  TVLLM_CUDA_CHECK(cudaMemset(d.data(), 0xFF, d.view().nbytes()));  // NaN: an element never written fails
  wgmma_pv_tile(d, p_dev, v_dev);
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<float> want(static_cast<size_t>(64 * n));
  for (int64_t r = 0; r < 64; ++r)
    for (int64_t c = 0; c < n; ++c) {
      double sum = 0.0;
      for (int64_t k = 0; k < 128; ++k) sum += static_cast<double>(p[r * 128 + k]) * v[k * n + c];
      want[r * n + c] = static_cast<float>(sum);
    }
  const Tensor expected = Tensor::from_f32(want, {64, n}, DType::F32, Device::CPU);
  const std::string name =
      "wgmma P V tile 64x128 . 128x" + std::to_string(n) + (small_integers ? ", small integers" : ", random");
  if (small_integers) return compare(name, d, expected, Tolerance{0.0, 0.0});
  return compare_rows(name, d, expected, kF32OutVsCpu);
}

double causal_attention_flops(const std::vector<int64_t>& lengths, const AttentionShape& shape) {
  double pairs = 0.0;
  for (int64_t n : lengths) pairs += 0.5 * static_cast<double>(n) * static_cast<double>(n + 1);
  return pairs * 4.0 * static_cast<double>(shape.head_dim) * static_cast<double>(shape.n_heads);
}

}  // namespace tvllm
