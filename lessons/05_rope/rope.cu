// RoPE on the GPU: three versions, from naive to fast (README.md walks through them).
//
// All of them store q/k in bf16 and compute in fp32, and all of them evaluate Hugging Face's expression
// rounding for rounding (see rotate_pair): with the same cos/sin, v1 and v2 produce exactly the fp32
// numbers of the CPU reference, and differ from it only by the final rounding to bf16.
//
// RoPE is pure data movement: per element 2 bytes in, 2 bytes out, ~3 flops. The only question is how
// close a kernel gets to the memory bandwidth.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/cuda_utils.cuh"  // Pack, load_pack, store_pack
#include "common/errors.h"
#include "common/exercise.h"
#include "rope.h"

namespace tvllm {
namespace rope_detail {
namespace {

// Everything a kernel needs, passed by value (kernel parameters live in constant memory).
struct RopeArgs {
  __nv_bfloat16* q;           // [T, q_row_stride], q_heads heads of 2*half
  __nv_bfloat16* k;           // [T, k_row_stride], k_heads heads of 2*half
  int64_t q_row_stride;       // elements between rows
  int64_t k_row_stride;
  const int32_t* positions;   // [T]
  const float* cos;           // [max_positions, half]   (v1, v2)
  const float* sin;           // [max_positions, half]   (v1, v2)
  const float* inv_freq;      // [half]                  (v3)
  int64_t tokens;
  int q_heads;
  int k_heads;
  int half;                   // head_dim / 2: the number of pairs per head
  int max_positions;
  float attention_scaling;    // (v3) 1.0 for default and llama3
};

// apply_rope validated the positions unless the caller said they are trusted; either way a kernel never
// reads outside the table.
[[maybe_unused]] __device__ __forceinline__ int clamp_position(int32_t pos, int max_positions) {
  return min(max(pos, 0), max_positions - 1);
}

// Hugging Face's fp32 expression  q*cos + rotate_half(q)*sin  for one pair (a, b) = (x[j], x[j+half]):
//   a' = a*cos - b*sin,   b' = b*cos + a*sin
// __fmul_rn / __fadd_rn / __fsub_rn round each operation on its own: the compiler may not fuse them into
// an FMA (it would with plain `a*c - b*s`), so the result is bit-for-bit the CPU reference's.
[[maybe_unused]]
__device__ __forceinline__ void rotate_pair(float a, float b, float c, float s, float& a_out, float& b_out) {
  a_out = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
  b_out = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
}

// bf16 bits <-> fp32 (bf16_bits_to_f32, f32_to_bf16_bits) and the packs of v2/v3 (Pack<N>, load_pack,
// store_pack) come from common/cuda_utils.cuh (lesson 04 teaches them).

// ---- v1: one thread per (token, head, pair) ---------------------------------------------------------
//
// The simplest correct kernel. Consecutive threads take consecutive pairs j, so a warp reads 32
// consecutive bf16 of the first half and 32 of the second half of a head: coalesced, but only 2 bytes
// per load, and the q and k passes are two launches (positions and table rows are read twice).
__global__ void rope_v1_kernel(__nv_bfloat16* x, int64_t row_stride, int heads, int half,
                               const int32_t* positions, const float* cos_table, const float* sin_table,
                               int64_t tokens, int max_positions) {
  // --- exercise 05.3: v1, one thread per pair ----------------------------------------------------------
  // Task: thread idx = blockIdx.x * blockDim.x + threadIdx.x rotates pair idx of the tokens * heads *
  //   half pairs of x: token t = idx / (heads * half), then head h and pair j within the token. Read
  //   cos/sin of row `pos` of the tables, rotate (x[j], x[j + half]) of that head with rotate_pair, and
  //   store both back as bf16. Row t of x starts at x + t * row_stride.
  // Hint: the launcher rounds the grid up: threads past the last pair must return.
  // Hint: clamp_position(positions[t], max_positions): a trusted position never reads outside the table.
  // Hint: rotate_pair uses __fmul_rn/__fsub_rn so nothing is fused: the result then equals the CPU's.
  // Tests: RopeGpu.V1MatchesTheCpuReference
  // Needs: 05.2
  // Stub: device
  // --- solution ---
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t per_token = static_cast<int64_t>(heads) * half;  // pairs per token
  if (idx >= tokens * per_token) return;
  const int64_t t = idx / per_token;
  const int pair = static_cast<int>(idx - t * per_token);  // h * half + j
  const int h = pair / half;
  const int j = pair - h * half;

  const int pos = clamp_position(positions[t], max_positions);
  const float c = cos_table[static_cast<int64_t>(pos) * half + j];
  const float s = sin_table[static_cast<int64_t>(pos) * half + j];

  __nv_bfloat16* head = x + t * row_stride + static_cast<int64_t>(h) * 2 * half;  // [2*half]
  const float a = __bfloat162float(head[j]);
  const float b = __bfloat162float(head[j + half]);
  float a_out, b_out;
  rotate_pair(a, b, c, s, a_out, b_out);
  head[j] = __float2bfloat16_rn(a_out);
  head[j + half] = __float2bfloat16_rn(b_out);
  // --- end of exercise 05.3 ---
}

// ---- v2 and v3: N consecutive pairs per thread, vector loads --------------------------------------
//
// A thread takes the N pairs j0 .. j0+N-1 of one head: x[j0 .. j0+N) and x[j0+half .. j0+half+N), two
// loads of 2N bytes (16 bytes for N = 8: one 128-bit instruction each), and the matching N cos and N sin.
// N is the largest of 8, 4, 2, 1 that divides half and keeps every access aligned (pick_vector_width).

template <int N>
struct alignas(N >= 4 ? 16 : 4 * N) F32Pack {  // N floats: 16-byte loads (two of them for N = 8)
  float v[N];
};

// The two halves of one thread's chunk, loaded and still unrotated.
template <int N>
struct Chunk {
  Pack<N> lo;  // x[j0 .. j0+N): N bf16, one load of 2N bytes
  Pack<N> hi;  // x[j0+half .. j0+half+N)
};

// Where work item `item` of token t lives: item = head * chunks + chunk, heads 0..q_heads-1 in q, then
// k's heads. Returns a pointer to x[j0] of that head.
[[maybe_unused]]
__device__ __forceinline__ __nv_bfloat16* locate(const RopeArgs& a, int64_t t, int item, int chunks, int n,
                                                 int& j0) {
  const int head = item / chunks;
  j0 = (item - head * chunks) * n;
  __nv_bfloat16* x = head < a.q_heads
                         ? a.q + t * a.q_row_stride + static_cast<int64_t>(head) * 2 * a.half
                         : a.k + t * a.k_row_stride + static_cast<int64_t>(head - a.q_heads) * 2 * a.half;
  return x + j0;
}

template <int N>
__device__ __forceinline__ Chunk<N> load_chunk(const __nv_bfloat16* x, int half) {
  Chunk<N> chunk;
  chunk.lo = load_pack<N>(x);
  chunk.hi = load_pack<N>(x + half);
  return chunk;
}

// Rotates a loaded chunk with cos/sin[j0 .. j0+N) and stores it back in place.
template <int N>
__device__ __forceinline__ void rotate_store(__nv_bfloat16* x, int half, Chunk<N> chunk, const float* cos_j,
                                             const float* sin_j) {
  const F32Pack<N> c = *reinterpret_cast<const F32Pack<N>*>(cos_j);
  const F32Pack<N> s = *reinterpret_cast<const F32Pack<N>*>(sin_j);
#pragma unroll
  for (int i = 0; i < N; ++i) {
    float a_out, b_out;
    rotate_pair(chunk.lo.get(i), chunk.hi.get(i), c.v[i], s.v[i], a_out, b_out);
    chunk.lo.set(i, a_out);
    chunk.hi.set(i, b_out);
  }
  store_pack<N>(x, chunk.lo);
  store_pack<N>(x + half, chunk.hi);
}

// v2: the block is (threads over the items of a token) x (a few tokens). q and k in ONE launch: the
// items of a token are its q heads' chunks followed by its k heads' chunks. cos/sin come from the table:
// every head of a token reads the same row, so after the first head it is an L1/L2 hit.
template <int N>
__global__ void rope_v2_kernel(RopeArgs a) {
  // --- exercise 05.4: v2, N pairs per thread, q and k in one launch ------------------------------------
  // Task: the block is blockDim.x threads over the items of one token times blockDim.y tokens (token
  //   t = blockIdx.x * blockDim.y + threadIdx.y). A token has (q_heads + k_heads) * (half / N) items,
  //   q's heads first; item i is the N pairs j0 .. j0 + N - 1 of one head. Each thread walks the items
  //   of its token in steps of blockDim.x: locate, load_chunk, rotate_store with row `pos` of the table.
  // Hint: locate(a, t, item, chunks, N, j0) returns &x[j0] of the item's head (q or k) and sets j0.
  // Hint: this kernel has no barrier: a thread past the last token may simply return.
  // Tests: RopeGpu.V2MatchesTheCpuReference
  // Needs: 05.2
  // Stub: device
  // --- solution ---
  const int chunks = a.half / N;                       // chunks per head
  const int items = (a.q_heads + a.k_heads) * chunks;  // chunks per token
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (t >= a.tokens) return;  // no barrier in this kernel: leaving early is fine
  const int pos = clamp_position(__ldg(a.positions + t), a.max_positions);
  const float* cos_row = a.cos + static_cast<int64_t>(pos) * a.half;  // [half]
  const float* sin_row = a.sin + static_cast<int64_t>(pos) * a.half;
  for (int item = static_cast<int>(threadIdx.x); item < items; item += static_cast<int>(blockDim.x)) {
    int j0;
    __nv_bfloat16* x = locate(a, t, item, chunks, N, j0);
    rotate_store<N>(x, a.half, load_chunk<N>(x, a.half), cos_row + j0, sin_row + j0);
  }
  // --- end of exercise 05.4 ---
}

// v3: no table. The block computes cos/sin of its own tokens with sincosf into shared memory, once per
// (token, pair), and every head of those tokens uses them. Each thread first STARTS loading its chunk,
// then does the trigonometry while the loads are in flight, then waits at the barrier.
//
// sincosf (without -use_fast_math) is accurate to 2 ulp over the whole float range: it reduces a large
// angle modulo 2 pi with enough bits of pi (a slow path above |x| ~ 1e5). __sincosf, the fast-math
// intrinsic, does no such reduction: its error grows with |x| and is useless at position 100,000.
template <int N>
__global__ void rope_v3_kernel(RopeArgs a) {
  // --- exercise 05.5: v3, cos and sin computed in shared memory ----------------------------------------
  // Task: v2 without the table. The block fills trig[] (dynamic shared memory: cos for its blockDim.y
  //   tokens x half pairs, then sin) with sincosf of the fp32 angle (float)pos * inv_freq[j], times
  //   a.attention_scaling, every thread of the block taking a share; one __syncthreads(); then rotate
  //   the items as v2 does, with cos/sin from shared memory. Start loading the first chunk before the
  //   trigonometry so the load is in flight meanwhile.
  // Hint: sincosf, not __sincosf: positions reach 131071 radians, and only the accurate one reduces
  //   such angles correctly (LargePositionsNeedAccurateSinCos).
  // Hint: threads of tokens past a.tokens still help fill the table and must reach the barrier.
  // Tests: RopeGpu.V3MatchesTheCpuReference RopeGpu.EveryVersionMatchesTheCpuReference
  // Tests: RopeGpu.LargePositionsNeedAccurateSinCos lesson05_rope.gpu
  // Needs: 05.1 05.2 05.3 05.4
  // Stub: device
  // --- solution ---
  extern __shared__ __align__(16) float trig[];      // [2][blockDim.y][half]: cos, then sin
  float* cos_s = trig;
  float* sin_s = trig + blockDim.y * a.half;
  const int chunks = a.half / N;
  const int items = (a.q_heads + a.k_heads) * chunks;
  const int64_t t_first = static_cast<int64_t>(blockIdx.x) * blockDim.y;  // the block's first token
  const int64_t t = t_first + threadIdx.y;
  const bool active = t < a.tokens;  // inactive threads still help with the table and reach the barrier

  // 1. Start this thread's first chunk loading (nothing below depends on it until step 3).
  int item = static_cast<int>(threadIdx.x);
  int j0 = 0;
  __nv_bfloat16* x = nullptr;
  Chunk<N> first{};
  if (active && item < items) {
    x = locate(a, t, item, chunks, N, j0);
    first = load_chunk<N>(x, a.half);
  }

  // 2. cos/sin for the block's tokens: blockDim.y * half angles, spread over all the block's threads.
  const int threads = static_cast<int>(blockDim.x * blockDim.y);
  const int angles = static_cast<int>(blockDim.y) * a.half;
  for (int e = static_cast<int>(threadIdx.y * blockDim.x + threadIdx.x); e < angles; e += threads) {
    const int row = e / a.half;
    const int j = e - row * a.half;
    float c = 1.0f, s = 0.0f;
    if (t_first + row < a.tokens) {
      const int pos = clamp_position(__ldg(a.positions + t_first + row), a.max_positions);
      // The same fp32 angle as the table and Hugging Face: (float)pos * theta_j, one rounding.
      const float angle = __fmul_rn(__int2float_rn(pos), __ldg(a.inv_freq + j));
      sincosf(angle, &s, &c);
      c = __fmul_rn(c, a.attention_scaling);
      s = __fmul_rn(s, a.attention_scaling);
    }
    cos_s[e] = c;
    sin_s[e] = s;
  }
  __syncthreads();

  // 3. Rotate: the prefetched chunk first, then any further items of this token.
  if (!active || item >= items) return;
  const float* cos_row = cos_s + threadIdx.y * a.half;
  const float* sin_row = sin_s + threadIdx.y * a.half;
  rotate_store<N>(x, a.half, first, cos_row + j0, sin_row + j0);
  for (item += static_cast<int>(blockDim.x); item < items; item += static_cast<int>(blockDim.x)) {
    x = locate(a, t, item, chunks, N, j0);
    rotate_store<N>(x, a.half, load_chunk<N>(x, a.half), cos_row + j0, sin_row + j0);
  }
  // --- end of exercise 05.5 ---
}

// The widest N in {8, 4, 2, 1} for which every chunk access is aligned: N divides half (so chunk starts,
// head starts and the second half are multiples of N elements), the row strides are multiples of N, and
// q and k start on a 2N-byte boundary. Table rows then start on 4N-byte boundaries (cudaMalloc gives 256).
int pick_vector_width(const RopeArgs& a) {
  for (int n : {8, 4, 2}) {
    if (a.half % n != 0 || a.q_row_stride % n != 0 || a.k_row_stride % n != 0) continue;
    if (reinterpret_cast<uintptr_t>(a.q) % (2 * n) != 0 || reinterpret_cast<uintptr_t>(a.k) % (2 * n) != 0) continue;
    return n;
  }
  return 1;
}

// Block shape for v2/v3: x covers the items of one token (a whole number of warps, at most 256 threads),
// y stacks tokens until the block has ~256 threads.
dim3 pick_block(int items) {
  const int x = std::min(256, (items + 31) / 32 * 32);
  const int y = std::max(1, 256 / x);
  return dim3(static_cast<unsigned>(x), static_cast<unsigned>(y));
}

template <int N>
void launch_vectorized(const RopeArgs& a, RopeKernel kernel, cudaStream_t stream) {
  const int items = (a.q_heads + a.k_heads) * (a.half / N);
  const dim3 block = pick_block(items);
  const int64_t blocks = (a.tokens + block.y - 1) / block.y;
  TVLLM_REQUIRE(blocks <= 0x7fffffff, "apply_rope: too many tokens for one launch");
  if (kernel == RopeKernel::V2) {
    rope_v2_kernel<N><<<static_cast<unsigned>(blocks), block, 0, stream>>>(a);
    TVLLM_CHECK_LAUNCH();
  } else {
    const size_t shared = 2 * static_cast<size_t>(block.y) * a.half * sizeof(float);
    TVLLM_REQUIRE(shared <= 48 * 1024, "apply_rope v3: head_dim " + std::to_string(2 * a.half) +
                                           " needs more than 48 KB of shared memory per block");
    rope_v3_kernel<N><<<static_cast<unsigned>(blocks), block, shared, stream>>>(a);
    TVLLM_CHECK_LAUNCH();
  }
}

void launch_v1(__nv_bfloat16* x, int64_t row_stride, int heads, const RopeArgs& a, cudaStream_t stream) {
  const int threads = 256;
  const int64_t work = a.tokens * heads * a.half;
  const int64_t blocks = (work + threads - 1) / threads;
  TVLLM_REQUIRE(blocks <= 0x7fffffff, "apply_rope: too many tokens for one launch");
  rope_v1_kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(x, row_stride, heads, a.half, a.positions,
                                                                        a.cos, a.sin, a.tokens, a.max_positions);
  TVLLM_CHECK_LAUNCH();
}

}  // namespace

void apply_rope_cuda(const TensorView& q, const TensorView& k, const TensorView& positions, const RopeTable& table,
                     const RopeShape& shape, RopeKernel kernel, cudaStream_t stream) {
  RopeArgs a{};
  a.q = q.ptr<__nv_bfloat16>();
  a.k = k.ptr<__nv_bfloat16>();
  a.q_row_stride = shape.q_row_stride;
  a.k_row_stride = shape.k_row_stride;
  a.positions = positions.ptr<int32_t>();
  a.cos = table.cos(Device::CUDA).ptr<float>();
  a.sin = table.sin(Device::CUDA).ptr<float>();
  a.inv_freq = table.inv_freq_view(Device::CUDA).ptr<float>();
  a.tokens = shape.tokens;
  a.q_heads = static_cast<int>(shape.q_heads);
  a.k_heads = static_cast<int>(shape.k_heads);
  a.half = static_cast<int>(shape.head_dim / 2);
  a.max_positions = static_cast<int>(table.max_positions());
  a.attention_scaling = table.attention_scaling();
  TVLLM_REQUIRE(shape.q_heads + shape.k_heads <= (int64_t{1} << 20), "apply_rope: too many heads");

  switch (kernel) {
    case RopeKernel::V1:
      launch_v1(a.q, a.q_row_stride, a.q_heads, a, stream);
      launch_v1(a.k, a.k_row_stride, a.k_heads, a, stream);
      return;
    case RopeKernel::V2:
    case RopeKernel::V3:
      switch (pick_vector_width(a)) {
        case 8: launch_vectorized<8>(a, kernel, stream); return;
        case 4: launch_vectorized<4>(a, kernel, stream); return;
        case 2: launch_vectorized<2>(a, kernel, stream); return;
        default: launch_vectorized<1>(a, kernel, stream); return;
      }
  }
  throw InputError("apply_rope: unknown kernel version");
}

}  // namespace rope_detail
}  // namespace tvllm
