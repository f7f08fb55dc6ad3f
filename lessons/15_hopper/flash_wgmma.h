// Lesson 15, step 5: prefill attention on wgmma + TMA, FlashAttention-3's ideas written out small.
// README.md, "Step 5: flash attention on wgmma"; the kernel is flash_wgmma.cu.
//
// The same computation as lesson 07's attention() (attention.h states it: causal, bottom-right aligned for
// q_len < k_len, grouped-query heads, packed variable-length sequences through AttentionBatch's cu_seqlens,
// an optional sliding window), for head_dim 64 and 128 on an H100/H200. Other head dims are refused here;
// the engine keeps lesson 07's kernels for them (attention_hopper() below chooses).
//
// One block: 128 or 192 query rows of one (sequence, head), one warpgroup per 64 rows plus a producer:
//   producer    one thread issues TMA loads: Q once, then K and V tiles of 128 keys into a ring of stages;
//   consumers   2 or 3 warpgroups, 64 query rows each: S = Q K^T (wgmma), the online softmax in registers
//               on the accumulator layout, P rounded to bf16 in registers, O += P V (wgmma, P from
//               registers). FlashConfig picks the variant (rows per block, overlap, schedule, grid order).
//
// Everything host-side that needs no GPU (which tiles a block visits, which keys a row sees, the argument
// checks) is here, so the CPU tests check it. C++17 (the .cu includes it).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "attention.h"
#include "common/tensor.h"
#include "hopper_layout.h"  // TVLLM_HOST_DEVICE

namespace tvllm {

// ---- the tiling -------------------------------------------------------------------------------------------
// A block owns block_m query rows (one consumer warpgroup per 64 rows: 128 = 2 consumers, 192 = 3) of one
// (sequence, head) and walks K/V tiles of kFlashBlockN keys. FlashConfig (below) picks block_m.
inline constexpr int kFlashBlockM = 128;  // the default block_m (2 consumer warpgroups x 64 rows)
inline constexpr int kFlashBlockN = 128;  // keys per K/V tile: S is one m64n128 accumulator per warpgroup
// Stages of the K/V ring: a stage holds a K tile and a V tile (128 keys x head_dim bf16 each: 32 KB for
// head_dim 64, 64 KB for 128). With the Q tile (block_m x head_dim bf16: 16 / 32 KB at 128 rows, 24 / 48 KB
// at 192) that is 144 / 160 KB of shared memory at 128 rows, 152 / 176 KB at 192. 64-row blocks (one
// consumer) run two per SM: 2 stages, 8 + 64 KB at head_dim 64.
TVLLM_HOST_DEVICE constexpr int flash_wgmma_stages(int head_dim, int block_m = 128) {
  return block_m == 64 ? 2 : head_dim == 64 ? 4 : 2;
}
// Bytes of dynamic shared memory a block asks for: Q, the ring, P's tiles when P goes through shared memory
// (FlashConfig::p_smem: 64 x 128 bf16 = 16 KB per consumer), and 1 KB to align to the swizzle's period.
TVLLM_HOST_DEVICE constexpr int flash_smem_bytes(int head_dim, int block_m, bool p_smem = false) {
  return 2 * head_dim * (block_m + 2 * kFlashBlockN * flash_wgmma_stages(head_dim, block_m)) +
         (p_smem ? 2 * block_m * kFlashBlockN : 0) + 1024;
}

// The K/V tiles [first, end) a block visits: the block's rows are queries q0 .. q0 + block_m - 1 of a
// sequence with q_len queries and k_len keys (rows past q_len may be among them: they are computed and
// never stored). Query i sits at position k_len - q_len + i and sees keys pos - window < key <= pos (window
// 0: every key up to pos). Tiles wholly after the last row's position (causal) or wholly before the first
// row's window are skipped: never loaded, never computed. q0 < q_len, q_len <= k_len.
struct FlashTileRange {
  int first, end;
};
TVLLM_HOST_DEVICE constexpr FlashTileRange flash_kv_tiles(int q_len, int k_len, int q0, int window,
                                                          int block_m = kFlashBlockM) {
  const int first_pos = k_len - q_len + q0;
  const int last_pos = first_pos + block_m - 1;
  const int last_key = last_pos < k_len - 1 ? last_pos : k_len - 1;  // rows past q_len see no more keys
  const int oldest = window > 0 && first_pos - window + 1 > 0 ? first_pos - window + 1 : 0;
  return {oldest / kFlashBlockN, last_key / kFlashBlockN + 1};
}

// Whether the row at position pos sees key `key`.
TVLLM_HOST_DEVICE constexpr bool flash_key_visible(int key, int pos, int window) {
  return key <= pos && (window == 0 || key > pos - window);
}

// Whether a tile starting at key k0 needs the mask for rows at positions first_pos .. last_pos (a
// warpgroup's 64 rows): it holds a key past the first row's position (the causal diagonal, and keys past
// k_len), or one at or before the last row's window edge. Elsewhere every key of the tile is visible to
// every row and the mask is skipped.
TVLLM_HOST_DEVICE constexpr bool flash_tile_needs_mask(int k0, int first_pos, int last_pos, int window) {
  return k0 + kFlashBlockN - 1 > first_pos || (window > 0 && k0 <= last_pos - window);
}

// ---- the API ----------------------------------------------------------------------------------------------
// How the consumer warpgroups share the tensor cores.
//   Plain     each issues its wgmma groups when it is ready; the warp schedulers interleave them as they may.
//   PingPong  they take strict turns at issuing (named barriers pass a token round the consumers): one
//             warpgroup's softmax runs while another's GEMMs occupy the tensor cores (FlashAttention-3's
//             "ping-pong").
// Both compute the same thing in the same order per row: the same bits (a GPU test checks it).
enum class FlashSchedule { Plain, PingPong };
const char* flash_schedule_name(FlashSchedule schedule);

// The order in which the grid hands out blocks (the hardware starts them roughly in blockIdx order).
//   TilesInner  blockIdx.x = query tile (last first), y = head: one head's tiles, then the next head's.
//   HeadsInner  blockIdx.x = head, y = query tile (last first): the first wave is the longest causal rows of
//               every head (the short ones fill the tail), and the heads of one KV group run side by side,
//               reading the same K/V tiles through L2.
enum class FlashOrder { TilesInner, HeadsInner };

// One variant of the kernel (README.md, "Step 6: making it fast"). Every listed combination is compiled
// (flash_wgmma_has_config says which); the sweep (lesson15_hopper --sweep) times each.
//   block_m   query rows per block: 128 (2 consumer warpgroups), 192 (3), or 64 (1, and two blocks per SM:
//             their softmax and GEMMs interleave, and one's prologue and epilogue hide behind the other)
//   overlap   intra-warpgroup overlap: S = Q K^T of tile j+1 is issued, with P V of tile j, BEFORE the
//             softmax of tile j+1, so the tensor cores work while this warpgroup does its exponentials
//   schedule  plain or ping-pong (above)
//   order     the grid's order (above)
//   p_smem    (with overlap) P goes to shared memory and P V reads both operands from there: P's 32
//             registers are not alive beside S and O, so the overlap fits where it would spill
struct FlashConfig {
  const char* name;
  int block_m;
  bool overlap;
  FlashSchedule schedule;
  FlashOrder order;
  bool p_smem = false;
};

// The variants, per head_dim. The first two are the kernel as first measured on the H200 (the baseline of
// issue 19); the others add one idea at a time. Change the tables, and flash_wgmma.cu's kVariants with them
// (a CPU test checks that each listed config is compiled). Registers: ptxas compiles every thread for
// 65536 / threads (168 at 128 rows, 128 at 192); "spills" marks the variants that do not fit (ptxas -v).
inline constexpr FlashSchedule kPlain = FlashSchedule::Plain, kPingPong = FlashSchedule::PingPong;
inline constexpr FlashOrder kTiles = FlashOrder::TilesInner, kHeads = FlashOrder::HeadsInner;
inline constexpr FlashConfig kFlashConfigs64[] = {
    {"m128", 128, false, kPlain, kTiles},  // the baseline
    {"m128-pp", 128, false, kPingPong, kTiles},
    {"m128-heads", 128, false, kPlain, kHeads},
    {"m128-pp-heads", 128, false, kPingPong, kHeads},
    {"m128-ov", 128, true, kPlain, kHeads},
    {"m128-ov-pp", 128, true, kPingPong, kHeads},
    {"m192", 192, false, kPlain, kHeads},
    {"m192-pp", 192, false, kPingPong, kHeads},
    {"m192-ov-ps", 192, true, kPlain, kHeads, true},
    {"m64x2", 64, false, kPlain, kHeads},
    {"m64x2-ov-ps", 64, true, kPlain, kHeads, true},
};
inline constexpr FlashConfig kFlashConfigs128[] = {
    {"m128", 128, false, kPlain, kTiles},  // the baseline
    {"m128-pp", 128, false, kPingPong, kTiles},
    {"m128-heads", 128, false, kPlain, kHeads},
    {"m128-pp-heads", 128, false, kPingPong, kHeads},
    {"m128-ov", 128, true, kPlain, kHeads},  // spills: O, S and P (160 registers) do not fit in 168
    {"m128-ov-ps", 128, true, kPlain, kHeads, true},
    {"m128-ov-pp-ps", 128, true, kPingPong, kHeads, true},
};

// THE DEFAULTS (what flash_wgmma() and attention_hopper() run without a config): per head_dim, the config
// (an index into the table above) for sequences up to max_q_len; the last entry covers the rest.
// Set from lesson15_hopper --sweep on the H200 (2026-12-03, chapter section 11): head_dim 64 takes m64x2 (two
// 64-row blocks per SM) up to 1k queries and m192 above (x1.24-1.33 over the baseline from 2k); head_dim 128
// takes m128-heads up to 8k (x1.04-1.30) and the baseline above (m128 was the fastest at 16k).
struct FlashDefault {
  int64_t max_q_len;
  int config;
};
inline constexpr FlashDefault kFlashDefaults64[] = {{1024, 9}, {INT64_MAX, 6}};
inline constexpr FlashDefault kFlashDefaults128[] = {{8192, 2}, {INT64_MAX, 0}};

// The table for head_dim 64 or 128 (InputError otherwise), its size, and the default for a batch whose
// longest query run is max_q_len.
struct FlashConfigList {
  const FlashConfig* begin_;
  int size;
  const FlashConfig* begin() const { return begin_; }
  const FlashConfig* end() const { return begin_ + size; }
  const FlashConfig& operator[](int i) const { return begin_[i]; }
};
FlashConfigList flash_configs(int64_t head_dim);
const FlashConfig& flash_default_config(int64_t head_dim, int64_t max_q_len);
// Whether flash_wgmma.cu compiled this (head_dim, block_m, overlap, schedule) combination.
bool flash_wgmma_has_config(int64_t head_dim, const FlashConfig& config);
// How many blocks of that variant the GPU keeps resident per SM
// (cudaOccupancyMaxActiveBlocksPerMultiprocessor: registers and shared memory decide). Needs
// hopper_available(); InputError otherwise.
int flash_wgmma_blocks_per_sm(int64_t head_dim, const FlashConfig& config);

// Whether flash_wgmma() takes this shape: head_dim 64 or 128 (any heads, any group, any window).
bool flash_wgmma_supports(const AttentionShape& shape);

// The checks that need no GPU: shape (validate() and the head_dim), and out, q, k, v as bf16 CUDA views
// [total_q, q_dim] / [total_k, kv_dim], unit column stride, rows 16-byte aligned (TMA's rule for a tensor
// map: base and row pitch multiples of 16 bytes). InputError naming the problem.
void check_flash_wgmma_args(const TensorView& out, const TensorView& q, const TensorView& k,
                            const TensorView& v, int64_t total_q, int64_t total_k,
                            const AttentionShape& shape);

// Causal GQA attention over `batch` on wgmma + TMA: out [total_q, n_heads * head_dim] from q, k, v laid out
// as lesson 07's attention() takes them (packed sequences, possibly column slices of a fused QKV buffer).
// Needs hopper_available() and flash_wgmma_supports(shape); InputError otherwise (before any launch).
// Runs on `stream`, returns at once; allocates nothing (the tensor maps are kernel parameters).
// Note: K/V tiles may run past the end of a sequence into the next one's rows; those keys are masked (their
// P is exactly 0), so they must be finite numbers, as every row of a real k and v is.
// CUDA graphs: the tensor maps (kernel parameters) hold q's, k's and v's addresses, strides and row counts
// (total_q, total_k) as they are at launch. Unlike lesson 07's kernels, which read only cu_seqlens, a
// captured launch must therefore be replayed with the same views and the same totals.
// The first form runs flash_default_config(head_dim, batch.max_q_len()); the second the given config
// (InputError unless flash_wgmma_has_config).
void flash_wgmma(const TensorView& out, const TensorView& q, const TensorView& k, const TensorView& v,
                 const AttentionBatch& batch, const AttentionShape& shape, cudaStream_t stream = nullptr);
void flash_wgmma(const TensorView& out, const TensorView& q, const TensorView& k, const TensorView& v,
                 const AttentionBatch& batch, const AttentionShape& shape, cudaStream_t stream,
                 const FlashConfig& config);

// Step 5's second product on its own, a diagnostic for the GPU tests: d [64, n] = p [64, 128] v [128, n] on
// one warpgroup, p from REGISTERS (each thread reads its A fragment, a_fragment_position()), v from shared
// memory through the MN-major descriptor, loaded by TMA as the attention kernel loads it. n = 64 or 128; p, v
// bf16 and d fp32, contiguous, on the GPU. Needs hopper_available(); InputError otherwise.
void wgmma_pv_tile(const TensorView& d, const TensorView& p, const TensorView& v,
                   cudaStream_t stream = nullptr);

// THE ENGINE'S HOOK (not wired yet): the same signature and contract as lesson 07's attention(), so that
// lessons/08_transformer/transformer.cpp can switch with one line (attention( -> attention_hopper( ).
// It runs flash_wgmma() when it can: CUDA views, kernel V2Flash, hopper_available(), head_dim 64 or 128.
// Everything else (the CPU reference, v1, other head dims, other GPUs) goes to lesson 07's attention()
// unchanged. A workspace, when given, is checked against the batch exactly as attention() checks it.
// Where it fits: lessons/08_transformer's PrefillAttention::attend (keys = the step's own tokens). Prefill
// over cached prefix blocks of lesson 12's pool: flash_wgmma_paged() (flash_paged.h), the same kernel with the
// paged KV policy.
void attention_hopper(const TensorView& out, const TensorView& q, const TensorView& k, const TensorView& v,
                      const AttentionBatch& batch, const AttentionShape& shape,
                      AttentionKernel kernel = AttentionKernel::V2Flash,
                      AttentionWorkspace* workspace = nullptr, cudaStream_t stream = nullptr);

}  // namespace tvllm
