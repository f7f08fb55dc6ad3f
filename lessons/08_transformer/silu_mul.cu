// Lesson 08, the GPU side: the SiLU·mul kernel and the row gather.
#include <cuda_bf16.h>

#include <algorithm>

#include "common/cuda_utils.cuh"
#include "common/errors.h"
#include "common/exercise.h"
#include "silu_mul.h"

namespace tvllm {

namespace {

struct SiluMulArgs {
  const __nv_bfloat16* gate;
  const __nv_bfloat16* up;
  __nv_bfloat16* out;
  int64_t rows, cols;                          // T, I
  int64_t gate_stride, up_stride, out_stride;  // elements between rows
};

// An elementwise op is memory-bound: 3 bf16 moved (6 bytes) per ~20 flops. What matters is that each
// thread moves 16 bytes per load (Pack<8>) and that enough loads are in flight; the math is free.
//
// One thread per kVec consecutive elements of a row, a grid-stride loop over all T * I / kVec vectors.
template <int kVec>
__global__ void silu_mul_kernel(SiluMulArgs a) {
  // --- exercise 08.2: the SiLU·mul kernel -----------------------------------------------------------
  // Task: for every row t < a.rows and column i < a.cols: out = bf16(bf16(silu(g)) * u), with
  //   g = gate[t, i], u = up[t, i] widened to fp32 and silu(g) = g / (1 + expf(-g)), rounded as Hugging
  //   Face's bf16 run rounds (act_fn(gate) is a bf16 tensor, then "* up" rounds again). Row t of a view
  //   starts at pointer + t * its stride. Move kVec consecutive elements per load (load_pack/store_pack).
  // Hint: a grid-stride loop over the a.rows * (a.cols / kVec) vectors: vector v is row v / per_row,
  //   columns (v % per_row) * kVec ... + kVec - 1. The launcher picked kVec so that it divides a.cols and
  //   every row start is aligned to kVec elements.
  // Hint: f32_to_bf16_bits and bf16_bits_to_f32 (common/cuda_utils.cuh) round and widen one value;
  //   Pack<kVec>::set rounds the product for you.
  // Tests: SiluMulGpu.MatchesHuggingFaceRoundingOnOddSizes TransformerGpu.ForwardTop1AgreesWithHuggingFace
  // Stub: device
  // --- solution ---
  const int64_t per_row = a.cols / kVec;
  const int64_t n = a.rows * per_row;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < n;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = v / per_row;
    const int64_t c = (v - t * per_row) * kVec;
    const Pack<kVec> g = load_pack<kVec>(a.gate + t * a.gate_stride + c);
    const Pack<kVec> u = load_pack<kVec>(a.up + t * a.up_stride + c);
    Pack<kVec> o;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float x = g.get(j);
      // Hugging Face: act_fn(gate) is computed in fp32 and stored as bf16 (first rounding) ...
      const float act = bf16_bits_to_f32(f32_to_bf16_bits(x / (1.0f + expf(-x))));
      // ... then act * up: two bf16 values, an exact product in fp32, one more rounding (in set()).
      o.set(j, act * u.get(j));
    }
    store_pack<kVec>(a.out + t * a.out_stride + c, o);
  }
  // --- end of exercise 08.2 ---
}

// The widest vector (8, 4, 2 or 1 bf16) that divides the row length, every row stride, and the alignment
// of every base pointer: then every row start of every view is aligned to it.
int silu_mul_vector_width(const SiluMulArgs& a) {
  int vec = 8;
  auto fits = [&](int64_t elems) { return elems % vec == 0; };
  auto aligned = [&](const void* p) { return pointer_alignment(p) >= static_cast<uint32_t>(2 * vec); };
  while (vec > 1 && !(fits(a.cols) &&
                      (a.rows <= 1 || (fits(a.gate_stride) && fits(a.up_stride) && fits(a.out_stride))) &&
                      aligned(a.gate) && aligned(a.up) && aligned(a.out)))
    vec /= 2;
  return vec;
}

template <int kVec>
void launch_silu_mul(const SiluMulArgs& a, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const int64_t vectors = a.rows * (a.cols / kVec);
  // Enough blocks for every vector, but no more than a few waves: the grid-stride loop does the rest.
  const int64_t blocks = std::min<int64_t>(ceil_div(vectors, kThreads), 64 * 1024);
  silu_mul_kernel<kVec><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a);
  TVLLM_CHECK_LAUNCH();
}

// One block per output row; the row is copied in words of Word (16 bytes when both rows are aligned).
template <class Word>
__global__ void gather_rows_kernel(char* out, const char* x, const int32_t* rows, int64_t row_bytes) {
  const int64_t r = blockIdx.x;
  const int64_t words = row_bytes / static_cast<int64_t>(sizeof(Word));
  const Word* src = reinterpret_cast<const Word*>(x + rows[r] * row_bytes);
  Word* dst = reinterpret_cast<Word*>(out + r * row_bytes);
  for (int64_t i = threadIdx.x; i < words; i += blockDim.x) dst[i] = src[i];
}

}  // namespace

namespace detail {

void silu_mul_cuda(const TensorView& out, const TensorView& gate, const TensorView& up, cudaStream_t stream) {
  SiluMulArgs a{gate.ptr<const __nv_bfloat16>(),
                up.ptr<const __nv_bfloat16>(),
                out.ptr<__nv_bfloat16>(),
                gate.shape[0],
                gate.shape[1],
                gate.strides[0],
                up.strides[0],
                out.strides[0]};
  switch (silu_mul_vector_width(a)) {
    case 8:
      launch_silu_mul<8>(a, stream);
      break;
    case 4:
      launch_silu_mul<4>(a, stream);
      break;
    case 2:
      launch_silu_mul<2>(a, stream);
      break;
    default:
      launch_silu_mul<1>(a, stream);
      break;
  }
}

void gather_rows_cuda(const TensorView& out, const TensorView& x, const TensorView& rows,
                      cudaStream_t stream) {
  const int64_t R = out.shape[0];
  const int64_t row_bytes = x.shape[1] * static_cast<int64_t>(dtype_size(x.dtype));
  const uint32_t align = std::min(pointer_alignment(out.data), pointer_alignment(x.data));
  uint32_t word = 16;
  while (word > 1 && (align < word || row_bytes % word != 0)) word /= 2;
  const int threads = static_cast<int>(std::clamp<int64_t>(row_bytes / word, 32, 256));
  auto* o = static_cast<char*>(out.data);
  const auto* in = static_cast<const char*>(x.data);
  const int32_t* idx = rows.ptr<const int32_t>();
  const auto blocks = static_cast<unsigned>(R);
  switch (word) {
    case 16:
      gather_rows_kernel<uint4><<<blocks, threads, 0, stream>>>(o, in, idx, row_bytes);
      break;
    case 8:
      gather_rows_kernel<uint2><<<blocks, threads, 0, stream>>>(o, in, idx, row_bytes);
      break;
    case 4:
      gather_rows_kernel<uint32_t><<<blocks, threads, 0, stream>>>(o, in, idx, row_bytes);
      break;
    case 2:
      gather_rows_kernel<uint16_t><<<blocks, threads, 0, stream>>>(o, in, idx, row_bytes);
      break;
    default:
      gather_rows_kernel<uint8_t><<<blocks, threads, 0, stream>>>(o, in, idx, row_bytes);
      break;
  }
  TVLLM_CHECK_LAUNCH();
}

}  // namespace detail
}  // namespace tvllm
