// Lesson 15: flash_wgmma() as the engine's prefill attention (prefill_hook.h).
#include "prefill_hook.h"

#include <cstdint>

#include "flash_paged.h"
#include "flash_wgmma.h"
#include "hopper.h"
#include "matmul.h"
#include "tensor_map.h"
#include "transformer.h"

namespace tvllm {

bool hopper_prefill_accepts(const TensorView& out, const TensorView& q, const TensorView& k, const TensorView& v,
                            const AttentionShape& shape) {
  if (!flash_wgmma_supports(shape)) return false;
  // A view into the fused QKV buffer starts at column q_dim or q_dim + kv_dim: TMA-aligned whenever those are
  // multiples of 8.
  for (const TensorView* t : {&out, &q, &k, &v})
    if (!tma_matrix_ok(*t)) return false;
  return hopper_available();
}

bool hopper_prefill_attention(const TensorView& out, const TensorView& q, const TensorView& k, const TensorView& v,
                              const AttentionBatch& batch, const AttentionShape& shape, cudaStream_t stream) {
  if (!hopper_prefill_accepts(out, q, k, v, shape)) return false;
  flash_wgmma(out, q, k, v, batch, shape, stream);
  return true;
}

bool hopper_paged_prefill_accepts(const TensorView& out, const TensorView& q, const TensorView& pool_k,
                                  const TensorView& pool_v, const PagedStepTables& tables,
                                  const AttentionShape& shape) {
  if (tables.device() != Device::CUDA ||
      !flash_paged_refusal(shape, tables.block_size(), tables.num_blocks() * tables.block_size()).empty())
    return false;
  for (const TensorView* t : {&out, &q}) {
    if (t->device != Device::CUDA || t->dtype != DType::BF16 || t->rank() != 2 || t->strides[1] != 1) return false;
    if (reinterpret_cast<uintptr_t>(t->data) % 16 != 0 || t->strides[0] % 8 != 0) return false;
  }
  for (const TensorView* t : {&pool_k, &pool_v})
    if (t->device != Device::CUDA || t->dtype != DType::BF16 || t->rank() != 3 || !t->is_contiguous() ||
        reinterpret_cast<uintptr_t>(t->data) % 16 != 0)
      return false;
  return hopper_available();
}

bool hopper_paged_prefill_attention(const TensorView& out, const TensorView& q, const TensorView& pool_k,
                                    const TensorView& pool_v, const AttentionBatch& batch,
                                    const PagedStepTables& tables, const AttentionShape& shape, cudaStream_t stream) {
  if (!hopper_paged_prefill_accepts(out, q, pool_k, pool_v, tables, shape)) return false;
  flash_wgmma_paged(out, q, pool_k, pool_v, batch, tables, shape, stream);
  return true;
}

bool install_hopper_prefill_attention() {
  if (!hopper_available()) return false;
  install_fresh_prefill(hopper_prefill_attention);
  install_fast_paged_prefill(hopper_paged_prefill_attention);
  return true;
}

bool hopper_gemm_accepts(const TensorView& y, const TensorView& x, const TensorView& w) {
  // gemm_wgmma_v2's rules (check_gemm_wgmma_args): x and w contiguous and TMA-ready, K a multiple of 64; y a
  // contiguous bf16 matrix starting 16-byte aligned (any N: v2 stores N % 8 != 0 without TMA); any M.
  for (const TensorView* t : {&x, &w})
    if (!tma_matrix_ok(*t) || !t->is_contiguous()) return false;
  if (y.device != Device::CUDA || y.dtype != DType::BF16 || y.rank() != 2 || !y.is_contiguous() ||
      reinterpret_cast<uintptr_t>(y.data) % 16 != 0)
    return false;
  const int64_t k = x.dim(1);
  if (k < kGemmBlockK || k % kGemmBlockK != 0 || w.dim(1) != k || y.dim(1) != w.dim(0)) return false;
  return hopper_available();
}

bool hopper_large_gemm(const TensorView& y, const TensorView& x, const TensorView& w, cudaStream_t stream) {
  if (!hopper_gemm_accepts(y, x, w)) return false;
  gemm_wgmma_v2(y, x, w, stream);
  return true;
}

bool install_hopper_large_gemm() {
  if (!hopper_available()) return false;
  install_large_gemm(hopper_large_gemm, kHopperGemmMinTokens);
  return true;
}

bool hopper_gated_mlp_accepts(const TensorView& act, const TensorView& x, const TensorView& w_gate_up) {
  // check_gated_mlp_args' rules as a yes or no (a declined step runs the two ops: no message to give).
  for (const TensorView* t : {&x, &w_gate_up})
    if (!tma_matrix_ok(*t) || !t->is_contiguous()) return false;
  if (act.device != Device::CUDA || act.dtype != DType::BF16 || act.rank() != 2 || !act.is_contiguous() ||
      reinterpret_cast<uintptr_t>(act.data) % 16 != 0)
    return false;
  const int64_t m = x.dim(0), k = x.dim(1), i = act.dim(1);
  if (m < 1 || i < 8 || i % 8 != 0 || act.dim(0) != m || w_gate_up.dim(0) != 2 * i || w_gate_up.dim(1) != k ||
      k < kGemmBlockK || k % kGemmBlockK != 0)
    return false;
  return hopper_available();
}

bool hopper_gated_mlp(const TensorView& act, const TensorView& x, const TensorView& w_gate_up, cudaStream_t stream) {
  if (!hopper_gated_mlp_accepts(act, x, w_gate_up)) return false;
  gated_mlp_wgmma(act, x, w_gate_up, stream);  // still checks everything, overlap included
  return true;
}

bool install_hopper_gated_mlp() {
  if (!hopper_available()) return false;
  install_gated_mlp(hopper_gated_mlp, kHopperGatedMlpMinTokens);
  return true;
}

}  // namespace tvllm
