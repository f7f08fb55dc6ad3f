// Lesson 12: how fast the paged decode kernel reads the cache, beside lesson 10's contiguous one.
//
// Decode attention is memory-bound: every step reads each sequence's whole context (k and v) once and does ~2
// flops per byte. So the figure is achieved GB/s (bytes = the K and V rows actually read, + q and out) against
// the measured device copy bandwidth. The paged kernel reads the same bytes as the contiguous one, only from
// blocks scattered over the pool (the tables are shuffled here, as a long-running server's would be): the cost
// of paging is whatever the table look-ups and the shorter contiguous runs (one block = block_size rows) take.
#include <algorithm>
#include <cstdio>
#include <numeric>
#include <ostream>
#include <string>
#include <vector>

#include "common/bench.h"
#include "common/errors.h"
#include "common/random.h"
#include "kv_cache.h"
#include "paged_kv.h"

namespace tvllm {

PagedDecodeBench bench_paged_decode(const AttentionShape& shape, int64_t num_layers, int64_t batch, int64_t context,
                                    int64_t block_size, std::ostream& out) {
  shape.validate();
  TVLLM_REQUIRE(num_layers >= 1 && batch >= 1 && context >= 1 && block_size >= 1,
                "bench_paged_decode: layers, batch, context and block size must be >= 1");
  const Device cuda = Device::CUDA;
  const int64_t blocks_per_seq = (context + block_size - 1) / block_size;
  const int64_t num_blocks = batch * blocks_per_seq;

  // The paged side: every block of the pool belongs to some sequence, in a shuffled order.
  PagedKvPool pool(shape, num_layers, num_blocks, block_size, cuda);
  TVLLM_CUDA_CHECK(cudaMemset(pool.k(0).data, 0, pool.bytes()));  // zeros: finite scores, same work as real keys
  std::vector<int32_t> order(static_cast<size_t>(num_blocks));
  std::iota(order.begin(), order.end(), 0);
  Rng rng(12);
  for (int64_t i = num_blocks - 1; i > 0; --i) std::swap(order[i], order[rng.below(i + 1)]);  // Fisher-Yates
  std::vector<std::vector<int32_t>> tables(static_cast<size_t>(batch));
  std::vector<int32_t> slot_mapping(static_cast<size_t>(batch));
  for (int64_t b = 0; b < batch; ++b) {
    tables[b].assign(order.begin() + b * blocks_per_seq, order.begin() + (b + 1) * blocks_per_seq);
    const int64_t last = context - 1;  // the step's one new token per sequence
    slot_mapping[b] = static_cast<int32_t>(tables[b][last / block_size] * block_size + last % block_size);
  }
  PagedStepTables step_tables(batch, batch, blocks_per_seq, num_blocks, block_size, cuda);
  step_tables.set(slot_mapping, tables);

  // The contiguous side: lesson 10's cache, one slot per sequence, the same lengths.
  KvCache cache(shape, num_layers, batch, context, cuda);
  TVLLM_CUDA_CHECK(cudaMemset(cache.k(0).data, 0, cache.bytes()));
  CacheSlots slots(batch, batch, cuda);
  std::vector<int32_t> slot_ids(static_cast<size_t>(batch));
  std::iota(slot_ids.begin(), slot_ids.end(), 0);
  slots.set(slot_ids);

  AttentionBatch lengths(batch, cuda);
  lengths.set_lengths(std::vector<int64_t>(static_cast<size_t>(batch), 1),
                      std::vector<int64_t>(static_cast<size_t>(batch), context));
  const Tensor q = Tensor::from_f32(random_normal(static_cast<size_t>(batch * shape.q_dim()), 5), {batch, shape.q_dim()},
                                    DType::BF16, cuda);
  const Tensor o = Tensor::empty({batch, shape.q_dim()}, DType::BF16, cuda);
  DecodeWorkspace ws(shape, batch, cuda);
  PagedDecodeBench r;
  r.splits = decode_splits(shape, static_cast<int>(batch), context, ws.num_sms());  // the same for both
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());

  // One decode step's attention: every layer in turn, as forward() runs them.
  const auto paged = [&] {
    for (int l = 0; l < num_layers; ++l)
      paged_decode_attention(o, q, pool.k(l), pool.v(l), lengths, step_tables, shape, r.splits, &ws);
  };
  const auto contiguous = [&] {
    for (int l = 0; l < num_layers; ++l)
      decode_attention(o, q, cache.k(l), cache.v(l), lengths, slots, shape, r.splits, &ws);
  };
  const BenchResult paged_t = bench_gpu(paged);
  const BenchResult contiguous_t = bench_gpu(contiguous);
  // Lesson 14's kernel, when it is installed, with the split count it would choose.
  const FastDecodeKernel fast = installed_fast_decode();
  const bool with_fast = fast.splits != nullptr && installed_fast_paged_decode() != nullptr;
  BenchResult fast_paged_t, fast_contiguous_t;
  if (with_fast) {
    r.fast_splits = fast.splits(shape, static_cast<int>(batch), context, ws.num_sms());
    fast_paged_t = bench_gpu([&] {
      for (int l = 0; l < num_layers; ++l)
        paged_decode_attention(o, q, pool.k(l), pool.v(l), lengths, step_tables, shape, r.fast_splits, &ws, nullptr,
                               DecodeAttention::Fast);
    });
    fast_contiguous_t = bench_gpu([&] {
      for (int l = 0; l < num_layers; ++l)
        decode_attention(o, q, cache.k(l), cache.v(l), lengths, slots, shape, r.fast_splits, &ws, nullptr,
                         DecodeAttention::Fast);
    });
  }

  const double elem = 2.0;  // bf16
  r.bytes = static_cast<double>(num_layers) *
            (static_cast<double>(batch) * static_cast<double>(context) * 2.0 * static_cast<double>(shape.kv_dim()) +
             2.0 * static_cast<double>(batch) * static_cast<double>(shape.q_dim())) *
            elem;
  const Ceilings ceilings = measure_ceilings(false);
  r.copy_gbs = ceilings.copy_gbs;
  r.paged_ms = paged_t.median_ms;
  r.contiguous_ms = contiguous_t.median_ms;
  r.paged_gbs = r.bytes / (r.paged_ms * 1e-3) / 1e9;
  r.contiguous_gbs = r.bytes / (r.contiguous_ms * 1e-3) / 1e9;
  if (with_fast) {
    r.fast_paged_ms = fast_paged_t.median_ms;
    r.fast_contiguous_ms = fast_contiguous_t.median_ms;
    r.fast_paged_gbs = r.bytes / (r.fast_paged_ms * 1e-3) / 1e9;
    r.fast_contiguous_gbs = r.bytes / (r.fast_contiguous_ms * 1e-3) / 1e9;
  }

  char title[256];
  std::snprintf(title, sizeof title,
                "decode attention, %lld layers x %lld sequences x %lld keys, %lld heads / %lld kv heads x %lld, "
                "%d splits, blocks of %lld",
                static_cast<long long>(num_layers), static_cast<long long>(batch), static_cast<long long>(context),
                static_cast<long long>(shape.n_heads), static_cast<long long>(shape.n_kv_heads),
                static_cast<long long>(shape.head_dim), r.splits, static_cast<long long>(block_size));
  std::vector<BenchRow> rows{BenchRow{"paged (shuffled blocks)", paged_t, r.bytes, 0.0},
                             BenchRow{"contiguous (lesson 10)", contiguous_t, r.bytes, 0.0}};
  if (with_fast) {
    const std::string splits = " (" + std::to_string(r.fast_splits) + " splits)";
    rows.push_back(BenchRow{"lesson 14 kernel, paged" + splits, fast_paged_t, r.bytes, 0.0});
    rows.push_back(BenchRow{"lesson 14 kernel, contiguous" + splits, fast_contiguous_t, r.bytes, 0.0});
  }
  print_bench_table(out, title, rows, ceilings);
  char line[160];
  std::snprintf(line, sizeof line, "paged / contiguous time: %.3f  (%.1f MB of K and V per step)\n",
                r.paged_ms / r.contiguous_ms, r.bytes / 1e6);
  out << line;

  // Lesson 16: the same step over an FP8 pool (zero codes: 0.0, finite scores), the same tables. Half the K and V
  // bytes; the bf16 pool and cache are freed first so that the FP8 pool fits wherever they did.
  pool = PagedKvPool();
  cache = KvCache();
  PagedKvPool pool8(shape, num_layers, num_blocks, block_size, cuda, KvCacheDtype::FP8);
  TVLLM_CUDA_CHECK(cudaMemset(pool8.k(0).data, 0, pool8.bytes()));
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
  const auto fp8_step = [&](DecodeAttention kind, int splits) {
    return bench_gpu([&] {
      for (int l = 0; l < num_layers; ++l)
        paged_decode_attention(o, q, pool8.k(l), pool8.v(l), lengths, step_tables, shape, splits, &ws, nullptr, kind,
                               pool8.quant(l));
    });
  };
  r.fp8_bytes = static_cast<double>(num_layers) *
                (static_cast<double>(batch) * static_cast<double>(context) * 2.0 * static_cast<double>(shape.kv_dim()) +
                 2.0 * 2.0 * static_cast<double>(batch) * static_cast<double>(shape.q_dim()));
  const BenchResult fp8_t = fp8_step(DecodeAttention::Split, r.splits);
  r.fp8_paged_ms = fp8_t.median_ms;
  std::vector<BenchRow> rows8{BenchRow{"paged FP8 (lesson 10 kernel)", fp8_t, r.fp8_bytes, 0.0}};
  if (with_fast && installed_fast_paged_decode_fp8() != nullptr) {
    const BenchResult fast8_t = fp8_step(DecodeAttention::Fast, r.fast_splits);
    r.fp8_fast_paged_ms = fast8_t.median_ms;
    rows8.push_back(BenchRow{"lesson 14 kernel, paged FP8 (" + std::to_string(r.fast_splits) + " splits)", fast8_t,
                             r.fp8_bytes, 0.0});
  }
  print_bench_table(out, "the same step over an FP8 pool (E4M3 codes, half the K and V bytes)", rows8, ceilings);
  std::snprintf(line, sizeof line, "FP8 / bf16 time, paged: lesson 10 kernel %.3f%s\n", r.fp8_paged_ms / r.paged_ms,
                r.fp8_fast_paged_ms > 0 ? (", lesson 14 kernel " + std::to_string(r.fp8_fast_paged_ms / r.fast_paged_ms)).c_str()
                                        : "");
  out << line;
  return r;
}

}  // namespace tvllm
