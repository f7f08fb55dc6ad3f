// Lesson 14: the fast sampler. Lesson 09's GpuSampler gives every row ONE block, which streams the row up
// to 18 times: 1.2-2 ms for top-k / top-p at vocab 128256, more than a decode step. FastSampler computes
// exactly the same thing (the same integer masses, thresholds and draw, from lesson 09's sampling_math.h:
// the same id as sample_cpu on every row) in one of two ways, chosen per call:
//
//   cluster path (the default on Hopper, vocab up to 16 x 40960 = 655360): ONE launch. Each row gets a
//     thread-block cluster of up to 16 blocks; each block reads its chunk of logits once, keeps the keys in
//     shared memory, and the blocks meet at cluster barriers between the radix digits and before the draw
//     (cluster_sampler.h / .cu; cluster_sampler_cpu.cpp models it on the CPU). Two versions of that kernel:
//     version 1 (Path::kClusterV1, or TVLLM_TOPP_V=old); version 2 (Path::kClusterV2) pays one cluster barrier per digit and skips most
//     of top-p's exponentials in the draw, and was measured SLOWER on the H200 (chapter 14, section 6), so it
//     stays as the lesson's experiment (cluster_sampler.h lists the differences); version 3
//     (Path::kClusterV3; Path::kAuto's default, TVLLM_TOPP_V=old takes version 1) finds top-p's threshold
//     with one pass of masses into fine buckets of z - z_max and a short sorted list (6 cluster barriers
//     instead of 9): measured 1.40x faster than version 1 at batch 64 top-p 0.9 (169.5 -> 121.3 us, H200).
//     Version 4 (Path::kClusterV4, or TVLLM_TOPK_V=new) also finds top-k's threshold by a list after its
//     first digit, not yet measured.
//   multi-pass path (any vocab, any GPU): seven launches over a grid (chunks, rows), the row's state and
//     histograms in a global workspace between them:
//
//   pass      grid (chunks, rows), each block one chunk of its row       the row's last block to finish
//   first     key of every z (stored), max key (argmax for greedy rows),  greedy id | z_max, top-k digit 1
//             top-k digit-1 counts
//   select x5 one more digit of top-k (counts) or top-p (masses)          picks the bucket, next digit
//   draw      kept mass of each warp's contiguous segment                 total, U, segment, token
//
// The first pass divides by the temperature once per token and stores order_key(z); the key is z in an
// order-preserving encoding, so the later passes read keys and never divide again. Seven kernel launches
// whatever the rows ask (the rows' knobs live on the device, so the host cannot
// skip passes; a pass with nothing to do for a row returns at once). Between passes the rows' state and
// histograms live in a workspace allocated once in the constructor. Masses and counts are integers, so
// the histograms are added with atomics in any order and still come out exact.
//
// The multi-pass path measured on the H200 (vocab 128256, bf16-rounded normal logits, eager back-to-back
// calls, µs per call; lesson 09 in brackets):
//                               greedy   temperature   top-k 50    top-p 0.9    top-k 50 + top-p 0.9
//   batch  1                     29          33          34           40              50
//                              (19)       (220)       (588)        (698)           (990)
//   batch 64                     32          65          99          152             163
//                              (20)       (229)       (620)        (726)          (1039)
// About 25 µs of each figure is the seven launches themselves (greedy pays them too); top-p's cost is its
// masses: an exponential per token in its first digit and again in the draw. The cluster path, the same run
// (test_14_sampler_gpu PrintsTimings, H200, 2026-12-03; version 1 / version 2):
//   batch  1                     5.0 / 5.4   10.5 / 10.8  24.3 / 27.0  30.4 / 33.9      38.6 / 45.3
//   batch 64                    19.6 / 20.9  45.6 / 46.4  99.4 / 102.5 161.8 / 176.6   168.1 / 180.7
// Version 3 against version 1 (2026-12-04, temperature 0.8): batch 64 top-p 169.5 -> 121.3, top-k + top-p
// 184.1 -> 152.8, top-k 108.2 / 110.3 (the same code); batch 1 top-p 31.3 -> 26.9. Version 4: not measured.
//
// Engine rules as GpuSampler: sample() allocates nothing, never synchronises, and can be captured in a
// CUDA graph (the knobs come from the device `rows` array). Unlike GpuSampler, the multi-pass workspace
// makes one FastSampler usable by one stream at a time (as a cuBLAS handle's workspace): calls on two
// streams at once must use two samplers (a FastSampler whose calls all take the cluster path has no
// workspace, but do not count on it: the path depends on the device).
//
// C++17: included by fast_sampler.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/buffer.h"
#include "sampling.h"  // lesson 09: SamplingRow, SamplingParams, sample_cpu (the oracle)

namespace tvllm {

class FastSampler final : public TokenSampler {
 public:
  enum class Path {
    kAuto,       // the cluster path whenever the device and the vocab allow it, else multi-pass; the cluster
                 // kernel's version from the environment: TVLLM_TOPP_V=new (or unset) takes version 3, =old
                 // version 1; TVLLM_TOPK_V=new takes version 4 (InputError for any other value, and for
                 // TVLLM_TOPK_V=new with TVLLM_TOPP_V=old), so one binary times them all
    kMultiPass,  // always the multi-pass path (tests and the benchmark compare the paths)
    kClusterV2,  // as kAuto, with the second cluster kernel (version 2: measured slower; cluster_sampler.h)
    kClusterV1,  // as kAuto, with the first cluster kernel whatever the environment says
    kClusterV3,  // as kAuto, with the third (top-p by fine buckets and a list; cluster_sampler.h), likewise
    kClusterV4,  // as kAuto, with the fourth (version 3 plus top-k's list after its first digit), likewise
  };

  // max_batch >= 1 rows per call, 1 <= max_vocab <= 2^23 logits per row. InputError otherwise.
  // When some call may take the multi-pass path, allocates and zeroes its workspace (4 bytes per logit of
  // max_batch x max_vocab for the keys, plus about 17 KiB per row: 33 MB at 64 x 128256) and synchronises
  // once, here. The cluster path needs no workspace.
  FastSampler(int max_batch, int64_t max_vocab, Path path = Path::kAuto);

  // Exactly GpuSampler::sample: logits device fp32, row b at logits + b * row_stride, vocab <= row_stride;
  // rows: device [batch] SamplingRow; out_ids: device int32 [batch]. Queued on `stream`, no waiting.
  void sample(const float* logits, int64_t row_stride, int64_t vocab, int batch, const SamplingRow* rows,
              int32_t* out_ids, cudaStream_t stream = nullptr) const override;

  int max_batch() const { return max_batch_; }
  int64_t max_vocab() const { return max_vocab_; }
  // Multi-pass path: how many blocks (chunks) share one row for this call: enough blocks to fill the GPU
  // once.
  int chunks_per_row(int batch, int64_t vocab) const;
  // Does a call of this shape take the cluster path? Then `cluster` blocks share each row (else 0).
  int cluster_per_row(int batch, int64_t vocab) const;
  // The cluster kernel's version this sampler launches (1, 2, 3 or 4; see Path).
  int cluster_version() const { return cluster_version_; }
  // Kernels queued by one sample() call of this shape: 1 (cluster path) or kMultiPassLaunches.
  int launches(int batch, int64_t vocab) const {
    return cluster_per_row(batch, vocab) > 0 ? 1 : kMultiPassLaunches;
  }

  static constexpr int kThreads = 256;          // per block, multi-pass path
  static constexpr int kMultiPassLaunches = 7;  // kernels queued by one multi-pass sample() call

 private:
  int max_batch_;
  int64_t max_vocab_;
  int sms_ = 1;
  int max_cluster_ = 0;  // the largest cluster the device launches for the cluster path; 0: never take it
  int cluster_version_ = 1;  // the cluster kernel's version (Path::kClusterV2: 2)
  int wave_blocks_;      // blocks of the heaviest multi-pass kernel that run at once on the whole GPU
  int max_chunks_;
  DeviceBuffer workspace_;  // multi-pass path: row states, histograms, segment masses (fast_sampler.cu)
};

// ---- benchmark helper (for the lesson executable) ----------------------------------------------------

// Times sample() with CUDA events on a stream of its own: `batch` model-like rows of `vocab` logits
// (normal, spread 2, rounded to bf16), every row with `params`; warm-up, then the mean over `iters`
// back-to-back calls. Times the default FastSampler, each cluster kernel (versions 1 to 4), the multi-pass
// path alone and lesson 09's GpuSampler on the same rows, and checks all agree on every id (InputError if
// not). Needs a GPU.
struct SamplerTiming {
  double fast_us = 0.0;       // FastSampler::sample (default: the cluster path where it applies), per call
  double cluster_v2_us = 0.0;  // FastSampler::sample with Path::kClusterV2 (the second cluster kernel)
  double cluster_v1_us = 0.0;  // ... Path::kClusterV1 (the first: TVLLM_TOPP_V=old's)
  double cluster_v3_us = 0.0;  // ... Path::kClusterV3 (the third: the default)
  double cluster_v4_us = 0.0;  // ... Path::kClusterV4 (the fourth: TVLLM_TOPK_V=new's)
  double multipass_us = 0.0;  // FastSampler::sample with Path::kMultiPass, per call
  double lesson09_us = 0.0;   // GpuSampler::sample, per call
  int cluster = 0;            // blocks per row the default took (0: it took the multi-pass path)
};
SamplerTiming bench_fast_sampler(int batch, int64_t vocab, const SamplingParams& params, int iters = 50);

}  // namespace tvllm
