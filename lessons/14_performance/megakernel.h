// Lesson 14: the megakernel. The whole batch-1 decode step (every layer, the final norm, the lm_head) as ONE
// persistent kernel, one block per SM, whose weight loads never stop (README, "The megakernel").
//
//   block (one per SM)                                       shared memory
//   ┌───────────────────────────────────────────┐            ┌──────┬──────┬──────┬─────┬──────┐
//   │ producer warp: one thread walks the block's│──bulk────> │stage0│stage1│stage2│ ... │stageS│  the ring
//   │   program (megakernel_plan.h) and copies    │  copies    └──────┴──────┴──────┴─────┴──────┘
//   │   chunk after chunk, waiting only for a     │  (full/empty mbarrier per stage)  │
//   │   free stage: never for a grid barrier      │                                   v
//   │ consumer warps: per layer                   │  qkv ─bar─ attention ─bar─ o ─bar─ gate|up ─bar─ down ─bar─
//   │   each phase computes its rows from the ring│  ... lm_head
//   └───────────────────────────────────────────┘
//
// While the consumers wait at a grid barrier or read the KV cache, the producer is already streaming the next
// phase's weights: the ramp-up and tail every separate GEMV kernel pays are paid once per step.
//
// What it takes (megakernel_declines says what it does not): a CUDA sm_90+ device, BF16 weights packed like the
// fused path's (wqkv, w_gate_up) or FP8-resident ones (lesson 16: E4M3 codes + a F32 scale per row, every K a
// multiple of 16), no bias but Qwen2's q/k/v ones (Qwen3's q/k norm is in), no sliding window, head_dim 64 or 128, at most 8 query heads per kv
// head, lesson 10's contiguous KV cache (CachedAttention) or lesson 12's paged pool (PagedAttention), and a step
// of ONE token of ONE sequence whose logits row is that token. Everything else runs fast_forward_pdl.
#pragma once

#include <cstdint>
#include <string>

#include "model_weights.h"
#include "transformer.h"

namespace tvllm {

// "" when the megakernel can run this model on this device, else why not ("head_dim 96", "a sliding window",
// "the CPU", "a pre-sm_90 GPU (no bulk copies)", ...). The config's reasons first, then the device's and the
// weights'.
std::string megakernel_declines(const ModelWeights& weights);
// The config's part of it alone (the command line's notice, before any weights are bound).
std::string megakernel_declines(const ModelConfig& config);

// Builds (once per context and weights) what the megakernel needs on the device: the program, the op table, the
// grid barrier's counters, the attention partials. Allocates and synchronises: call it when installing, never
// during a graph capture (use_fast_path does). Returns false (and prepares nothing) when megakernel_declines.
bool megakernel_prepare(ExecContext& ctx, const ModelWeights& weights);

// ForwardFn: the megakernel for a step it takes (prepared, one token, one sequence, CachedAttention or
// PagedAttention (not in batch-invariant Flash mode), the logits
// row is the token, the default matmul kernel), fast_forward_pdl (fast_forward where PDL is not available) for
// every other step. Same contract as forward(): queued on ctx.stream(), no allocation, no synchronisation.
TensorView megakernel_forward(ExecContext& ctx, const ModelWeights& weights, const StepInputs& step,
                              AttentionBackend& backend);

// The consumers' scheme (README section 14, "Per-warp stages"). SharedStages (the default): the first version,
// every consumer warp on every stage, a named barrier per stage. PerWarp: each chunk computed by its one owner
// warp, each ring stage owned by one warp, no barrier among the warps inside a phase. Its first version shared
// stages between warps and failed at the 1B shape on the H200 (a wait could pass on an older fill's parity:
// megakernel_plan.h, "The ring"); fixed, not yet measured there, so it stays experimental.
// Process-wide, read by megakernel_prepare (a context prepared under the other scheme is prepared again). The
// initial value is PerWarp when the environment variable TVLLM_MEGAKERNEL_PER_WARP is set to a non-empty value
// other than "0", else SharedStages.
enum class MegakernelVariant { PerWarp, SharedStages };
void set_megakernel_variant(MegakernelVariant v);
MegakernelVariant megakernel_variant();
const char* megakernel_variant_name(MegakernelVariant v);  // "per-warp stages" / "shared stages"

// How many steps the megakernel itself has run in this process (host counter, bumped at each launch or capture):
// for the tests that check it was not silently declined.
int64_t megakernel_steps_launched();

// The kernel's geometry on this device for these weights (tests and the chapter): 0s when not prepared.
struct MegakernelGeometry {
  int blocks = 0;            // one per SM
  int stages = 0;            // ring stages per block
  int64_t stage_bytes = 0;
  int64_t chunks = 0;        // the program's chunks, all blocks
  int64_t smem_bytes = 0;    // dynamic shared memory per block
  int consumer_warps = 0;    // + one producer warp
  MegakernelVariant variant = MegakernelVariant::SharedStages;
};
MegakernelGeometry megakernel_geometry(ExecContext& ctx, const ModelWeights& weights);

}  // namespace tvllm
