// Lesson 07's flash attention (v2), as templates over a KV addressing policy, so that later lessons reuse
// the kernel with their own key/value storage without editing this lesson:
//
//   lesson 07  ContiguousKV (below): k, v packed like q, [T_k, n_kv*head_dim] rows located by cu_seqlens_k
//   lesson 10  a contiguous cache [max_seqs, max_len, n_kv, head_dim] per layer, one slot per sequence
//   lesson 12  a paged cache: position p of sequence b in block block_table[b][p / block_size], slot p % block_size
//
// Include it from a .cu file (C++17) and call
//
//   flash_attention(out, q, MyKV{...}, batch, shape, stream);
//
// which checks the query side (check_attention_queries) and launches the kernel for `shape.head_dim`.
//
// ---- The KV policy contract ------------------------------------------------------------------------------
// A policy is a small trivially copyable struct (it is copied to the GPU as a kernel parameter) with
//
//   struct Sequence {                                            // one (sequence, kv head)
//     __device__ const __nv_bfloat16* key(int pos) const;        // the key vector at position pos
//     __device__ const __nv_bfloat16* value(int pos) const;      // the value vector at position pos
//   };
//   __device__ Sequence sequence(int b, int k_begin, int kv_head) const;
//
// - sequence() is called once per thread block (for its sequence b and kv head). k_begin is
//   cu_seqlens_k[b]: where sequence b's keys start when they are packed; a cache ignores it.
// - key(pos) and value(pos) return the address of that position's head_dim consecutive bf16 (the vector
//   of kv head `kv_head`), 16-byte aligned. They are called only for 0 <= pos < k_len[b], where
//   k_len[b] = cu_seqlens_k[b+1] - cu_seqlens_k[b], and they are in the hot loop (once per 16-byte
//   chunk a thread copies): keep them to a multiply-add (contiguous) or a table look-up (paged), and
//   compute everything that depends only on (b, kv_head) in sequence().
// - The queries are always the packed q/out rows of cu_seqlens_q; query i of sequence b sits at position
//   k_len[b] - q_len[b] + i and sees keys 0..that position (with a sliding window W: only the last W of
//   them, FlashParams::window). Keys no query of a block sees are never asked for.
//
// ---- The kernels ---------------------------------------------------------------------------------------
//   flash_attention_mma_kernel<DP, kPadded, KV>  tensor cores (mma.sync m16n8k16, bf16 in, fp32 out), tiles
//       DP = 64 or 128 columns wide. head_dim == DP is the fast path; a smaller head_dim (any multiple of 8)
//       runs zero-padded in the next tile width (kPadded): zero columns add nothing to q.k, and the padded
//       output columns are never stored.
//   flash_attention_simt_kernel<KV>  CUDA cores, one warp per (query, head), for 128 < head_dim <= 256: a
//       256-wide tile would need 128 fp32 accumulators per thread (register spills) and 169 KiB of shared
//       memory (more than the 99 KiB consumer GPUs allow a block).
// README.md (section 5) derives the tensor-core kernel; the comments here say why each line is as it is.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "attention.h"
#include "common/cuda_utils.cuh"  // ceil_div, warp_sum, pack_bf16x2, Pack / load_pack / store_pack
#include "common/errors.h"
#include "common/exercise.h"
#include "common/mma.cuh"         // cp.async, ldmatrix, mma.sync: the PTX wrappers lesson 06 introduces

namespace tvllm {
namespace flash {

using bf16 = __nv_bfloat16;

// The query side of a launch: the same for every policy.
struct FlashParams {
  const bf16* q;                // row 0 of q: [T_q rows, q_stride apart], head h at column h*head_dim
  bf16* out;                    // row 0 of out: same layout as q
  int64_t q_stride;             // elements between consecutive rows of q
  int64_t out_stride;           // ... of out
  const int32_t* cu_seqlens_q;  // [B+1] device
  const int32_t* cu_seqlens_k;  // [B+1] device: k_len[b] = cu_seqlens_k[b+1] - cu_seqlens_k[b]
  int head_dim;
  int group;                    // query heads per kv head
  float scale_log2;             // (1/sqrt(head_dim)) * log2(e): scores in base-2 units, exp becomes exp2
  int window = 0;               // sliding window: a query at pos sees keys pos - window < j <= pos; 0 = none
  // Tile rows per query: 1, or (decode steps, every q_len <= 1) the group size: then block (x, h, b) is KV
  // head h, and row r of its tile is query head h * group + r. The G heads that share a KV head read its
  // keys and values once instead of G times; each row's arithmetic is unchanged, so are its bits.
  int rows_per_query = 1;
  // Lesson 16's FP8 KV cache (CUDA-core kernel only): values read back as code * v_scale, applied once to the
  // normalised output (1 otherwise: the same bits); k_scale is folded into scale_log2.
  float v_scale = 1.0f;
};

// Lesson 07's policy: k and v packed along the token axis (possibly column slices of a fused QKV
// buffer), sequence b's keys at rows [cu_seqlens_k[b], cu_seqlens_k[b+1]).
struct ContiguousKV {
  const bf16* k;  // row 0, column 0 of k [T_k, >= n_kv*head_dim]
  const bf16* v;  // row 0, column 0 of v
  int k_stride;   // elements between consecutive rows of k
  int v_stride;
  int head_dim;

  struct Sequence {
    const bf16* k;  // key 0 of this sequence, this kv head
    const bf16* v;
    int k_stride, v_stride;
    __device__ __forceinline__ const bf16* key(int pos) const { return k + static_cast<int64_t>(pos) * k_stride; }
    __device__ __forceinline__ const bf16* value(int pos) const { return v + static_cast<int64_t>(pos) * v_stride; }
  };
  __device__ __forceinline__ Sequence sequence(int /*b*/, int k_begin, int kv_head) const {
    const int64_t head = static_cast<int64_t>(kv_head) * head_dim;
    return {k + static_cast<int64_t>(k_begin) * k_stride + head, v + static_cast<int64_t>(k_begin) * v_stride + head,
            k_stride, v_stride};
  }
};

// ---- the tensor-core kernel -------------------------------------------------------------------------------

inline constexpr int kBr = 64;  // queries per block: 4 warps x 16 rows (one mma row block each)
inline constexpr int kBc = 64;  // keys per K/V tile
inline constexpr int kWarps = 4;
inline constexpr int kThreads = kWarps * 32;
static_assert(kBr == kWarps * 16, "each warp owns 16 query rows");

// Shared-memory rows are padded by 8 bf16 (16 bytes): with 128-byte rows, the 8 row addresses of one
// ldmatrix would all hit the same 4 banks (8-way conflict); 144-byte rows spread them over all 32.
template <int DP>
constexpr int smem_stride() { return DP + 8; }
// Q tile + double-buffered K and V tiles: 45 KiB for DP = 64, 85 KiB for DP = 128.
template <int DP>
constexpr size_t mma_smem_bytes() {
  return static_cast<size_t>(kBr + 2 * kBc + 2 * kBc) * smem_stride<DP>() * sizeof(bf16);
}
// 99 KiB is what consumer GPUs (sm_86, sm_89, sm_120) let one block opt in to; A100 and H100/H200 allow more.
static_assert(mma_smem_bytes<128>() <= 99 * 1024, "the widest tile must fit every sm_80+ GPU");

// Starts copying ROWS rows of one head into tile[ROWS][DP + 8]: row r from row_address(r) (the head's
// first element). Rows r >= rows_valid and, when kPadded, columns >= head_dim are zero-filled, reading
// nothing (`fallback` is any valid address, for the instruction's operand). Zeros, not garbage: a V row
// past the end must be 0 or 0 * NaN would poison P V; a padded column adds 0 to q.k.
template <int DP, int ROWS, bool kPadded, class RowAddress>
__device__ __forceinline__ void load_tile_async(bf16* tile, const RowAddress& row_address, int rows_valid, int head_dim,
                                                const bf16* fallback, int tid) {
  constexpr int kChunksPerRow = DP / 8;  // 16-byte chunks of 8 bf16
  constexpr int kChunks = ROWS * kChunksPerRow;
  static_assert(kChunks % kThreads == 0, "every thread copies the same number of chunks");
#pragma unroll
  for (int i = 0; i < kChunks / kThreads; ++i) {
    const int c = i * kThreads + tid;  // consecutive threads: consecutive 16 bytes of a row (coalesced)
    const int r = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
    const bool valid = r < rows_valid && (!kPadded || col < head_dim);
    const bf16* from = valid ? row_address(r) + col : fallback;
    cp_async_16(tile + r * smem_stride<DP>() + col, from, valid);
  }
}

// grid: (query tiles of the longest q_len, n_heads, batch). Block (x, h, b) computes the outputs of queries
// [q0, q0 + 64) of sequence b, head h. Warp w owns query rows [16w, 16w + 16) of the tile. (A decode step
// with p.rows_per_query = G: grid (1, n_kv_heads, batch), the rows are the G query heads of KV head h.)
// __launch_bounds__: for DP = 64, ask for 4 blocks per SM (128 registers per thread, a small spill)
// rather than the 136 registers the compiler would pick (3 blocks): measured ~13% faster at 8k tokens.
// DP = 128 needs ~245 registers and 85 KiB of shared memory: 2 blocks per SM either way.
template <int DP, bool kPadded, class KV>
__global__ void __launch_bounds__(kThreads, (DP <= 64 ? 4 : 2))
    flash_attention_mma_kernel(const FlashParams p, const KV kv) {
  // --- exercise 07.3: v2, flash attention on the tensor cores ------------------------------------------
  // Task: block (x, h, b) computes the outputs of 64 queries of sequence b, head h (the last query
  //   tiles first: q_tile = gridDim.x - 1 - blockIdx.x); warp w owns query rows [16w, 16w + 16). Load
  //   the Q tile into shared memory, then stream the visible 64-key tiles of K and V through a double
  //   buffer (cp.async), and per tile: S = Q K^T * scale with mma.sync, the causal mask on the last
  //   tiles, the online softmax (running max m and sum l per row; rescale the output accumulators
  //   when m grows), P rounded to bf16, O += P V with mma.sync. At the end O / l, stored as bf16 through
  //   shared memory. kv.sequence(b, k_begin, kv_head) gives the sequence's key(pos) / value(pos) rows
  //   (the KV policy, README section 8); p.scale_log2 folds log2(e) in, so exp becomes exp2.
  //   With R = p.rows_per_query, global row i = q0 + r of the tile is query i / R of head h * R + i % R
  //   (R = 1: query i of head h), at position k_len - q_len + i / R. With a sliding window
  //   (p.window > 0) a row at pos sees only keys pos - window < key <= pos: skip the tiles before the
  //   first row's window, and mask the window's lower edge like the causal one.
  // Hint: README sections 4-6 derive the online softmax, this kernel's tiling and the masking; lesson 06's v4
  //   has the fragment layouts (g = lane / 4, c = lane % 4) and ldmatrix addressing.
  // Hint: padded head dims (kPadded): columns past p.head_dim load as zeros and are never stored.
  // Tests: Attention07Gpu.V2MatchesCpu Attention07Gpu.MatchesCpuTinyShapes Attention07Gpu.Matches1BShapes
  // Tests: Attention07Gpu.EveryHeadDim Attention07Gpu.ChunkedPrefill Attention07Gpu.DecodeSteps
  // Tests: Attention07Gpu.GqaGroups Attention07Gpu.LargeScoresStressTheMaxSubtraction
  // Tests: Attention07Gpu.FusedQkvBuffer Attention07Gpu.RunsOnACreatedStream lesson07_attention.gpu
  // Tests: Attention07Gpu.DecodeRowsAreTheSameBitsPackedOrNot
  // Needs: 07.1 07.2
  // Stub: device
  // --- solution ---
  constexpr int Br = kBr, Bc = kBc, S = smem_stride<DP>();
  constexpr int kDimChunks = DP / 16;  // k-steps of Q K^T (16 dims each)
  constexpr int kKeyTiles = Bc / 8;    // 8-key column tiles of the warp's score block [16, Bc]
  constexpr int kOutTiles = DP / 8;    // 8-dim column tiles of the warp's output block [16, DP]
  static_assert(DP % 16 == 0, "the tile width must be a multiple of 16 for the mma tiles");
  const int D = kPadded ? p.head_dim : DP;  // the real head_dim: a compile-time constant on the fast path

  extern __shared__ __align__(16) unsigned char flash_smem[];  // (a name no includer's kernel will reuse)
  bf16* sQ = reinterpret_cast<bf16*>(flash_smem);  // [Br][S]     (reused for the output tile at the end)
  bf16* sK = sQ + Br * S;                     // [2][Bc][S]  double buffer
  bf16* sV = sK + 2 * Bc * S;                 // [2][Bc][S]

  const int b = blockIdx.z, h = blockIdx.y;
  // The last query tiles see the most keys: start them first so that no long block runs alone at the end.
  const int q_tile = static_cast<int>(gridDim.x) - 1 - static_cast<int>(blockIdx.x);
  const int q_begin = p.cu_seqlens_q[b];
  const int q_len = p.cu_seqlens_q[b + 1] - q_begin;
  const int R = p.rows_per_query;  // 1, or the group size in a packed decode step
  const int q_rows = q_len * R;    // rows of this sequence
  const int q0 = q_tile * Br;
  if (q0 >= q_rows) return;  // this sequence has fewer rows than the longest one; same for the whole block
  const int k_begin = p.cu_seqlens_k[b];
  const int k_len = p.cu_seqlens_k[b + 1] - k_begin;
  // The queries are the last q_len of the k_len tokens: the tile's first row sits at position first_pos, and
  // row r at first_pos + r (R = 1; a packed decode tile's rows all at k_len - 1). A row sees keys up to its
  // position (bottom-right aligned causal mask; 0 for prefill).
  const int first_pos = k_len - q_len + q0 / R;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, c = lane % 4;  // mma fragment coordinates (see mma_bf16_16x8x16)
  // Global row i of the sequence: query i / R of head h * R + i % R (R = 1: query i of head h).
  const auto row_offset = [&](int i, int64_t stride) {
    return static_cast<int64_t>(i / R) * stride + static_cast<int64_t>(h * R + i % R) * D;
  };
  const bf16* q_seq = p.q + static_cast<int64_t>(q_begin) * p.q_stride;
  const auto seq = kv.sequence(b, k_begin, h * R / p.group);  // grouped-query attention: the rows' kv head

  // Causal: keys after the tile's last query are never needed. Tiles above the diagonal are skipped
  // entirely, not computed and masked.
  const int kv_end = min(k_len, first_pos + Br);
  const int num_kv_tiles = (kv_end + Bc - 1) / Bc;
  // Sliding window: the tile's first row sees keys from first_pos - window + 1 on, and every later row from
  // there or later: the tiles wholly before that are skipped too (a long prefill reads ~W keys per query, not
  // all of them). last_pos is the tile's last row's position (a padding row past q_len may be counted: it
  // only makes the mask below run on one more tile).
  const int t_begin = p.window > 0 ? max(0, first_pos - p.window + 1) / Bc : 0;
  const int last_pos = k_len - q_len + (q0 + Br - 1) / R;

  load_tile_async<DP, Br, kPadded>(
      sQ, [&](int r) { return q_seq + row_offset(q0 + r, p.q_stride); }, q_rows - q0, D, q_seq, tid);
  // (k_len >= q_len > 0 here, so key 0 exists: its address is the operand of the zero-filling copies.)
  const int kb = t_begin * Bc;  // the first tile's first key (0 without a window)
  load_tile_async<DP, Bc, kPadded>(sK, [&](int r) { return seq.key(kb + r); }, k_len - kb, D, seq.key(0), tid);
  load_tile_async<DP, Bc, kPadded>(sV, [&](int r) { return seq.value(kb + r); }, k_len - kb, D, seq.value(0), tid);
  cp_async_commit();

  uint32_t q_frag[kDimChunks][4];  // the warp's 16 query rows, as mma A fragments, for the whole loop
  float o_acc[kOutTiles][4];       // unnormalised output rows, fp32
#pragma unroll
  for (int j = 0; j < kOutTiles; ++j) o_acc[j][0] = o_acc[j][1] = o_acc[j][2] = o_acc[j][3] = 0.f;
  // This thread's two rows (g and g+8 of the warp's 16): running max (base-2 units) and partial sum.
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};
  // The positions of this thread's two rows, g and g + 8 of the warp's 16.
  const int row_pos[2] = {k_len - q_len + (q0 + warp * 16 + g) / R, k_len - q_len + (q0 + warp * 16 + g + 8) / R};

  for (int t = t_begin; t < num_kv_tiles; ++t) {
    const int buf = (t - t_begin) & 1;  // the first tile went to buffer 0
    const bf16* sKt = sK + buf * Bc * S;
    const bf16* sVt = sV + buf * Bc * S;
    const int k0 = t * Bc;
    // Prefetch tile t+1 into the other buffer while we compute on tile t. That buffer was last read in
    // iteration t-1, which ended with a barrier.
    if (t + 1 < num_kv_tiles) {
      const int k1 = k0 + Bc;
      load_tile_async<DP, Bc, kPadded>(
          sK + (buf ^ 1) * Bc * S, [&](int r) { return seq.key(k1 + r); }, k_len - k1, D, seq.key(0), tid);
      load_tile_async<DP, Bc, kPadded>(
          sV + (buf ^ 1) * Bc * S, [&](int r) { return seq.value(k1 + r); }, k_len - k1, D, seq.value(0), tid);
      cp_async_commit();
      cp_async_wait<1>();  // everything but the prefetch has landed (this thread's copies)...
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // ...and every other thread's too

    if (t == t_begin) {
      // A fragment of rows [16w, 16w+16), dims [16kc, 16kc+16): lanes 0-15 address rows 0-15 at dim
      // 16kc, lanes 16-31 the same rows at dim 16kc+8 -> matrices (rows 0-7, lo), (8-15, lo), (0-7, hi), (8-15, hi).
#pragma unroll
      for (int kc = 0; kc < kDimChunks; ++kc)
        ldmatrix_x4(q_frag[kc], sQ + (warp * 16 + (lane % 16)) * S + kc * 16 + (lane / 16) * 8);
    }

    // ---- scores: s[16 x Bc] = Q_w K_t^T -------------------------------------------------------------
    // B = K^T in "col" layout is K row-major (key rows, dims contiguous): no transpose. One ldmatrix.x4
    // gives the b0/b1 fragments of two 8-key tiles: matrices (keys 0-7, dims lo), (keys 0-7, dims hi),
    // (keys 8-15, dims lo), (keys 8-15, dims hi).
    float s[kKeyTiles][4];
#pragma unroll
    for (int j = 0; j < kKeyTiles; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int kc = 0; kc < kDimChunks; ++kc) {
#pragma unroll
      for (int kp = 0; kp < Bc / 16; ++kp) {
        uint32_t kb[4];
        ldmatrix_x4(kb, sKt + (kp * 16 + (lane % 8) + (lane / 16) * 8) * S + kc * 16 + ((lane / 8) % 2) * 8);
        mma_bf16_16x8x16(s[2 * kp], q_frag[kc], kb[0], kb[1]);
        mma_bf16_16x8x16(s[2 * kp + 1], q_frag[kc], kb[2], kb[3]);
      }
    }

    // ---- scale and mask -----------------------------------------------------------------------------
    // Element s[j][e] is query row (16w + g + 8*(e/2)) of the tile, at position row_pos[e/2], and
    // key k0 + 8j + 2c + e%2. Only a tile holding a key past the tile's first query position needs the
    // mask. `key > pos` also masks every key past the end (key >= k_len > pos) for each real query row;
    // rows past q_len (zero-filled queries) compute harmless values of their own that are never stored
    // (an mma row depends on its own row of Q only). A sliding window masks `key <= pos - window` as well,
    // on the tiles that hold a key at or before the last row's window edge. A row may see no key of a tile
    // (it lies wholly before that row's window): its scores are all -inf, which the guards below absorb.
    const bool needs_mask = k0 + Bc - 1 > first_pos || (p.window > 0 && k0 <= last_pos - p.window);
#pragma unroll
    for (int j = 0; j < kKeyTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[j][e] *= p.scale_log2;
        if (needs_mask) {
          const int key = k0 + j * 8 + 2 * c + (e & 1);
          const int pos = row_pos[e >> 1];
          if (key > pos || (p.window > 0 && key <= pos - p.window)) s[j][e] = -INFINITY;
        }
      }
    }

    // ---- online softmax -----------------------------------------------------------------------------
    // New max over the old max and this tile; the old sum and output were relative to the old max, so
    // they shrink by alpha = 2^(m_old - m_new). Guards: a row that has seen only masked keys keeps
    // m = -inf; we then subtract 0 instead (m_ref), so every exponent is -inf - finite = -inf -> 0,
    // and -inf - -inf (NaN) is never formed.
    float alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float tile_max = -INFINITY;
#pragma unroll
      for (int j = 0; j < kKeyTiles; ++j) tile_max = fmaxf(tile_max, fmaxf(s[j][2 * r], s[j][2 * r + 1]));
      // the 4 threads of a quad (same g) hold the row's other columns
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
      const float m_new = fmaxf(row_max[r], tile_max);
      const float m_ref = m_new == -INFINITY ? 0.f : m_new;
      alpha[r] = exp2f(row_max[r] - m_ref);  // first tile: exp2(-inf) = 0
      row_max[r] = m_new;
      float tile_sum = 0.f;
#pragma unroll
      for (int j = 0; j < kKeyTiles; ++j) {
        s[j][2 * r] = exp2f(s[j][2 * r] - m_ref);  // masked: exp2(-inf) = 0
        s[j][2 * r + 1] = exp2f(s[j][2 * r + 1] - m_ref);
        tile_sum += s[j][2 * r] + s[j][2 * r + 1];
      }
      row_sum[r] = row_sum[r] * alpha[r] + tile_sum;  // this thread's columns only; the quad adds up at the end
    }
#pragma unroll
    for (int j = 0; j < kOutTiles; ++j) {
      o_acc[j][0] *= alpha[0];
      o_acc[j][1] *= alpha[0];
      o_acc[j][2] *= alpha[1];
      o_acc[j][3] *= alpha[1];
    }

    // ---- o += P V -----------------------------------------------------------------------------------
    // The accumulator layout of two adjacent 8-key tiles IS the A fragment layout of one 16-key step,
    // so P goes from registers to the tensor cores without touching shared memory. V [keys, dims] is
    // B in "col" layout only after a transpose: ldmatrix .trans does it on the way. Matrices:
    // (keys 0-7, dims lo), (keys 8-15, dims lo), (keys 0-7, dims hi), (keys 8-15, dims hi).
#pragma unroll
    for (int kk = 0; kk < Bc / 16; ++kk) {
      uint32_t p_frag[4];
      p_frag[0] = pack_bf16x2(s[2 * kk][0], s[2 * kk][1]);
      p_frag[1] = pack_bf16x2(s[2 * kk][2], s[2 * kk][3]);
      p_frag[2] = pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      p_frag[3] = pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
      for (int dp = 0; dp < DP / 16; ++dp) {
        uint32_t vb[4];
        ldmatrix_x4_trans(vb, sVt + (kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8) * S + dp * 16 + (lane / 16) * 8);
        mma_bf16_16x8x16(o_acc[2 * dp], p_frag, vb[0], vb[1]);
        mma_bf16_16x8x16(o_acc[2 * dp + 1], p_frag, vb[2], vb[3]);
      }
    }
    __syncthreads();  // all warps are done with buffer `buf` before iteration t+1 prefetches into it
  }

  // ---- epilogue: out = o / sum, through shared memory for 16-byte stores ------------------------------
  float inv_sum[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
    inv_sum[r] = row_sum[r] > 0.f ? 1.f / row_sum[r] : 0.f;  // a row with no key at all writes 0
  }
  // Each warp writes only its own 16 rows of the (no longer needed) Q tile, so a warp barrier suffices.
  bf16* sO = sQ;
#pragma unroll
  for (int j = 0; j < kOutTiles; ++j) {
    const int col = j * 8 + 2 * c;
    *reinterpret_cast<__nv_bfloat162*>(sO + (warp * 16 + g) * S + col) =
        __floats2bfloat162_rn(o_acc[j][0] * inv_sum[0], o_acc[j][1] * inv_sum[0]);
    *reinterpret_cast<__nv_bfloat162*>(sO + (warp * 16 + g + 8) * S + col) =
        __floats2bfloat162_rn(o_acc[j][2] * inv_sum[1], o_acc[j][3] * inv_sum[1]);
  }
  __syncwarp();
  constexpr int kChunksPerRow = DP / 8;
  static_assert((16 * kChunksPerRow) % 32 == 0, "a warp stores its 16 rows in whole rounds");
  bf16* out_seq = p.out + static_cast<int64_t>(q_begin) * p.out_stride;
#pragma unroll
  for (int i = 0; i < 16 * kChunksPerRow / 32; ++i) {
    const int chunk = i * 32 + lane;
    const int row = warp * 16 + chunk / kChunksPerRow, col = (chunk % kChunksPerRow) * 8;
    const int global_row = q0 + row;
    if (global_row < q_rows && (!kPadded || col < D)) {  // padded columns hold zeros: never stored
      *reinterpret_cast<uint4*>(out_seq + row_offset(global_row, p.out_stride) + col) =
          *reinterpret_cast<const uint4*>(sO + row * S + col);
    }
  }
  // --- end of exercise 07.3 ---
}

// ---- the CUDA-core kernel (head_dim 136..256) -------------------------------------------------------------

inline constexpr int kSimtWarps = 4;  // queries per block

// One warp per (query, head): lane L owns dims [8L, 8L + 8) (16-byte loads; head_dim <= 256 = 32 x 8), so
// a score is 8 fused multiply-adds per lane and a warp_sum. Keys are taken one at a time with the online
// softmax of README.md section 4, in fp32 throughout (P is not rounded to bf16, unlike the mma kernel).
// grid: (ceil(max q_len / 4), n_heads, batch).
template <class KV>
__global__ void __launch_bounds__(kSimtWarps * 32) flash_attention_simt_kernel(const FlashParams p, const KV kv) {
  const int b = blockIdx.z, h = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int q_begin = p.cu_seqlens_q[b];
  const int q_len = p.cu_seqlens_q[b + 1] - q_begin;
  // The last queries see the most keys: start them first.
  const int i = (static_cast<int>(gridDim.x) - 1 - static_cast<int>(blockIdx.x)) * kSimtWarps + warp;
  if (i >= q_len) return;  // the whole warp leaves together (warp_sum below needs all 32 lanes)
  const int k_begin = p.cu_seqlens_k[b];
  const int k_len = p.cu_seqlens_k[b + 1] - k_begin;
  const int pos = k_len - q_len + i;  // this query's position: it sees keys first..pos
  const int first = p.window > 0 ? max(0, pos - p.window + 1) : 0;  // 0, or the sliding window's oldest key
  const bool active = lane * 8 < p.head_dim;
  const int col = active ? lane * 8 : 0;
  const auto seq = kv.sequence(b, k_begin, h / p.group);

  float qs[8];  // q * scale * log2(e): the score comes out in base-2 units
  {
    Pack<8> qp{};
    const int64_t head = static_cast<int64_t>(h) * p.head_dim + col;
    if (active) qp = load_pack<8>(p.q + static_cast<int64_t>(q_begin + i) * p.q_stride + head);
#pragma unroll
    for (int e = 0; e < 8; ++e) qs[e] = qp.get(e) * p.scale_log2;
  }
  float o[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  float m = -INFINITY, l = 0.f;
  for (int j = first; j <= pos; ++j) {
    float dot = 0.f;
    Pack<8> vp{};
    if (active) {
      const Pack<8> kp = load_pack<8>(seq.key(j) + col);
      vp = load_pack<8>(seq.value(j) + col);  // issued before the reduction: its latency hides behind it
#pragma unroll
      for (int e = 0; e < 8; ++e) dot += qs[e] * kp.get(e);
    }
    const float s = warp_sum(dot);  // every lane gets the same score
    const float m_new = fmaxf(m, s);
    const float m_ref = m_new == -INFINITY ? 0.f : m_new;  // never -inf - -inf (see the mma kernel)
    const float alpha = exp2f(m - m_ref), w = exp2f(s - m_ref);
    l = l * alpha + w;
#pragma unroll
    for (int e = 0; e < 8; ++e) o[e] = o[e] * alpha + w * vp.get(e);
    m = m_new;
  }
  if (active) {
    const float inv = l > 0.f ? 1.f / l : 0.f;
    Pack<8> op;
#pragma unroll
    for (int e = 0; e < 8; ++e) op.set(e, o[e] * inv * p.v_scale);
    const int64_t head = static_cast<int64_t>(h) * p.head_dim + col;
    store_pack<8>(p.out + static_cast<int64_t>(q_begin + i) * p.out_stride + head, op);
  }
}

// ---- launchers ----------------------------------------------------------------------------------------

template <int DP, bool kPadded, class KV>
void launch_mma(const FlashParams& p, const KV& kv, int n_heads, int batch_size, int max_q_len, cudaStream_t stream) {
  require_tensor_core_device("attention v2 (flash)");  // mma.sync, ldmatrix, cp.async: sm_80 or later
  constexpr size_t smem = mma_smem_bytes<DP>();
  // Above 48 KiB a block must opt in to more dynamic shared memory (DP = 128: 85 KiB). Once per kernel
  // (not a stream operation: allowed while a graph is being captured).
  static const bool opted_in = [] {
    TVLLM_CUDA_CHECK(cudaFuncSetAttribute(flash_attention_mma_kernel<DP, kPadded, KV>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    return true;
  }();
  (void)opted_in;
  const dim3 grid(static_cast<unsigned>(ceil_div(max_q_len, kBr)), static_cast<unsigned>(n_heads),
                  static_cast<unsigned>(batch_size));
  flash_attention_mma_kernel<DP, kPadded, KV><<<grid, kThreads, smem, stream>>>(p, kv);
  TVLLM_CHECK_LAUNCH();
}

template <class KV>
void launch_simt(const FlashParams& p, const KV& kv, int n_heads, int batch_size, int max_q_len, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(ceil_div(max_q_len, kSimtWarps)), static_cast<unsigned>(n_heads),
                  static_cast<unsigned>(batch_size));
  flash_attention_simt_kernel<KV><<<grid, kSimtWarps * 32, 0, stream>>>(p, kv);
  TVLLM_CHECK_LAUNCH();
}

// Which kernel runs a head_dim (flash_path() in attention.h prints it).
enum class Path { Mma64, Mma128, Mma64Padded, Mma128Padded, Simt, Unsupported };
inline Path path_for(int64_t head_dim) {
  if (head_dim < 8 || head_dim > 256 || head_dim % 8 != 0) return Path::Unsupported;
  if (head_dim == 64) return Path::Mma64;
  if (head_dim == 128) return Path::Mma128;
  if (head_dim < 64) return Path::Mma64Padded;
  if (head_dim < 128) return Path::Mma128Padded;
  return Path::Simt;
}

// Whether a policy's rows are bf16 (the tensor-core kernel copies them to shared memory as they are) or another
// element (lesson 16's FP8 KV: `using element = __nv_fp8_e4m3;` in the policy), which only the CUDA-core kernel
// reads: its load_pack<8> converts 8 codes to bf16 exactly (common/cuda_utils.cuh).
template <class KV, class = void>
struct kv_rows_are_bf16 : std::true_type {};
template <class KV>
struct kv_rows_are_bf16<KV, std::void_t<typename KV::element>>
    : std::bool_constant<std::is_same_v<typename KV::element, __nv_bfloat16>> {};

// Launches the kernel for p.head_dim on `stream` (grid: max_q_len queries of batch_size sequences), bf16 rows.
template <class KV>
void launch_bf16_rows(FlashParams p, const KV& kv, int n_heads, int batch_size, int max_q_len, cudaStream_t stream) {
  // A decode step (one query per sequence) with grouped-query attention on the tensor cores: a tile of one
  // query would be 63 rows of padding, and each of the G heads sharing a KV head would stream the same keys
  // and values. Instead one block takes the G heads as the rows of its tile (FlashParams::rows_per_query):
  // G times fewer blocks and bytes, the same arithmetic per row, so the same bits (a test checks it).
  const Path path = path_for(p.head_dim);
  if (max_q_len == 1 && p.group > 1 && p.group <= kBr && path != Path::Simt && path != Path::Unsupported) {
    p.rows_per_query = p.group;
    n_heads /= p.group;
    max_q_len = p.group;
  }
  // head_dim is a run-time value; the mma kernel wants its tile width at compile time (register arrays,
  // unrolled loops): one instantiation per tile width.
  switch (path) {
    case Path::Mma64: launch_mma<64, false>(p, kv, n_heads, batch_size, max_q_len, stream); break;
    case Path::Mma128: launch_mma<128, false>(p, kv, n_heads, batch_size, max_q_len, stream); break;
    case Path::Mma64Padded: launch_mma<64, true>(p, kv, n_heads, batch_size, max_q_len, stream); break;
    case Path::Mma128Padded: launch_mma<128, true>(p, kv, n_heads, batch_size, max_q_len, stream); break;
    case Path::Simt: launch_simt(p, kv, n_heads, batch_size, max_q_len, stream); break;
    case Path::Unsupported:
      throw InputError("attention v2 (flash) takes a head_dim that is a multiple of 8 from 8 to 256, got " +
                       std::to_string(p.head_dim));
  }
}

// Launches the kernel for p.head_dim on `stream` (grid: max_q_len queries of batch_size sequences).
template <class KV>
void launch(FlashParams p, const KV& kv, int n_heads, int batch_size, int max_q_len, cudaStream_t stream) {
  if (batch_size == 0 || max_q_len == 0) return;  // no query anywhere
  if constexpr (kv_rows_are_bf16<KV>::value) {
    launch_bf16_rows(p, kv, n_heads, batch_size, max_q_len, stream);
  } else {
    if (path_for(p.head_dim) == Path::Unsupported) {
      throw InputError("attention v2 (flash) takes a head_dim that is a multiple of 8 from 8 to 256, got " +
                       std::to_string(p.head_dim));
    }
    launch_simt(p, kv, n_heads, batch_size, max_q_len, stream);  // one warp per (query, head): slower, any head_dim
  }
}

// The query side of a launch, from checked views.
inline FlashParams make_params(const TensorView& out, const TensorView& q, const AttentionBatch& batch,
                               const AttentionShape& shape) {
  FlashParams p;
  p.q = q.ptr<const bf16>();
  p.out = out.ptr<bf16>();
  p.q_stride = q.strides[0];
  p.out_stride = out.strides[0];
  p.cu_seqlens_q = batch.cu_seqlens_q_device();
  p.cu_seqlens_k = batch.cu_seqlens_k_device();
  p.head_dim = static_cast<int>(shape.head_dim);
  p.group = static_cast<int>(shape.group_size());
  p.scale_log2 = static_cast<float>(shape.scale() * 1.4426950408889634);  // log2(e)
  p.window = static_cast<int>(shape.window);  // validate() keeps it below 2^31
  return p;
}

}  // namespace flash

// Flash attention with keys and values reached through `kv` (a policy, see the contract at the top).
// out, q: BF16 CUDA views [batch.total_q(), n_heads*head_dim], rows 16-byte aligned. Checks the query side
// (InputError); the policy's own storage is the caller's to check. Runs on `stream`; returns at once.
template <class KV>
void flash_attention(const TensorView& out, const TensorView& q, const KV& kv, const AttentionBatch& batch,
                     const AttentionShape& shape, cudaStream_t stream = nullptr) {
  check_attention_queries(out, q, batch, shape);
  TVLLM_REQUIRE(q.device == Device::CUDA, "flash_attention: q must be on cuda");
  flash::launch(flash::make_params(out, q, batch, shape), kv, static_cast<int>(shape.n_heads), batch.batch_size(),
                batch.max_q_len(), stream);
}

}  // namespace tvllm
