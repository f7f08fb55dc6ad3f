// Lesson 14: the small-batch GEMV, and the decode step's GEMVs with their neighbours fused in.
//
// At decode time each sequence brings ONE new token, so a step multiplies M = 1..16 rows of activations by
// every weight matrix of the model:
//
//     out[M, N] = x[M, K] · W[N, K]^T          (W as nn.Linear stores it: row n = output feature n)
//
// M is tiny, so the work is reading W: 2*N*K bytes for 2*M*N*K flops, a handful of flops per byte. The
// speed limit is the memory bus (an H200 copies ~4.2 TB/s), and a kernel is as good as the fraction of it
// it reaches. cuBLAS, built for big tiles, reaches ~50% on 1x2048 · 2048x8192; the versions below climb:
//
//   v1  one warp per output (m, n): 32 lanes read W's row n in coalesced 4-byte words (2 bf16), each
//       lane sums its share, a warp-shuffle butterfly adds the 32 partial sums. Correct for any shape and
//       alignment (2-byte loads when K is odd or a row is not 4-byte aligned). It reads W once PER ROW m.
//   v2  one warp per weight row n, for ALL M input rows: W's row is read once and multiplied into M sums
//       held in registers. 16-byte loads (8 bf16 per instruction), 4 of them issued before any is used,
//       so every lane keeps 64 bytes in flight: the latency of DRAM is hidden by bytes in flight, not by
//       threads waiting their turn.
//   v3  a block of up to 8 warps owns a tile of 1 or 4 weight rows; its threads split K (a fixed,
//       deterministic split-K INSIDE the block: a reduce-scatter butterfly per warp, then the warps'
//       sums in order through shared memory), so even K = 8192 is
//       read by 256 threads at once with 8 loads in flight each. The weights are streamed with a
//       no-L1-allocate hint (read once, never again this step) while x, read by every block, stays in
//       L1. gemv.cu's header comment says why no split-K ACROSS blocks is needed.
//   v4  tensor cores (mma.sync m16n8k16) for M = 2..16: a warp multiplies 16 weight rows by 8 tokens per
//       instruction, still reading W once in 16-byte loads (the columns are relabelled so that a lane's 16
//       bytes feed the mma directly: gemv_v4.cuh). v3's scalar FMAs grow with M; v4's math is free up to 8
//       tokens (16: two mmas). Measured: flat in M, but at 42-45% of the bandwidth, below cuBLAS's ~61%, so
//       nothing uses it by default (an experiment of the chapter).
//
// The fused entry points run v3's structure with something folded in, each saving a launch and a round trip
// of the activations through memory:
//   rmsnorm_gemv           out = (rmsnorm(h) * g) · W^T: each block recomputes the rows' sums of squares
//                          (M*K*2 bytes, L1/L2 hits) and normalises x as it loads it (QKV projection).
//   rmsnorm_gemv_silu_mul  act = silu(gate) * up, [gate | up] = rmsnorm(h)*g · W_gate_up^T, W_gate_up the
//                          packed [2I, K] weight: the block owning output j reads rows j and I + j.
//   gemv_residual          h += x · W^T in place (o_proj, down_proj): the block owning (m, n) adds it.
//
// Rounding (what "equal to the unfused steps" means, element by element):
//   gemv            fp32 sum, rounded once to out's dtype (BF16, or F32 for the lm_head's logits).
//   rmsnorm prologue  inv = rsqrt(sum(h^2)/K + eps) in fp32; x = bf16(bf16(h * inv) * g), lesson 04's rule.
//   silu·mul        gate, up = bf16(sum); act = bf16(bf16(silu(gate)) * up), lesson 08's rule.
//   residual        h = bf16(h + bf16(sum)), lesson 04's add_rmsnorm after a bf16 linear().
//
// Determinism: every output's summation order is fixed by K and N alone (which thread reads which
// columns, in which order, and how the partial sums meet), never by M: row m of out is the same bits
// whether it is computed alone or among 16 rows, and from run to run. No atomics anywhere.
//
// FP8 weights (lesson 16 keeps a quantized checkpoint's weights resident): every entry point also has an
// overload taking w_scale after w. w is then F8_E4M3 [N, K] (E4M3 codes, 1 byte each) and w_scale F32 [N] (or
// [N, 1]), one scale per weight row, and the product is
//     out[m, n] = (sum_k x[m, k] * q[n, k]) * scale[n]
// computed by v3's kernel with 16 weights per 16-byte load (half the bytes of bf16): each pair of codes is
// widened exactly (cvt.rn.f16x2.e4m3x2, sm_89+; or with integer bit operations: Fp8GemvVariant below, the same
// bits), the fp32 sum is v3's, and the scale multiplies the finished
// sum ONCE per row, in fp32, before the roundings above. K % 8 == 0 on the GPU, as for bf16 (K % 16 != 0, e.g.
// the bundled model's K = 600: 8 codes per 8-byte load). With BF16 weights w_scale must be empty (TensorView{});
// the overloads without it are the BF16 ones.
//
// The device of the views picks the path:
//   CPU   the references: x, W, h, g BF16 or F32 (widened exactly), every sum in double, the roundings
//         above applied with the host's bf16 rounding (common/dtype.h); out BF16 or F32 (the fused ops'
//         intermediates are rounded to bf16 exactly as on the GPU, whatever out's dtype).
//   CUDA  x, W, h, g BF16; out BF16 (gemv and rmsnorm_gemv: or F32). Launched on `stream`; no allocation, no
//         synchronisation, no workspace: every call can be captured in a CUDA graph.
//
// Views are contiguous and row-major. M = x.dim(0) is 0..kGemvMaxRows (0: nothing to do).
//
// C++17: this header is included by gemv.cu.
#pragma once

#include <cuda_runtime.h>  // cudaStream_t

#include <cstdint>
#include <string_view>
#include <vector>

#include "common/tensor.h"
#include "kv_store.h"  // lesson 08: where rmsnorm_gemv_rope may also store k and v

namespace tvllm {
class RopeTable;  // lesson 05 (rope.h)
}

namespace tvllm {

// The largest batch the GEMVs take: beyond ~16 rows a tiled GEMM (lesson 06) reuses W better.
inline constexpr int kGemvMaxRows = 16;

enum class GemvKernel { V1Warp, V2Vector, V3Blocked, V4TensorCore };
inline constexpr GemvKernel kDefaultGemvKernel = GemvKernel::V3Blocked;

std::string_view gemv_kernel_name(GemvKernel kernel);     // "v1", "v2", "v3", "v4"
GemvKernel parse_gemv_kernel(std::string_view name);       // throws InputError for anything else
const std::vector<GemvKernel>& all_gemv_kernels();         // v1, v2, v3, v4

// Whether the 16-byte-load versions (v2, v3 and the fused ops) can read these operands: K % 8 == 0 and
// every listed pointer 16-byte aligned (then every row is, K*2 being a multiple of 16). gemv() runs v1
// instead when this is false; the fused ops throw InputError (callers check it first).
bool gemv_supported(const TensorView& x, const TensorView& w);
// The weight's half of that, for callers that check a model once: w BF16 [N, K], contiguous, K % 8 == 0,
// 16-byte aligned, and out_dtype BF16 or F32. (x must then still be 16-byte aligned: a Tensor's own rows are.)
bool gemv_shape_supported(const TensorView& w, DType out_dtype);

// out[M, N] = x[M, K] · w[N, K]^T. GPU: v2/v3 fall back to v1 when gemv_supported(x, w) is false.
void gemv(const TensorView& out, const TensorView& x, const TensorView& w,
          GemvKernel kernel = kDefaultGemvKernel, cudaStream_t stream = nullptr);

// How v3 turns E4M3 codes into the fp32 values it multiplies (lesson 16, §7.2): every variant sums the same
// products in the same order, so they are the same bits (the decoded values differ by an exact power of two,
// folded into the row's scale), and a batch size may pick its own variant without breaking batch invariance.
//   Cvt        cvt.rn.f16x2.e4m3x2 per pair of codes, then half -> float per weight; the whole 16-code pack of
//              every tile row widened before the FMAs (the first version).
//   Bits       integer bits instead of cvt: (code & 0x7F) << 7 placed in a half is 2^-8 x the E4M3 value, for
//              normals and subnormals alike (2^8 goes into the scale), the sign bit moves to bit 15; two codes
//              per half2 from one PRMT (__byte_perm) and two masks. Decoded per 8 columns, where they are used.
//   BitsTile8  Bits with 8 weight rows per block (4 gate|up outputs) where N >= 8 x 264: each x value loaded and
//              widened serves 8 rows, not 4 (for batch > 1, where x's loads and widening grow with M).
// Auto: the variant kFp8GemvVariantByRows picks for the batch. Not for NaN codes (0x7F, 0xFF): Cvt keeps them
// NaN, Bits reads them as +-480; quantized checkpoints never hold them (encoders saturate).
enum class Fp8GemvVariant { Auto, Cvt, Bits, BitsTile8 };
std::string_view fp8_gemv_variant_name(Fp8GemvVariant variant);  // "auto", "cvt", "bits", "bits-tile8"
Fp8GemvVariant parse_fp8_gemv_variant(std::string_view name);      // throws InputError for anything else
const std::vector<Fp8GemvVariant>& all_fp8_gemv_variants();        // cvt, bits, bits-tile8 (not auto)
// The variant each batch runs, by the row count the kernels are compiled for: [0] M = 1, [1] M = 2, [2] 3..4,
// [3] 5..8, [4] 9..16. From `lesson16_quantization --device cuda --bench` on the H200 (2026-12-03; the four
// decode shapes' median times summed, ms, cvt / bits / bits-tile8 / bf16 v3): M = 1 0.0395 / 0.0468 / 0.0472 /
// 0.0555; M = 2 0.0522 / 0.0572 / 0.0538 / 0.0752; M = 4 0.0853 / 0.0656 / 0.0694 / 0.0850; M = 8 0.1124 /
// 0.0861 / 0.0903 / 0.1088; M = 16 0.1811 / 0.1840 / 0.1611 / 0.2288. At one or two rows the weight bytes
// dominate and cvt's two-codes-per-instruction widening is enough; from four rows each decoded code serves
// M FMAs and the cheaper integer decode wins; at 16, eight rows per block halve the x traffic per weight.
inline constexpr Fp8GemvVariant kFp8GemvVariantByRows[5] = {Fp8GemvVariant::Cvt, Fp8GemvVariant::Cvt,
                                                            Fp8GemvVariant::Bits, Fp8GemvVariant::Bits,
                                                            Fp8GemvVariant::BitsTile8};
// kFp8GemvVariantByRows for M rows (1..kGemvMaxRows; InputError otherwise).
Fp8GemvVariant fp8_gemv_variant_for_rows(int64_t M);

// The same for BF16 or F8_E4M3 w (with its w_scale): v3 on the GPU (16-byte loads only: gemv_supported).
// fp8: which decoding F8_E4M3 weights take (ignored for BF16).
void gemv(const TensorView& out, const TensorView& x, const TensorView& w, const TensorView& w_scale,
          cudaStream_t stream = nullptr, Fp8GemvVariant fp8 = Fp8GemvVariant::Auto);

// The fused ops below take `pdl`: true launches the kernel as a programmatic dependent of the stream's
// previous kernel (pdl.h: it starts loading its weights while that kernel finishes, and waits for it before
// touching anything else). Only where pdl_supported(); the results are the same bits either way.

// out[M, N] = (rmsnorm(h) * norm_weight) · w^T. h [M, K], norm_weight [K], w [N, K], out [M, N] BF16 or
// F32 (the final norm fused into the lm_head writes F32 logits).
void rmsnorm_gemv(const TensorView& out, const TensorView& h, const TensorView& norm_weight, float eps,
                  const TensorView& w, cudaStream_t stream = nullptr, bool pdl = false);
void rmsnorm_gemv(const TensorView& out, const TensorView& h, const TensorView& norm_weight, float eps,
                  const TensorView& w, const TensorView& w_scale, cudaStream_t stream = nullptr, bool pdl = false,
                  Fp8GemvVariant fp8 = Fp8GemvVariant::Auto);

// act[M, I] = silu(gate) * up, [gate | up] = (rmsnorm(h) * norm_weight) · w_gate_up^T.
// h [M, K], norm_weight [K], w_gate_up [2I, K] (rows 0..I-1 gate, I..2I-1 up), act [M, I].
void rmsnorm_gemv_silu_mul(const TensorView& act, const TensorView& h, const TensorView& norm_weight,
                           float eps, const TensorView& w_gate_up, cudaStream_t stream = nullptr,
                           bool pdl = false);
// FP8: w_scale [2I] holds the gate rows' scales, then the up rows'.
void rmsnorm_gemv_silu_mul(const TensorView& act, const TensorView& h, const TensorView& norm_weight,
                           float eps, const TensorView& w_gate_up, const TensorView& w_scale,
                           cudaStream_t stream = nullptr, bool pdl = false, Fp8GemvVariant fp8 = Fp8GemvVariant::Auto);

// qkv[M, (Hq + 2 Hkv) d] = rmsnorm(h) * norm_weight · w_qkv^T with RoPE applied to its q and k heads (the first
// q_heads + k_heads heads of d = table.head_dim() columns each), rotated by row m's position positions[m] as
// apply_rope() does (the table's cos / sin, positions clamped to the table as PositionCheck::Trusted does); the
// heads after them (v's) are stored as they are. The same bits as rmsnorm_gemv() then apply_rope() on the q and
// k views (the two launches it replaces), in one kernel: each block owns pairs of rows (j, j + d/2) of a head, so
// the pair RoPE rotates is finished in one epilogue. Also on the CPU (the two references in turn). qkv: BF16,
// contiguous, a whole number of heads; positions I32 [M] on w's device.
// kv (optional, chapter section 5): also store each row's k heads (after RoPE) and v heads in a KV cache, as
// kv_store.h describes (AttentionBackend::kv_store fills it): the bytes lesson 10's kv_cache_write or lesson 12's
// paged_kv_write would store from qkv, so the backend's attend_stored() can skip its write. kv->device must be
// w's; kv_dim = (qkv's heads - q_heads - k_heads) * d = k_heads * d (as many v heads as k heads); dtype BF16 or
// F8_E4M3 on CUDA, F32 or BF16 on the CPU.
void rmsnorm_gemv_rope(const TensorView& qkv, const TensorView& h, const TensorView& norm_weight, float eps,
                       const TensorView& w, const TensorView& w_scale, const TensorView& positions,
                       const RopeTable& table, int64_t q_heads, int64_t k_heads, cudaStream_t stream = nullptr,
                       bool pdl = false, Fp8GemvVariant fp8 = Fp8GemvVariant::Auto, const KvStore* kv = nullptr);

// h[M, N] += x[M, K] · w[N, K]^T in place. h must not overlap x or w.
void gemv_residual(const TensorView& h, const TensorView& x, const TensorView& w,
                   cudaStream_t stream = nullptr, bool pdl = false);
void gemv_residual(const TensorView& h, const TensorView& x, const TensorView& w, const TensorView& w_scale,
                   cudaStream_t stream = nullptr, bool pdl = false, Fp8GemvVariant fp8 = Fp8GemvVariant::Auto);

// For benchmarks: the bytes one gemv() must move at least, W + x + out, so bytes / seconds is the bandwidth
// reached. (gemv_residual also reads h, M*N*2 more; the fused norms read g, K*2 more: W dominates all.)
int64_t gemv_bytes_moved(int64_t M, int64_t N, int64_t K, DType out_dtype);
// The same with F8_E4M3 weights: N*K codes + 4N bytes of scales + x + out.
int64_t gemv_fp8_bytes_moved(int64_t M, int64_t N, int64_t K, DType out_dtype);

// How v3 shapes a launch (exposed for the tests and the chapter): a function of N and K only, never of M.
struct GemvV3Shape {
  int threads = 0;         // per block: whole warps, at most 256, about one 16-byte pack of K per thread
  int rows_per_block = 0;  // weight rows a block owns: 4, or 1 when N is too small to give 4-row tiles
                           // enough blocks to fill the GPU
  int64_t blocks = 0;
};
// weight_bytes: 2 (BF16) or 1 (F8_E4M3 with K % 16 == 0, 16 codes per load): one thread per load of a row.
GemvV3Shape gemv_v3_shape(int64_t N, int64_t K, int weight_bytes = 2);

// Tile streaming (chapter section 4, "Streaming tiles"): v3 and every fused op launch no more blocks than the GPU
// holds at once (SMs x blocks per SM), each block computing tiles b, b + grid, ... and loading the next tile's
// weights before it reduces and stores the current one; off, one block per tile (the grid above). The same
// threads sum each output in the same order either way: the same bits. On by default; process-wide
// (use_fast_path sets it from FastPathOptions::stream_tiles; the tests switch it).
void set_gemv_tile_streaming(bool on);
bool gemv_tile_streaming();

// The references on the host (what the functions above run for CPU views). w_scale: F8_E4M3 w only.
void gemv_cpu(const TensorView& out, const TensorView& x, const TensorView& w, const TensorView& w_scale = {});
void rmsnorm_gemv_cpu(const TensorView& out, const TensorView& h, const TensorView& norm_weight, float eps,
                      const TensorView& w, const TensorView& w_scale = {});
void rmsnorm_gemv_silu_mul_cpu(const TensorView& act, const TensorView& h, const TensorView& norm_weight,
                               float eps, const TensorView& w_gate_up, const TensorView& w_scale = {});
void gemv_residual_cpu(const TensorView& h, const TensorView& x, const TensorView& w,
                       const TensorView& w_scale = {});

// Argument checks shared by both paths (InputError naming the problem). Returns {M, N, K}.
struct GemvDims {
  int64_t M = 0, N = 0, K = 0;
};
GemvDims check_gemv_args(const char* what, const TensorView& out, const TensorView& x, const TensorView& w);
// The norm's operands: h [M, K] as x, norm_weight [K]; eps finite and >= 0.
void check_norm_args(const char* what, const TensorView& h, const TensorView& norm_weight, float eps);

namespace detail {
// Fp8GemvVariant::Bits's decoding, shared by the kernel and the CPU test that checks it on all 256 codes: `lanes`
// holds two E4M3 codes, each in the HIGH byte of a 16-bit lane (code << 8: sign at bit 15, eeee mmm at 14..8);
// the result is two halves' bits, sign kept at bit 15 and eeee mmm moved to 13..7, each half 2^-8 x its code's
// value (gemv.cu says why, subnormals included).
constexpr uint32_t e4m3_lanes_to_half2_bits(uint32_t lanes) {
  return (lanes & 0x80008000u) | ((lanes >> 1) & 0x3f803f80u);
}

// The GPU paths, called after the checks.
void gemv_cuda(const TensorView& out, const TensorView& x, const TensorView& w, GemvKernel kernel,
               cudaStream_t stream);
// w_scale: empty for BF16 w; F32 [N] for F8_E4M3 w (the weight's dtype picks the kernel).
void rmsnorm_gemv_cuda(const TensorView& out, const TensorView& h, const TensorView& norm_weight, float eps,
                       const TensorView& w, const TensorView& w_scale, cudaStream_t stream, bool pdl,
                       Fp8GemvVariant fp8);
void rmsnorm_gemv_silu_mul_cuda(const TensorView& act, const TensorView& h, const TensorView& norm_weight,
                                float eps, const TensorView& w_gate_up, const TensorView& w_scale,
                                cudaStream_t stream, bool pdl, Fp8GemvVariant fp8);
void rmsnorm_gemv_rope_cuda(const TensorView& qkv, const TensorView& h, const TensorView& norm_weight, float eps,
                            const TensorView& w, const TensorView& w_scale, const TensorView& positions,
                            const RopeTable& table, int64_t q_heads, int64_t k_heads, cudaStream_t stream, bool pdl,
                            Fp8GemvVariant fp8, const KvStore* kv);
void gemv_residual_cuda(const TensorView& h, const TensorView& x, const TensorView& w, const TensorView& w_scale,
                        cudaStream_t stream, bool pdl, Fp8GemvVariant fp8);
void gemv_fp8_cuda(const TensorView& out, const TensorView& x, const TensorView& w, const TensorView& w_scale,
                   cudaStream_t stream, Fp8GemvVariant fp8);
}  // namespace detail

}  // namespace tvllm
