// Lesson 14: the GEMV's in-warp reduction of many sums at once (a reduce-scatter), the same bits as warp_sum.
//
// Included by gemv.cu inside its anonymous namespace (it uses kWarp).
#pragma once

// ---- the block's reduction: V sums per thread, one total each ------------------------------------------
// warp_sum on each of V values costs 5 V shuffles; with V = 4 rows x 16 inputs = 64 that is 320 per warp,
// as much time as the loads at K = 2048. A reduce-scatter does the same butterfly (offsets 16, 8, 4, 2, 1,
// each lane adding its partner's value), but at each step a lane keeps only half of its values and sends
// its partner the other half: V/2 + V/4 + ... shuffles (62 for V = 64). Every total is combined by the
// same tree as warp_sum's, so it is the same bits, whatever V (and so M) is.
// Afterwards, V >= 32: lane L holds values L * (V/32) + j in v[j]; V < 32: v[0] holds value L >> (5 - log2 V).
template <int kCount, int kOffset, int V>
__device__ __forceinline__ void reduce_scatter_step(float (&v)[V], int lane) {
  if constexpr (kOffset > 0) {
    if constexpr (kCount > 1) {
      constexpr int kHalf = kCount / 2;
      const bool upper = (lane & kOffset) != 0;  // this lane keeps the upper half of its values
#pragma unroll
      for (int i = 0; i < kHalf; ++i) {
        const float keep = upper ? v[kHalf + i] : v[i];
        const float give = upper ? v[i] : v[kHalf + i];
        v[i] = keep + __shfl_xor_sync(0xffffffffu, give, kOffset);
      }
      reduce_scatter_step<kHalf, kOffset / 2>(v, lane);
    } else {
      v[0] += __shfl_xor_sync(0xffffffffu, v[0], kOffset);  // one value left: plain butterfly
      reduce_scatter_step<1, kOffset / 2>(v, lane);
    }
  }
}

constexpr int log2_of(int v) { return v <= 1 ? 0 : 1 + log2_of(v / 2); }

// Sums v[0..V) over the warp and stores total i in slots[i] (one lane writes each). V: a power of two.
template <int V>
__device__ __forceinline__ void warp_sums_to(float (&v)[V], float* slots, int lane) {
  reduce_scatter_step<V, kWarp / 2>(v, lane);
  if constexpr (V >= kWarp) {
#pragma unroll
    for (int j = 0; j < V / kWarp; ++j) slots[lane * (V / kWarp) + j] = v[j];
  } else {
    constexpr int kShift = 5 - log2_of(V);
    if ((lane & ((1 << kShift) - 1)) == 0) slots[lane >> kShift] = v[0];
  }
}
