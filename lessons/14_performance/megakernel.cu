// Lesson 14: the megakernel's host side (megakernel.h): what it declines, the program it plans once per model,
// and the cooperative launch of one step. The kernel is megakernel_kernel.cuh.
#include "megakernel.h"

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "cached_attention.h"
#include "paged_attention.h"
#include "common/buffer.h"
#include "common/device.h"
#include "common/errors.h"
#include "fast_forward.h"
#include "megakernel_kernel.cuh"
#include "megakernel_plan.h"
#include "pdl.h"

namespace tvllm {

namespace {

// Everything one (context, weights) pair needs on the device, built by megakernel_prepare.
struct MkState {
  std::vector<const void*> signature;  // what the program was planned for (weights_signature)
  MegakernelGeometry geometry;
  int max_splits = 0;
  DeviceBuffer chunks, begins, ops, norms;
  DeviceBuffer warp_chunks, warp_begins, copies;  // per-warp stages only
  DeviceBuffer barrier;   // U32 [2] count, generation | I32 error flag
  DeviceBuffer partials;  // F32 [n_heads][max_splits][head_dim + 2]
  uint32_t xs_offset = 0, red_offset = 0, bar_offset = 0;
};

// Every pointer the program holds, plus the shapes: a state is used only for the weights it was planned for (a
// ModelWeights may be destroyed and another one built at the same address).
std::vector<const void*> weights_signature(const ModelWeights& w) {
  std::vector<const void*> s = {w.embed.data, w.final_norm.data, w.lm_head.data,
                                reinterpret_cast<const void*>(static_cast<intptr_t>(w.config.hidden_size)),
                                reinterpret_cast<const void*>(static_cast<intptr_t>(w.config.intermediate_size)),
                                reinterpret_cast<const void*>(static_cast<intptr_t>(w.config.vocab_size))};
  for (const LayerWeights& L : w.layers)
    for (const void* ptr : {L.wqkv.data, L.wo.data, L.w_gate_up.data, L.w_down.data, L.input_norm.data,
                            L.post_norm.data, L.wqkv_scale.data, L.wo_scale.data, L.w_gate_up_scale.data,
                            L.w_down_scale.data, L.bqkv.data, L.q_norm.data, L.k_norm.data})
      s.push_back(ptr);
  return s;
}

std::mutex g_states_mutex;
std::map<std::pair<const ExecContext*, const ModelWeights*>, std::unique_ptr<MkState>> g_states;
std::atomic<int64_t> g_steps{0};

MegakernelVariant initial_variant() {
  // PerWarp only when asked for: its first version shared stages between warps and failed at the 1B shape on
  // the H200 (README section 14: a waiter could pass on an older fill's parity). Fixed since (each stage owned
  // by one warp), the default again only once the H200 has measured it.
  const char* pw = std::getenv("TVLLM_MEGAKERNEL_PER_WARP");
  return pw && *pw && std::strcmp(pw, "0") != 0 ? MegakernelVariant::PerWarp : MegakernelVariant::SharedStages;
}
std::atomic<MegakernelVariant> g_variant{initial_variant()};

MkState* find_state(const ExecContext& ctx, const ModelWeights& w) {
  std::lock_guard<std::mutex> lock(g_states_mutex);
  const auto it = g_states.find({&ctx, &w});
  if (it == g_states.end() || it->second->signature != weights_signature(w)) return nullptr;
  return it->second.get();
}

int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

std::string config_declines(const ModelConfig& c) {
  if (!fast_forward_declines(c).empty()) return fast_forward_declines(c);
  if (c.sliding_window > 0) return "a sliding window";
  if (c.head_dim != 64 && c.head_dim != 128) return "head_dim " + std::to_string(c.head_dim);
  if (c.num_key_value_heads <= 0 || c.num_attention_heads % c.num_key_value_heads != 0 ||
      c.group_size() > mk::kMaxGroup)
    return "more than " + std::to_string(mk::kMaxGroup) + " query heads per kv head";
  return "";
}

// Attention scratch in floats (aliases xs: attention runs between the qkv and o phases, when xs is free).
int64_t attention_floats(int64_t D, int warps) { return mk::kMaxGroup * D + 2 * D + warps * mk::kMaxGroup * (D + 2); }

// The kernel of a head_dim and a scheme, and its block size.
using KernelFn = void (*)(mk::Params);
KernelFn kernel_of(int D, MegakernelVariant v) {
  constexpr int W1 = mk::kConsumerWarps, W2 = mk::kConsumerWarpsPerWarp;
  if (v == MegakernelVariant::SharedStages)
    return D == 64 ? mk::megakernel<64, W1, false> : mk::megakernel<128, W1, false>;
  return D == 64 ? mk::megakernel<64, W2, true> : mk::megakernel<128, W2, true>;
}
int warps_of(MegakernelVariant v) {
  return v == MegakernelVariant::SharedStages ? mk::kConsumerWarps : mk::kConsumerWarpsPerWarp;
}

}  // namespace

std::string megakernel_declines(const ModelConfig& c) { return config_declines(c); }

void set_megakernel_variant(MegakernelVariant v) { g_variant = v; }
MegakernelVariant megakernel_variant() { return g_variant.load(); }
const char* megakernel_variant_name(MegakernelVariant v) {
  return v == MegakernelVariant::SharedStages ? "shared stages" : "per-warp stages";
}

std::string megakernel_declines(const ModelWeights& w) {
  const std::string config = config_declines(w.config);
  if (!config.empty()) return config;
  if (w.device != Device::CUDA) return "the CPU";
  if (!fast_forward_supported(w)) return "weights the fused path does not take";
  // BF16, or FP8-resident (lesson 16: E4M3 codes + a F32 scale per row) with rows of whole 16-byte packs (K % 16
  // == 0: the bulk copies' alignment; the fused FP8 GEMVs also take K % 16 == 8, e.g. the bundled model's 600).
  const DType want = w.fp8_resident ? DType::F8_E4M3 : DType::BF16;
  for (const LayerWeights& L : w.layers)
    for (const TensorView* m : {&L.wqkv, &L.wo, &L.w_gate_up, &L.w_down}) {
      if (m->dtype != want) return w.fp8_resident ? "FP8-resident weights mixed with others" : "non-BF16 weights";
      if (L.bqkv.data && L.bqkv.dtype != DType::BF16) return "non-BF16 q/k/v biases";
      if (L.has_qk_norm() && (L.q_norm.dtype != DType::BF16 || L.k_norm.dtype != DType::BF16))
        return "non-BF16 q/k norm weights";
      if (w.fp8_resident && m->shape[1] % 16 != 0)
        return "FP8-resident rows of " + std::to_string(m->shape[1]) + " codes (not whole 16-byte packs)";
    }
  if (w.lm_head.dtype != DType::BF16 || w.embed.dtype != DType::BF16) return "non-BF16 embeddings or lm_head";
  // The kernel reads the embedding row and the norm weights in 16-byte packs.
  const auto aligned = [](const TensorView& t) { return reinterpret_cast<uintptr_t>(t.data) % 16 == 0; };
  bool all_aligned = aligned(w.embed) && aligned(w.final_norm);
  for (const LayerWeights& L : w.layers) all_aligned = all_aligned && aligned(L.input_norm) && aligned(L.post_norm);
  if (!all_aligned) return "an embedding or norm weight not 16-byte aligned";
  const DeviceProps props = query_device();
  if (props.compute_major < 9) return "a pre-sm_90 GPU (no bulk copies)";
  int coop = 0;
  TVLLM_CUDA_CHECK(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, 0));
  if (!coop) return "a GPU without cooperative launches";
  return "";
}

bool megakernel_prepare(ExecContext& ctx, const ModelWeights& w) {
  const MegakernelVariant variant = megakernel_variant();
  if (const MkState* old = find_state(ctx, w); old && old->geometry.variant == variant) return true;
  if (ctx.device() != Device::CUDA || !megakernel_declines(w).empty()) return false;
  const ModelConfig& c = w.config;
  const int D = static_cast<int>(c.head_dim);
  const bool per_warp = variant == MegakernelVariant::PerWarp;
  const int warps = warps_of(variant);
  auto st = std::make_unique<MkState>();
  const int sms = query_device().multiprocessors;
  int optin = 0;
  TVLLM_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));

  // Shared memory: the ring, then xs (the activation vector; the attention scratch aliases it), red, barriers.
  const int64_t xs_bytes = std::max<int64_t>(
      round_up(std::max({c.hidden_size, c.q_dim(), c.intermediate_size}) * 2, 128), attention_floats(D, warps) * 4);
  const int64_t red_bytes = round_up((warps * 32 + 2) * 4, 128);
  const int64_t fixed = xs_bytes + red_bytes;
  // Shared stages: 32 KiB, one at a time through all 8 warps. Per-warp stages: 16 KiB, so that the ring holds
  // about as many stages as there are warps (each warp one in flight) and a 1B-shaped row (down: 8192 bf16 = 16
  // KiB) still fits whole; bigger rows are sliced, the slices kept with one warp.
  int64_t stage_bytes = per_warp ? 16384 : 32768;
  // At least 4 stages (per-warp stages: one per owner warp, megakernel_plan.h "The ring").
  const int64_t min_stages = per_warp ? std::max(4, warps) : 4;
  while (stage_bytes > 4096 && (optin - fixed - 1024) / stage_bytes < min_stages) stage_bytes /= 2;
  const int64_t stages = std::min<int64_t>((optin - fixed - 1024) / stage_bytes, 64);  // 1024: the mbarriers
  // A tiny shared memory, or (per-warp stages) fewer stages than owner warps: the fused path.
  if (stages < 2 || (per_warp && stages < warps)) return false;
  const int64_t ring_bytes = stages * stage_bytes;
  st->xs_offset = static_cast<uint32_t>(ring_bytes);
  st->red_offset = static_cast<uint32_t>(ring_bytes + xs_bytes);
  st->bar_offset = static_cast<uint32_t>(ring_bytes + xs_bytes + red_bytes);
  const int64_t smem = st->bar_offset + 2 * stages * 8;
  // The attribute is per kernel, not per model: always the device's maximum, so that preparing a second model
  // with a smaller ring never lowers what the first one launches with.
  const KernelFn kernel = kernel_of(D, variant);
  TVLLM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, optin));
  int resident = 0;
  TVLLM_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, (warps + 1) * 32,
                                                                 static_cast<size_t>(smem)));
  if (resident < 1) return false;

  // The program: 4 phases per layer, then the lm_head (megakernel_plan.h). Outputs per chunk: shared stages at
  // most 128, so a gate|up chunk's 256 stage rows still have one consumer thread each; per-warp stages at most
  // 32, one lane each.
  std::vector<MkMatrix> matrices;
  std::vector<mk::OpDesc> ops;
  std::vector<mk::LayerNorms> norms;
  const auto add = [&](const TensorView& wt, const TensorView& scale, bool paired, mk::Op kind,
                       const TensorView& bias = {}) {
    const int64_t outputs = paired ? wt.shape[0] / 2 : wt.shape[0];
    const int64_t eb = wt.dtype == DType::F8_E4M3 ? 1 : 2;
    matrices.push_back({outputs, wt.shape[1], eb, paired});
    ops.push_back({wt.data, eb == 1 ? static_cast<const float*>(scale.data) : nullptr,
                   static_cast<const mk::bf16*>(bias.data), static_cast<uint32_t>(wt.shape[1]), static_cast<uint32_t>(outputs), static_cast<uint32_t>(kind),
                   static_cast<uint32_t>(eb)});
  };
  for (const LayerWeights& L : w.layers) {
    add(L.wqkv, L.wqkv_scale, false, mk::Op::Qkv, L.bqkv);
    add(L.wo, L.wo_scale, false, mk::Op::O);
    add(L.w_gate_up, L.w_gate_up_scale, true, mk::Op::GateUp);
    add(L.w_down, L.w_down_scale, false, mk::Op::Down);
    norms.push_back({static_cast<const mk::bf16*>(L.input_norm.data), static_cast<const mk::bf16*>(L.post_norm.data),
                     static_cast<const mk::bf16*>(L.q_norm.data), static_cast<const mk::bf16*>(L.k_norm.data)});
  }
  add(w.lm_head, {}, false, mk::Op::LmHead);
  const MegakernelPlan plan(matrices, sms, stage_bytes, static_cast<int>(stages), per_warp ? 32 : 128,
                            per_warp ? warps : 0);

  const auto upload = [](DeviceBuffer& buf, const void* src, size_t bytes) {
    buf = DeviceBuffer(std::max<size_t>(bytes, 16));
    buf.copy_from_host(src, bytes);
  };
  upload(st->chunks, plan.chunks().data(), plan.chunks().size() * sizeof(MkChunk));
  upload(st->begins, plan.begins().data(), plan.begins().size() * sizeof(uint32_t));
  upload(st->ops, ops.data(), ops.size() * sizeof(mk::OpDesc));
  upload(st->norms, norms.data(), norms.size() * sizeof(mk::LayerNorms));
  if (per_warp) {
    upload(st->warp_chunks, plan.warp_chunks().data(), plan.warp_chunks().size() * sizeof(MkChunk));
    upload(st->warp_begins, plan.warp_begins().data(), plan.warp_begins().size() * sizeof(uint32_t));
    // The producer's copy jobs: each chunk's source addresses, resolved here once (mk::produce_warp).
    std::vector<mk::MkCopy> copies(plan.chunks().size());
    for (size_t i = 0; i < copies.size(); ++i) {
      const MkChunk& ch = plan.chunks()[i];
      const mk::OpDesc& op = ops[ch.phase];
      const char* wt = static_cast<const char*>(op.w);
      copies[i].bytes = ch.rows * ch.kc * op.elem_bytes;
      copies[i].slot = ch.slot;
      copies[i].round = ch.round;
      copies[i].src0 = wt + (static_cast<int64_t>(ch.row0) * op.K + ch.k0) * op.elem_bytes;
      copies[i].src1 = op.kind == static_cast<uint32_t>(mk::Op::GateUp)
                           ? wt + ((static_cast<int64_t>(ch.row0) + op.outputs) * op.K + ch.k0) * op.elem_bytes
                           : nullptr;
    }
    static_assert(sizeof(mk::MkCopy) == 32, "two 16-byte loads per copy job");
    upload(st->copies, copies.data(), copies.size() * sizeof(mk::MkCopy));
  }
  st->barrier = DeviceBuffer(16);
  st->barrier.fill_zero();
  st->max_splits = std::max<int>(1, sms / static_cast<int>(c.num_key_value_heads));
  st->partials = DeviceBuffer(static_cast<size_t>(c.num_attention_heads) * st->max_splits * (D + 2) * 4);
  TVLLM_CUDA_CHECK(cudaDeviceSynchronize());  // the uploads are done before any step reads them

  st->signature = weights_signature(w);
  st->geometry = {sms,  static_cast<int>(stages), stage_bytes, static_cast<int64_t>(plan.chunks().size()),
                  smem, warps,                     variant};
  std::lock_guard<std::mutex> lock(g_states_mutex);
  // A context runs one model: whatever was prepared for this context address before (another model, or a
  // context since destroyed and rebuilt here) is dropped, so the table grows with live contexts only.
  for (auto it = g_states.begin(); it != g_states.end();) it = it->first.first == &ctx ? g_states.erase(it) : std::next(it);
  g_states[{&ctx, &w}] = std::move(st);
  return true;
}

MegakernelGeometry megakernel_geometry(ExecContext& ctx, const ModelWeights& w) {
  const MkState* st = find_state(ctx, w);
  return st ? st->geometry : MegakernelGeometry{};
}

int64_t megakernel_steps_launched() { return g_steps.load(); }

TensorView megakernel_forward(ExecContext& ctx, const ModelWeights& w, const StepInputs& step,
                              AttentionBackend& backend) {
  const auto fallback = [&] {
    return pdl_supported() ? fast_forward_pdl(ctx, w, step, backend) : fast_forward(ctx, w, step, backend);
  };
  MkState* st = find_state(ctx, w);
  // Lesson 10's contiguous cache (the Generator's; the Engine's ContiguousKv) or lesson 12's paged pool.
  auto* cached = dynamic_cast<CachedAttention*>(&backend);
  auto* paged = dynamic_cast<PagedAttention*>(&backend);
  if (!st || (!cached && !paged) || ctx.device() != Device::CUDA || step.num_tokens() != 1 ||
      step.num_sequences() != 1 || step.num_logits_rows() != 1 || step.host_logits_rows()[0] != 0 ||
      ctx.matmul_kernel() != kDefaultMatmulKernel)
    return fallback();
  // An FP8 pool (lesson 16, --kv-cache-dtype fp8) holds E4M3 codes and per-layer scales: the megakernel reads
  // bf16 keys and values only, so such steps take the fused path (lesson 14's FP8 decode hook).
  if (paged && paged->pool().fp8()) return fallback();
  // Batch invariance attends with the flash kernel on purpose (lesson 11): not the megakernel's splits.
  if (cached ? cached->decode_kind() == DecodeAttention::Flash || cached->slots().size() != 1
             : paged->decode_kind() == DecodeAttention::Flash || paged->tables().num_sequences() != 1 ||
                   paged->tables().num_tokens() != 1)
    return fallback();
  check_forward_args(ctx, w, step);
  const ModelConfig& c = w.config;
  Workspace& ws = ctx.workspace();
  const int32_t pos = step.host_positions()[0];
  const int64_t capacity =
      cached ? cached->cache().max_context() : paged->tables().table_len(0) * paged->tables().block_size();
  TVLLM_REQUIRE(pos >= 0 && pos < capacity && pos < ws.rope.max_positions(),
                "megakernel: position " + std::to_string(pos) + " is past the KV cache or the RoPE table");
  // Both keep every layer's k then v in one allocation: layer l's k at 2l layer sizes, its v one after.
  const TensorView k0 = cached ? cached->cache().k(0) : paged->pool().k(0);
  const TensorView v0 = cached ? cached->cache().v(0) : paged->pool().v(0);
  const auto k_of = [&](int layer) { return cached ? cached->cache().k(layer) : paged->pool().k(layer); };
  const int64_t layer_stride =
      c.num_hidden_layers > 1 ? (static_cast<char*>(k_of(1).data) - static_cast<char*>(k0.data)) / 2 : 0;

  mk::Params p{};
  p.chunks = st->chunks.as<MkChunk>();
  p.begins = st->begins.as<uint32_t>();
  const bool per_warp = st->geometry.variant == MegakernelVariant::PerWarp;
  p.warp_chunks = per_warp ? st->warp_chunks.as<MkChunk>() : nullptr;
  p.warp_begins = per_warp ? st->warp_begins.as<uint32_t>() : nullptr;
  p.copies = per_warp ? st->copies.as<mk::MkCopy>() : nullptr;
  p.ops = st->ops.as<mk::OpDesc>();
  p.norms = st->norms.as<mk::LayerNorms>();
  p.phases = 4 * static_cast<int>(c.num_hidden_layers) + 1;
  p.layers = static_cast<int>(c.num_hidden_layers);
  p.hidden = static_cast<int>(c.hidden_size);
  p.q_dim = static_cast<int>(c.q_dim());
  p.kv_dim = static_cast<int>(c.kv_dim());
  p.inter = static_cast<int>(c.intermediate_size);
  p.n_heads = static_cast<int>(c.num_attention_heads);
  p.n_kv = static_cast<int>(c.num_key_value_heads);
  p.head_dim = static_cast<int>(c.head_dim);
  p.embed = static_cast<const mk::bf16*>(w.embed.data);
  p.final_norm = static_cast<const mk::bf16*>(w.final_norm.data);
  p.h = static_cast<mk::bf16*>(ws.hidden.data());
  p.qkv = static_cast<mk::bf16*>(ws.qkv.data());
  p.act = static_cast<mk::bf16*>(ws.act.data());
  p.logits = static_cast<float*>(ws.logits.data());
  p.partials = st->partials.as<float>();
  p.max_splits = st->max_splits;
  p.token = static_cast<const int32_t*>(step.token_ids().data);
  p.position = static_cast<const int32_t*>(step.positions().data);
  p.slot = cached ? cached->slots().device_slots() : nullptr;
  p.block_table = paged ? paged->tables().device_block_tables() : nullptr;
  p.new_row = paged ? paged->tables().device_slot_mapping() : nullptr;
  p.block_size = paged ? static_cast<int>(paged->tables().block_size()) : 0;
  p.cache_k = static_cast<mk::bf16*>(k0.data);
  p.layer_stride = layer_stride;
  p.v_offset = (static_cast<char*>(v0.data) - static_cast<char*>(k0.data)) / 2;
  p.max_context = cached ? static_cast<int>(cached->cache().max_context()) : 0;
  p.rope_cos = static_cast<const float*>(ws.rope.cos(Device::CUDA).data);
  p.rope_sin = static_cast<const float*>(ws.rope.sin(Device::CUDA).data);
  p.rope_positions = static_cast<int>(ws.rope.max_positions());
  p.eps = static_cast<float>(c.rms_norm_eps);
  p.scale_log2 = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.head_dim)) * 1.4426950408889634);
  p.bar = st->barrier.as<unsigned>();
  p.error = reinterpret_cast<int*>(st->barrier.as<unsigned>() + 2);
  p.stages = st->geometry.stages;
  p.stage_bytes = static_cast<uint32_t>(st->geometry.stage_bytes);
  p.xs_offset = st->xs_offset;
  p.red_offset = st->red_offset;
  p.att_offset = st->xs_offset;
  p.bar_offset = st->bar_offset;

  // One block per SM, launched cooperatively: the driver starts all of them at once or refuses the launch, so
  // the grid barrier never waits for a block that cannot be scheduled. Capturable in a CUDA graph (a kernel node
  // with the cooperative attribute).
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(st->geometry.blocks));
  cfg.blockDim = dim3(static_cast<unsigned>((st->geometry.consumer_warps + 1) * 32));
  cfg.dynamicSmemBytes = static_cast<size_t>(st->geometry.smem_bytes);
  cfg.stream = ctx.stream();
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  TVLLM_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel_of(static_cast<int>(c.head_dim), st->geometry.variant), p));
  ++g_steps;
  return ws.logits.view().rows(0, 1);
}

}  // namespace tvllm
