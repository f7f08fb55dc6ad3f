// Lesson 15: the two bit-level layouts Hopper's tensor cores read, as plain functions the CPU can test.
//
//   1. The 128-byte swizzle: where element (row, col) of a tile lands in shared memory when TMA writes it
//   with
//      CU_TENSOR_MAP_SWIZZLE_128B, and where wgmma expects it (the two agree: that is the point).
//   2. The shared-memory matrix descriptor: the 64-bit word that tells wgmma where an operand tile lives in
//      shared memory and how it is laid out.
//
// README.md ("The swizzle" and "The descriptor") has the pictures. Everything here is constexpr, for the host
// (the CPU oracles and tests) and the device (the kernels). C++17: .cu files include it.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define TVLLM_HOST_DEVICE __host__ __device__
#else
#define TVLLM_HOST_DEVICE
#endif

namespace tvllm {

// ---- the 128-byte swizzle --------------------------------------------------------------------------------
// Shared memory has 32 banks of 4 bytes: the 128 bytes of one "bank row". A tile whose rows are 128 bytes
// long puts column c of EVERY row in the same bank, so eight threads reading one 16-byte column chunk of
// eight rows collide eight ways. The swizzle moves the sixteen-byte chunk j of row r to chunk j XOR (r mod
// 8): eight consecutive rows now spread any one chunk over all eight chunk positions, conflict-free for the
// tensor cores and for us. In address bits (offsets from a 1024-byte aligned base): bits 4-6 (which 16-byte
// chunk) are XORed with bits 7-9 (which 128-byte row, mod 8). The pattern repeats every 8 rows = 1024 bytes,
// which is why every swizzled tile in this lesson starts at a multiple of 1024 bytes.
inline constexpr uint32_t kSwizzleBytes = 128;       // one row of the pattern
inline constexpr uint32_t kSwizzleAtomBytes = 1024;  // 8 rows: the period of the pattern

TVLLM_HOST_DEVICE constexpr uint32_t swizzle128(uint32_t byte_offset) {
  return byte_offset ^ (((byte_offset >> 7) & 7u) << 4);
}

// The byte offset of element (row, col) of a tile of 2-byte elements with 64 per row (128 bytes), as TMA
// writes it with the 128-byte swizzle, from the tile's 1024-byte aligned start.
TVLLM_HOST_DEVICE constexpr uint32_t swizzled_offset_bf16(uint32_t row, uint32_t col) {
  return swizzle128(row * kSwizzleBytes + col * 2u);
}

// ---- the wgmma shared-memory matrix descriptor ------------------------------------------------------------
// wgmma reads its A and B operands from shared memory through one 64-bit descriptor each (PTX ISA, "Matrix
// Descriptor Format" of the warpgroup-level MMA):
//
//   bits  0-13  start address >> 4        (shared memory is < 256 KB, and addresses are 16-byte aligned)
//   bits 16-29  leading byte offset >> 4  (LBO: between core matrices adjacent in K)
//   bits 32-45  stride byte offset >> 4   (SBO: between core matrices adjacent in M or N)
//   bits 49-51  base offset               (0 when the tile starts on a swizzle-pattern boundary, as ours do)
//   bits 62-63  swizzle mode              (0 none, 1 = 128-byte, 2 = 64-byte, 3 = 32-byte)
//
// A "core matrix" is 8 rows of 16 bytes (8 x 8 bf16). For a K-major tile with the 128-byte swizzle (each row
// of the tile holds 64 consecutive K values = 128 bytes) the 8-row groups sit 1024 bytes apart: SBO = 1024.
// The 16 K values one wgmma consumes (32 bytes) lie inside one swizzled row, so LBO is not used by the
// hardware in this mode; we set it to 1 (the conventional placeholder). Stepping K by 16 inside the tile is
// adding 32 bytes to the start address: the hardware applies the swizzle to the addresses it forms, so the
// XOR pattern stays right as long as the tile itself starts on a 1024-byte boundary.
enum class DescriptorSwizzle : uint32_t { None = 0, B128 = 1, B64 = 2, B32 = 3 };

TVLLM_HOST_DEVICE constexpr uint64_t encode_smem_descriptor(uint32_t smem_address,
                                                            uint32_t leading_byte_offset,
                                                            uint32_t stride_byte_offset,
                                                            DescriptorSwizzle swizzle) {
  return (uint64_t{(smem_address >> 4) & 0x3FFFu}) | (uint64_t{(leading_byte_offset >> 4) & 0x3FFFu} << 16) |
         (uint64_t{(stride_byte_offset >> 4) & 0x3FFFu} << 32) |
         (uint64_t{static_cast<uint32_t>(swizzle) & 3u} << 62);
}

// The descriptor of a K-major bf16 tile with the 128-byte swizzle at shared address `smem_address` (a
// multiple of 1024), advanced by `k16` steps of 16 K values (32 bytes: 2 in the start-address field).
TVLLM_HOST_DEVICE constexpr uint64_t sw128_kmajor_descriptor(uint32_t smem_address, uint32_t k16 = 0) {
  return encode_smem_descriptor(smem_address + k16 * 32u, 16u, kSwizzleAtomBytes, DescriptorSwizzle::B128);
}

// The descriptor of an MN-MAJOR bf16 operand with the 128-byte swizzle: the N index is the contiguous one.
// That is V [keys][dims] when P V reads it as B [dims][keys] (wgmma's "transposed B"). The PTX ISA's
// canonical MN-major 128-byte layout: each 128-byte row holds 64 consecutive N values at one K; 8 rows (K)
// form the 1024-byte atom; then
//   LBO  bytes from one 64-wide N block to the next (our V tile keeps dims 64..127 in a second sub-tile),
//   SBO  bytes from one group of 8 K rows to the next (the next atom: 1024).
// Stepping K by 16 is two atoms: 2048 bytes added to the start address (k16 below).
TVLLM_HOST_DEVICE constexpr uint64_t sw128_mnmajor_descriptor(uint32_t smem_address, uint32_t n_block_bytes,
                                                              uint32_t k16 = 0) {
  return encode_smem_descriptor(smem_address + k16 * 2u * kSwizzleAtomBytes, n_block_bytes, kSwizzleAtomBytes,
                                DescriptorSwizzle::B128);
}

// ---- the ring of stages ---------------------------------------------------------------------------------
// A pipeline (the GEMM's, flash attention's) cycles through `stages` shared-memory buffers: load i uses
// buffer i % stages in round i / stages. Each buffer has a "full" mbarrier (the data has landed) and an
// "empty" one (the consumers are done with it), and each completes one phase per round. So the consumers of
// load i wait for full's phase of parity round & 1, and the producer, before reusing the buffer, waits for
// the PREVIOUS round's empty phase: parity (round & 1) ^ 1, which a fresh barrier passes at once in round 0
// (README: the phase bit).
struct RingSlot {
  uint32_t stage;         // which buffer
  uint32_t full_parity;   // consumers: wait full[stage] with this parity
  uint32_t empty_parity;  // producer: wait empty[stage] with this parity before refilling it
};
TVLLM_HOST_DEVICE constexpr RingSlot ring_slot(uint32_t i, uint32_t stages) {
  const uint32_t round_parity = (i / stages) & 1u;
  return {i % stages, round_parity, round_parity ^ 1u};
}

// ---- GEMM v2's tile order ------------------------------------------------------------------------------
// A persistent GEMM numbers its output tiles 0 .. tiles_m * tiles_n - 1 and hands them out round-robin to the
// blocks (block b takes b, b + grid, b + 2 grid, ...). Which tile a number names decides what the blocks
// running at the same moment share in L2. Row by row ("tile t is row t / tiles_n") puts a whole row of tiles
// side by side: they share one panel of x but each wants its own panel of W. Grouped order walks DOWN a
// band of `group_m` tile rows before it moves one tile column right:
//
//   group_m = 2, tiles_m = 5, tiles_n = 3        n: 0   1   2
//                                          m 0:    0   2   4      band 0 (rows 0-1)
//                                            1:    1   3   5
//                                            2:    6   8  10      band 1 (rows 2-3)
//                                            3:    7   9  11
//                                            4:   12  13  14      band 2: the last band is shorter
//
// so the tiles in flight together cover a few columns of W (each W panel read by group_m blocks at about the
// same time: one DRAM read, the rest L2 hits) and a band of x that stays in L2 while the band is worked on.
struct GemmTile {
  uint32_t m, n;  // tile row and tile column
};
TVLLM_HOST_DEVICE constexpr GemmTile grouped_tile(uint32_t tile, uint32_t tiles_m, uint32_t tiles_n,
                                                  uint32_t group_m) {
  const uint32_t per_band = group_m * tiles_n;
  const uint32_t band = tile / per_band;
  const uint32_t first_m = band * group_m;
  const uint32_t rows = tiles_m - first_m < group_m ? tiles_m - first_m : group_m;  // the last band's height
  const uint32_t in_band = tile - band * per_band;
  return {first_m + in_band % rows, in_band / rows};
}

// ---- the wgmma accumulator fragment -----------------------------------------------------------------------
// After wgmma m64nNk16 with an fp32 accumulator, thread t (0..127) of the warpgroup holds N/2 floats d[i].
// Warp w = t / 32 owns rows 16w .. 16w + 15; inside a warp the layout of every 8-column slice j = i / 4 is
// mma.sync's m16n8 accumulator (lesson 06, v4): lane l holds rows l/4 and l/4 + 8, columns 2(l%4) and +1.
struct FragmentPosition {
  uint32_t row, col;
};
TVLLM_HOST_DEVICE constexpr FragmentPosition accumulator_position(uint32_t thread, uint32_t i) {
  const uint32_t warp = thread / 32, lane = thread % 32;
  return {16u * warp + lane / 4u + 8u * ((i / 2u) % 2u), 8u * (i / 4u) + 2u * (lane % 4u) + (i % 2u)};
}

// The A operand of wgmma from REGISTERS (m64 x k16, bf16): thread t holds 8 values in 4 32-bit registers,
// value j (register j / 2, low half first). Warp w again owns rows 16w .. 16w + 15, and inside a warp it is
// mma.sync's m16n8k16 A fragment: values 0-1 at (row l/4, cols 2(l%4), +1), 2-3 at row + 8, 4-5 at cols + 8,
// 6-7 at row + 8 and cols + 8.
TVLLM_HOST_DEVICE constexpr FragmentPosition a_fragment_position(uint32_t thread, uint32_t j) {
  const uint32_t warp = thread / 32, lane = thread % 32;
  return {16u * warp + lane / 4u + 8u * ((j / 2u) % 2u), 8u * (j / 4u) + 2u * (lane % 4u) + (j % 2u)};
}
// Why flash attention on wgmma can feed P straight from registers: value j of the A fragment of K step kk
// (columns 16kk .. 16kk + 15) sits where accumulator register 8kk + j of S = Q K^T sits. So the A fragment
// of step kk is S's registers 8kk .. 8kk + 7, rounded to bf16 and packed in pairs; no data moves between
// threads. (The CPU test checks the identity for every thread, register and step.)
TVLLM_HOST_DEVICE constexpr uint32_t accumulator_register_for_a(uint32_t kk, uint32_t j) {
  return 8u * kk + j;
}

}  // namespace tvllm
