// Lesson 14: GEMV v4, tensor cores for 2..16 rows (README section 5, "Past one row: tensor cores").
//
// Included by gemv.cu inside its anonymous namespace: it uses that file's Pack loads, V3Args, Prologue, Tile,
// Store and the PDL helpers, and its launchers are called from there.
//
// Why v3 stops paying at M > 1. v3 multiplies each 16-byte pack of W into M sums with scalar FMAs: per pack
// 8 M FMAs and M loads of x, all in the same registers that hold the loads in flight. At M = 8 the math and the
// register pressure cut the bytes in flight, and cuBLAS (a tiled GEMM) wins from M = 2 (the crossover table).
//
// v4 hands the math to the tensor cores. One mma.sync m16n8k16 multiplies a 16 x 16 tile of W by a 16 x 8 tile
// of x^T: 16 weight rows x 8 tokens x 16 columns in one instruction, whatever M <= 8 is (16: two of them). The
// weights are still read exactly once, in 16-byte loads, so the kernel stays a memory-bound stream; M only
// decides how many of the 8 token columns hold real rows.
//
// The trick that keeps the 16-byte loads. The mma wants lane (g = lane / 4, q = lane % 4) to hold columns
// {2q, 2q+1, 2q+8, 2q+9} of rows g and g + 8 of the A tile (common/mma.cuh), i.e. 4-byte pieces scattered
// over the row. But a dot product does not care in which order its columns are visited, as long as A and B
// visit them in the SAME order. So we relabel: in a 32-column step, lane q's 16-byte pack (columns 8q .. 8q+7
// of the step) plays the mma's columns {2q, 2q+1, 2q+8, 2q+9} in the first mma and the same four of the second:
//
//     physical columns  8q+0 8q+1 | 8q+2 8q+3 | 8q+4 8q+5 | 8q+6 8q+7
//     mma #1 columns    2q   2q+1 | 2q+8 2q+9 |
//     mma #2 columns                          | 2q   2q+1 | 2q+8 2q+9
//
// and the x operand (B: columns 2q..2q+1 and 2q+8..2q+9 of token g) is loaded with the same relabelling: lane
// (g, q) loads token g's 16-byte pack at the same physical columns. Each lane issues one 16-byte load of W row
// g, one of row g + 8 and one of x per 32 columns: the whole warp reads 16 rows x 64 bytes, fully used.
//
// The shape of a launch, from N and K only (never M, so no output's summation order depends on M):
//   a block owns one 16-row tile (Rows: rows 16b .. 16b+15; GateUp: outputs 8b .. 8b+7, whose gate rows are the
//   tile's rows 0..7 and whose up rows are rows 8..15, so a lane holds the gate AND the up sum of its output);
//   its warps split K into equal runs of whole 32-column steps, each warp keeping 8 steps of loads in flight
//   (256 bytes per lane); the warps' partial tiles meet in shared memory, added in warp order.
// Rounding and the fused prologue / epilogues are v3's (gemv.h): only the fp32 summation order differs.
//
// Measured on the H200 (README section 4): v4 reads W at 42-45% of the copy bandwidth at every M from 1 to 8 (it
// does not fall with M, as v3 does), but cuBLAS reaches ~61% on the same shapes, so neither the fused decode path
// nor gemv()'s default uses it: gemv(..., GemvKernel::V4TensorCore) runs it, for the lesson's table. Its fused
// variants (norm prologue, gate|up tile) were checked against the CPU references on the H200 while they were in
// use (the same tests as v3's), and are kept for the exercise that makes v4 faster.

constexpr int kV4Step = 32;       // columns of K per step: 4 lanes (q) x 8 bf16
constexpr int kV4Unroll = 8;      // steps whose weights a lane has in flight: 8 x 2 packs x 16 B = 256 B
constexpr int kV4MaxWarps = 16;   // K = 8192 (256 steps): 16 warps of 16 steps

struct V4Shape {
  int warps = 0;
  int64_t steps_per_warp = 0;
  int64_t blocks = 0;
};

V4Shape gemv_v4_shape_of(int64_t tiles, int64_t K) {
  V4Shape s;
  const int64_t steps = ceil_div(K, kV4Step);
  s.warps = static_cast<int>(std::clamp<int64_t>(ceil_div(steps, kV4Unroll), 1, kV4MaxWarps));
  s.steps_per_warp = ceil_div(steps, s.warps);
  s.blocks = tiles;
  return s;
}

// kNT: 8-token column tiles (1: M <= 8, 2: M <= 16).
template <int kNT, Prologue kPrologue, Tile kTile>
__global__ void __launch_bounds__(kV4MaxWarps * kWarp) gemv_v4_kernel(V3Args a, int64_t steps_per_warp) {
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int g = lane / 4, q = lane % 4;  // the mma's row group and column pair (common/mma.cuh)
  const int warps = blockDim.x / kWarp;

  // This lane's two weight rows: tile rows g and g + 8.
  int64_t row_lo, row_hi;
  bool ok_lo, ok_hi;
  if constexpr (kTile == Tile::GateUp) {
    const int64_t j = 8 * static_cast<int64_t>(blockIdx.x) + g;  // output column j: gate row j, up row I + j
    ok_lo = ok_hi = j < a.outputs;
    row_lo = j;
    row_hi = a.outputs + j;
  } else {
    row_lo = 16 * static_cast<int64_t>(blockIdx.x) + g;
    row_hi = row_lo + 8;
    ok_lo = row_lo < a.N;
    ok_hi = row_hi < a.N;
  }
  const bf16* w_lo = static_cast<const bf16*>(a.w) + (ok_lo ? row_lo : 0) * a.K;
  const bf16* w_hi = static_cast<const bf16*>(a.w) + (ok_hi ? row_hi : 0) * a.K;
  const int64_t steps = ceil_div(a.K, kV4Step);
  const int64_t s_begin = warp * steps_per_warp;
  const int64_t s_end = s_begin + steps_per_warp < steps ? s_begin + steps_per_warp : steps;

  // The first kV4Unroll steps' weights, loaded before waiting for the previous kernel (pdl.cuh): weights are
  // never written during a step.
  Pack<8> wl[kV4Unroll], wh[kV4Unroll];
  const auto load_steps = [&](int64_t s0) {
#pragma unroll
    for (int u = 0; u < kV4Unroll; ++u) {
      const int64_t col = (s0 + u) * kV4Step + 8 * q;
      const bool in = s0 + u < s_end && col < a.K;
      wl[u] = in && ok_lo ? load_weights(w_lo + col) : Pack<8>{};
      wh[u] = in && ok_hi ? load_weights(w_hi + col) : Pack<8>{};
    }
  };
  load_steps(s_begin);
  pdl_wait_for_previous_kernel();  // from here on: reads of x / h, and every write
  pdl_let_next_kernel_start();

  constexpr int kMaxM = 8 * kNT;
  __shared__ float inv_rms[kMaxM];
  __shared__ float partial[kV4MaxWarps][kWarp][4 * kNT];
  if constexpr (kPrologue == Prologue::RmsNorm) {
    // v3's prologue: each block sums the squares of the M rows of h (thread t: packs t, t + blockDim, ...;
    // then the warps' sums in warp order).
    const int64_t packs = a.K / 8;
    for (int m = 0; m < a.M; ++m) {
      float sum_sq = 0.f;
      for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
        const Pack<8> hv = load_pack<8>(a.x + m * a.K + p * 8);
#pragma unroll
        for (int i = 0; i < 8; ++i) sum_sq = __fmaf_rn(hv.get(i), hv.get(i), sum_sq);
      }
      sum_sq = warp_sum(sum_sq);
      if (lane == 0) partial[warp][m][0] = sum_sq;  // partial[w][m][0] is free until the main loop ends
    }
    __syncthreads();
    if (threadIdx.x < a.M) {
      float total = 0.f;
      for (int w = 0; w < warps; ++w) total += partial[w][threadIdx.x][0];
      inv_rms[threadIdx.x] = rsqrtf(total / static_cast<float>(a.K) + a.eps);
    }
    __syncthreads();
  }

  // The main loop: per step, per 8-token tile, two mmas over this lane's 16 bytes of rows g and g + 8.
  float acc[kNT][4] = {};
  for (int64_t s0 = s_begin; s0 < s_end; s0 += kV4Unroll) {
    if (s0 != s_begin) load_steps(s0);
#pragma unroll
    for (int u = 0; u < kV4Unroll; ++u) {
      if (s0 + u >= s_end) break;  // the same for the whole warp
      const int64_t col = (s0 + u) * kV4Step + 8 * q;
      Pack<8> gv{};
      if constexpr (kPrologue == Prologue::RmsNorm)
        if (col < a.K) gv = load_pack<8>(a.g + col);
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        const int m = nt * 8 + g;  // the token this lane feeds into the B operand
        Pack<8> xv{};
        if (m < a.M && col < a.K) {
          const Pack<8> raw = load_pack<8>(a.x + m * a.K + col);
          if constexpr (kPrologue == Prologue::RmsNorm) {
            // Lesson 04's rounding, as v3: bf16(h * inv_rms), times the weight, rounded to bf16 again.
#pragma unroll
            for (int i = 0; i < 8; ++i)
              xv.set(i, bf16_bits_to_f32(f32_to_bf16_bits(raw.get(i) * inv_rms[m])) * gv.get(i));
          } else {
            xv = raw;
          }
        }
        const uint32_t a1[4] = {wl[u].word[0], wh[u].word[0], wl[u].word[1], wh[u].word[1]};
        mma_bf16_16x8x16(acc[nt], a1, xv.word[0], xv.word[1]);
        const uint32_t a2[4] = {wl[u].word[2], wh[u].word[2], wl[u].word[3], wh[u].word[3]};
        mma_bf16_16x8x16(acc[nt], a2, xv.word[2], xv.word[3]);
      }
    }
  }

  // The warps' partial tiles, added in warp order by warp 0. acc[nt][0..1] = (row g, tokens 8nt + 2q, +1),
  // acc[nt][2..3] = (row g + 8, the same tokens).
  __syncthreads();  // the prologue's use of partial is over
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) partial[warp][lane][nt * 4 + i] = acc[nt][i];
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt) {
    float total[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float s = 0.f;
      for (int w = 0; w < warps; ++w) s += partial[w][lane][nt * 4 + i];
      total[i] = s;
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int m = nt * 8 + 2 * q + half;
      if (m >= a.M) continue;
      if constexpr (kTile == Tile::GateUp) {
        if (ok_lo) store_silu_mul(a, m * a.outputs + row_lo, total[half], total[2 + half]);  // gate row g, up g + 8
      } else {
        if (ok_lo) store_output(a, m * a.outputs + row_lo, total[half]);
        if (ok_hi) store_output(a, m * a.outputs + row_hi, total[2 + half]);
      }
    }
  }
}

template <Prologue kPrologue, Tile kTile>
void launch_v4(const V3Args& a, cudaStream_t stream, bool pdl) {
  require_tensor_core_device("gemv v4 (mma.sync)");
  const int64_t tiles = kTile == Tile::GateUp ? ceil_div(a.outputs, 8) : ceil_div(a.N, 16);
  const V4Shape s = gemv_v4_shape_of(tiles, a.K);
  TVLLM_REQUIRE(s.blocks < (int64_t{1} << 31), "gemv v4: too many rows for one launch");
  const dim3 grid(static_cast<unsigned>(s.blocks)), block(static_cast<unsigned>(s.warps * kWarp));
  if (a.M <= 8)
    launch_kernel(gemv_v4_kernel<1, kPrologue, kTile>, grid, block, stream, pdl, a, s.steps_per_warp);
  else
    launch_kernel(gemv_v4_kernel<2, kPrologue, kTile>, grid, block, stream, pdl, a, s.steps_per_warp);
}
