// Lesson 15: Hopper's new instructions as small, documented device functions (inline PTX).
//
// Read with README.md. Five groups, in the order the chapter meets them:
//   shared addresses    smem_address()
//   mbarriers           mbarrier_init / _arrive / _arrive_expect_tx / _try_wait / _wait, and the two fences
//   TMA                 tma_load_2d (cp.async.bulk.tensor), prefetch_tensor_map; for GEMM v2 tma_store_2d,
//                       bulk_commit_group, bulk_wait_group_read / bulk_wait_group
//   wgmma               wgmma_fence / _commit_group / _wait_group / wgmma_m64n128k16 (v2: m64n256k16),
//                       fence_accumulators,
//                       and with A from registers: wgmma_m64n64k16_rs / wgmma_m64n128k16_rs, fence_operands
//   warp specialisation setmaxnreg_inc / setmaxnreg_dec, named_barrier_sync / _arrive
//   clusters            cluster_rank / cluster_size / cluster_sync / map_to_rank / load_from_cluster
//
// wgmma and setmaxnreg are "arch-specific" instructions of sm_90a: they exist on compute capability 9.0
// exactly (H100, H200) and the code must be compiled for sm_90a (lessons/15_hopper/CMakeLists.txt does it).
// The compiler defines __CUDA_ARCH_FEAT_SM90_ALL in that compilation and only there; TVLLM_HOPPER_DEVICE is 1
// exactly then, and every kernel of this lesson compiles its body only under it (elsewhere: an empty stub
// that the host code never launches, see hopper_available()). Include from .cu files only. C++17.
#pragma once

#include <cuda.h>  // the CUtensorMap type only: nothing in this lesson links the driver library
#include <cuda_runtime.h>

#include <cstdint>

#include "hopper_layout.h"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define TVLLM_HOPPER_DEVICE 1
#else
#define TVLLM_HOPPER_DEVICE 0
#endif

namespace tvllm {

#if TVLLM_HOPPER_DEVICE

// ---- shared addresses ------------------------------------------------------------------------------------
// PTX instructions that name shared memory want a 32-bit address in the shared window, not the 64-bit generic
// pointer C++ hands around. cvta converts one to the other.
__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Dynamic shared memory is only 16-byte aligned, and a 128-byte swizzled tile must start on a 1024-byte
// boundary (the pattern's period): the first such address at or after p. Allocate kSwizzleAtomBytes extra.
__device__ __forceinline__ unsigned char* align_to_swizzle_atom(unsigned char* p) {
  const uint32_t misalignment = smem_address(p) & (kSwizzleAtomBytes - 1);
  return p + (misalignment == 0 ? 0 : kSwizzleAtomBytes - misalignment);
}

// ---- mbarriers --------------------------------------------------------------------------------------------
// An mbarrier is a 64-bit object in shared memory that counts two things for its CURRENT PHASE:
//   arrivals      threads that said "I am done" (mbarrier.arrive), expected: the count given to init;
//   transactions  bytes an asynchronous copy still has to deliver (expect_tx adds, a TMA copy's complete_tx
//                 subtracts as its bytes land).
// When both reach zero the phase completes: the barrier's phase bit flips (0 -> 1 -> 0 ...) and the counts
// reset for the next phase. A waiter names the parity of the phase it waits for: "wait until phase with
// parity P has completed". So a loop over a ring of S buffers waits with parity (round & 1), round = k / S.
//
//   phase:     0            1            0            1
//   parity:  ---- done --> ---- done --> ---- done --> ...
//
// Waiting for parity 1 on a fresh barrier (phase 0 in progress) returns at once: the "phase before the first"
// counts as complete. Producers use that to pass their first round over the ring without waiting.

// One thread initialises the barrier before anyone uses it: `arrivals` arrivals complete each phase.
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_address(bar)), "r"(arrivals) : "memory");
}

// After the inits, before the __syncthreads that publishes them. Two fences: fence.mbarrier_init releases the
// initialised barriers to the other threads of the cluster; fence.proxy.async makes them visible to the
// asynchronous proxy too (the TMA unit is not a thread: it does not see ordinary shared-memory writes without
// that fence, and its complete_tx must find a barrier that is already initialised).
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n fence.proxy.async.shared::cta;" ::: "memory");
}

// Orders this thread's ordinary (generic-proxy) shared-memory accesses before later accesses by the async
// proxy (TMA, wgmma) and the other way round. Needed when threads write shared memory that TMA or wgmma then
// reads.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// "I am done with this phase": one arrival, with release semantics (my earlier memory accesses happen before
// whatever the waiter does after its wait).
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_address(bar)) : "memory");
}

// One arrival that also announces `bytes` of transactions to come: the phase completes only when a TMA copy
// has delivered that many bytes to the barrier (complete_tx). The producer calls it right before the copies.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_address(bar)), "r"(bytes)
               : "memory");
}

// One test: true once the phase with parity `parity` has completed (with acquire semantics: what the arrivers
// and the copy wrote is visible after it). try_wait may also sleep a little inside the hardware before saying
// no, which is why we prefer it to the pure test (mbarrier.test_wait) in a spin loop.
__device__ __forceinline__ bool mbarrier_try_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n"
      "  .reg .pred p;\n"
      "  mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "  selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(done)
      : "r"(smem_address(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

// Spins until the phase with parity `parity` has completed. A wait that never ends is the worst way a GPU
// test can fail (the process hangs until someone kills it), and a lost copy or a wrong byte count would cause
// exactly that; so after kMbarrierTimeoutNs of waiting the thread traps: the launch fails, and the host's
// TVLLM_CUDA_CHECK reports it. No correct wait of this lesson comes anywhere near that long.
inline constexpr uint64_t kMbarrierTimeoutNs = 10'000'000'000ull;  // 10 s

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  if (mbarrier_try_wait(bar, parity)) return;
  const uint64_t start = global_timer_ns();
  while (!mbarrier_try_wait(bar, parity))
    if (global_timer_ns() - start > kMbarrierTimeoutNs) __trap();
}

// ---- TMA: the tensor memory accelerator -------------------------------------------------------------------
// One thread hands the TMA unit a tensor map (made on the host: the matrix's address, sizes, strides, the
// box to copy and the swizzle; tensor_map.h) and the box's coordinates. The unit computes every address
// itself, copies the whole box global -> shared, writes zeros for the parts of the box outside the matrix
// (negative coordinates too), and reports the bytes to the mbarrier. No thread spends registers or
// instructions on addresses: that is what frees the warps of an Ampere kernel's cp.async loops.
//
// x is the INNER coordinate (the column, the contiguous dimension), y the row: the order of the tensor map's
// dimensions. dst must be 128-byte aligned (1024 with the 128-byte swizzle). The map must live in kernel
// parameter space (a `const __grid_constant__ CUtensorMap` parameter) or global memory.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, int32_t x, int32_t y,
                                            uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
      "[%4];" ::"r"(smem_address(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(smem_address(bar))
      : "memory");
}

// The TMA STORE, shared -> global: the box of `map` at (x, y) is written from the tile at `src` (laid out as
// the map's swizzle says, like a load's destination). Parts of the box outside the matrix are NOT written:
// the unit clips them, which is how GEMM v2's edge tiles store without a guard. No mbarrier: a store belongs
// to the issuing thread's "bulk group" (bulk_commit_group), and the thread waits for its groups with
// bulk_wait_group_read (the shared source may be overwritten) or bulk_wait_group (the writes are done).
// Before the store, the threads that wrote `src` must fence_proxy_async_shared() and then synchronise with
// the issuing thread: their generic-proxy writes must be visible to the async proxy (the TMA unit).
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, const void* src, int32_t x, int32_t y) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(smem_address(src)), "r"(x), "r"(y)
               : "memory");
}

// Closes this thread's TMA stores issued since the last commit into one bulk group.
__device__ __forceinline__ void bulk_commit_group() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Waits until at most kGroupsInFlight of this thread's bulk groups still READ their shared-memory source
// (the global writes may still be on their way): from then on the older groups' buffers may be refilled.
template <int kGroupsInFlight>
__device__ __forceinline__ void bulk_wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kGroupsInFlight) : "memory");
}

// Waits until at most kGroupsInFlight of this thread's bulk groups are still running at all (the global
// writes are done too). A kernel waits for 0 before it exits, so no store still reads a dead block's shared
// memory.
template <int kGroupsInFlight>
__device__ __forceinline__ void bulk_wait_group() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(kGroupsInFlight) : "memory");
}

// Fetches the 128-byte tensor map into the TMA unit's cache ahead of the first copy (optional, a latency
// win).
__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// ---- wgmma: warpgroup MMA from shared memory --------------------------------------------------------------
// A warpgroup is 4 consecutive warps (128 threads, the first warp's index a multiple of 4). Together they
// issue one wgmma.mma_async: D[64 x N] += A[64 x 16] * B[N x 16]^T, A and B read straight from shared memory
// through their descriptors (hopper_layout.h), D in registers spread over the 128 threads
// (accumulator_position()). It is ASYNCHRONOUS: the instruction returns before the tensor cores finish, so
// the sequence is
//
//   wgmma_fence();            // registers and shared memory written before this are seen by the MMAs
//   wgmma_m64n128k16(...);    // as many as you like (e.g. 4 for a 64-wide K tile)
//   wgmma_commit_group();     // close them into one group
//   wgmma_wait_group<0>();    // block until at most 0 groups are still running: D is ready
//   fence_accumulators(d);    // tell the compiler D changed here, not earlier
//
// wait_group<1> instead lets the last group keep running while this thread goes on (to release the PREVIOUS
// stage's buffers, for instance): the GEMM's pipeline does exactly that.

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }

__device__ __forceinline__ void wgmma_commit_group() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

template <int kGroupsStillRunning>
__device__ __forceinline__ void wgmma_wait_group() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kGroupsStillRunning) : "memory");
}

// The compiler does not know that an asynchronous MMA writes d until the wait: without this, it could read
// an accumulator (to store it) before wgmma_wait_group. An empty asm that "reads and writes" every register,
// placed after the wait, pins every later use of d below it.
template <int kCount>
__device__ __forceinline__ void fence_accumulators(float (&d)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The accumulator operands of the inline asm below: one "+f" (read and written) per register, 8 at a time.
// (Macros, because an asm operand list cannot be built by a loop; #undef'd after the last wrapper.)
#define TVLLM_WGMMA_D8(d, i)                                                                  \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])
#define TVLLM_WGMMA_D32(d) \
  TVLLM_WGMMA_D8(d, 0), TVLLM_WGMMA_D8(d, 8), TVLLM_WGMMA_D8(d, 16), TVLLM_WGMMA_D8(d, 24)
#define TVLLM_WGMMA_D64(d)                                                                 \
  TVLLM_WGMMA_D32(d), TVLLM_WGMMA_D8(d, 32), TVLLM_WGMMA_D8(d, 40), TVLLM_WGMMA_D8(d, 48), \
      TVLLM_WGMMA_D8(d, 56)

// D[64 x 128] (fp32, 64 floats per thread) += A[64 x 16] * B[128 x 16]^T, A and B bf16 in shared memory,
// both K-major ("row-major with K contiguous": x and W of y = x W^T as they are stored). The four immediates
// after the predicate: scale A by +1, scale B by +1, do not transpose A, do not transpose B. The predicate
// is "scale D": accumulate = true adds to D, false overwrites it (D = A B^T).
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                                 bool accumulate = true) {
  asm volatile(
      "{\n"
      "  .reg .pred p;\n"
      "  setp.ne.b32 p, %66, 0;\n"
      "  wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16\n"
      "  {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,\n"
      "   %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,\n"
      "   %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,\n"
      "   %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63},\n"
      "  %64, %65, p, 1, 1, 0, 0;\n"
      "}\n"
      : TVLLM_WGMMA_D64(d)
      : "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)));
}

// D[64 x 64] (fp32, 32 floats per thread) += A[64 x 16] * B[64 x 16]^T with A from REGISTERS and B from
// shared memory stored MN-major (the N index contiguous: V [keys][dims] read as B[dims][keys], "transposed
// B"). a[4] is the thread's A fragment (a_fragment_position() in hopper_layout.h: the same places as an
// accumulator's registers, packed two bf16 per 32-bit register). The last immediate, 1, says "B is
// transposed"; A in registers cannot be transposed, so there is no immediate for it. The predicate is
// "scale D", as above. The caller keeps a[] alive until the wait (fence_operands).
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b,
                                                   bool accumulate = true) {
  asm volatile(
      "{\n"
      "  .reg .pred p;\n"
      "  setp.ne.b32 p, %37, 0;\n"
      "  wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16\n"
      "  {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,\n"
      "   %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31},\n"
      "  {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n"
      "}\n"
      : TVLLM_WGMMA_D32(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(static_cast<int>(accumulate)));
}

// D[64 x 128] (fp32, 64 floats per thread) += A[64 x 16] * B[128 x 16]^T with A from REGISTERS and B from
// shared memory stored MN-major (the N index contiguous: V [keys][dims] read as B[dims][keys], "transposed
// B"). a[4] is the thread's A fragment (a_fragment_position() in hopper_layout.h: the same places as an
// accumulator's registers, packed two bf16 per 32-bit register). The last immediate, 1, says "B is
// transposed"; A in registers cannot be transposed, so there is no immediate for it. The predicate is
// "scale D", as above. The caller keeps a[] alive until the wait (fence_operands).
__device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b,
                                                    bool accumulate = true) {
  asm volatile(
      "{\n"
      "  .reg .pred p;\n"
      "  setp.ne.b32 p, %69, 0;\n"
      "  wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16\n"
      "  {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,\n"
      "   %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,\n"
      "   %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,\n"
      "   %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63},\n"
      "  {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n"
      "}\n"
      : TVLLM_WGMMA_D64(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(static_cast<int>(accumulate)));
}

// The register twin of fence_accumulators: an asynchronous MMA READS a[] until its wait; without this the
// compiler, which believes the asm consumed a[] when it was issued, could reuse those registers sooner.
template <int kCount>
__device__ __forceinline__ void fence_operands(uint32_t (&a)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+r"(a[i])::"memory");
}

// GEMM v2's instruction: D[64 x 256] (fp32, 128 floats per thread) += A[64 x 16] * B[256 x 16]^T, both
// K-major from shared memory, as wgmma_m64n128k16 but twice as wide: the same A feeds twice the columns, so
// each byte wgmma reads from shared memory does twice the work. The register layout is accumulator_position()
// with N = 256 (registers 4j .. 4j + 3 are 8-column slice j, j = 0..31). The predicate (%130) is "scale D".
#define TVLLM_WGMMA_D128(d)                                                                         \
  TVLLM_WGMMA_D64(d), TVLLM_WGMMA_D8(d, 64), TVLLM_WGMMA_D8(d, 72), TVLLM_WGMMA_D8(d, 80),          \
      TVLLM_WGMMA_D8(d, 88), TVLLM_WGMMA_D8(d, 96), TVLLM_WGMMA_D8(d, 104), TVLLM_WGMMA_D8(d, 112), \
      TVLLM_WGMMA_D8(d, 120)
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t desc_a, uint64_t desc_b,
                                                 bool accumulate = true) {
  asm volatile(
      "{\n"
      "  .reg .pred p;\n"
      "  setp.ne.b32 p, %130, 0;\n"
      "  wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16\n"
      "  {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,\n"
      "   %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,\n"
      "   %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,\n"
      "   %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63,\n"
      "   %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79,\n"
      "   %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95,\n"
      "   %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111,\n"
      "   %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127},\n"
      "  %128, %129, p, 1, 1, 0, 0;\n"
      "}\n"
      : TVLLM_WGMMA_D128(d)
      : "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)));
}

#undef TVLLM_WGMMA_D128
#undef TVLLM_WGMMA_D64
#undef TVLLM_WGMMA_D32
#undef TVLLM_WGMMA_D8

// ---- warp specialisation: moving registers between warpgroups ---------------------------------------------
// A block of 3 warpgroups gets the same register budget per thread everywhere (65536 / 384 = 168 at most).
// The producer warpgroup only issues TMA copies and needs few; the consumers hold 64+ accumulators each and
// want many. setmaxnreg lets a warpgroup give registers back to the SM's pool (dec) and another take them
// (inc), while the kernel runs. All threads of the warpgroup execute it; the count is a multiple of 8 in [24,
// 256].
template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegisters));
}
template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegisters));
}

// Named barriers: 16 hardware barriers per block (id 0 is __syncthreads'), each counting `threads` arrivals
// (a multiple of 32). bar.sync counts this warp and waits; bar.arrive counts it and walks on. A pair of them
// passes a token between two warpgroups, which is how flash attention's consumers take turns (ping-pong).
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// ---- thread-block clusters and distributed shared memory --------------------------------------------------
// A cluster is a group of up to 8 blocks (16 with an opt-in) that the hardware places on the SMs of one GPC
// at the same time. Each block can read and write the shared memory of the others (DSMEM) through the
// "cluster" shared window, and the blocks can barrier with each other.

// This block's index in its cluster (0 .. cluster_size() - 1) and the cluster's size in blocks.
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ uint32_t cluster_size() {
  uint32_t n;
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
  return n;
}

// A barrier over every thread of every block of the cluster: arrive (release: my writes, to my shared memory
// or another block's, happen before...) then wait (acquire: ...what anyone does after the barrier).
__device__ __forceinline__ void cluster_sync() {
  asm volatile(
      "barrier.cluster.arrive.release.aligned;\n"
      "barrier.cluster.wait.acquire.aligned;" ::
          : "memory");
}

// The address, in the cluster's shared window, of the variable at `p` in block `rank`'s shared memory (the
// same offset in every block: all blocks run the same kernel with the same shared-memory layout).
__device__ __forceinline__ uint32_t map_to_rank(const void* p, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_address(p)), "r"(rank));
  return remote;
}

// A 4-byte load from another block's shared memory (an address from map_to_rank()).
__device__ __forceinline__ float load_from_cluster(uint32_t remote_address) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote_address) : "memory");
  return v;
}

#endif  // TVLLM_HOPPER_DEVICE

}  // namespace tvllm
