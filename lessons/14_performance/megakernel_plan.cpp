// Lesson 14: the megakernel's host planner (megakernel_plan.h).
#include "megakernel_plan.h"

#include <algorithm>
#include <limits>
#include <string>

#include "common/input_error.h"

namespace tvllm {

MegakernelPlan::MegakernelPlan(std::vector<MkMatrix> matrices, int blocks, int64_t stage_bytes, int stages,
                               int max_rows, int warps)
    : matrices_(std::move(matrices)), blocks_(blocks), stage_bytes_(stage_bytes), stages_(stages), warps_(warps) {
  TVLLM_REQUIRE(blocks >= 1, "megakernel plan: blocks must be >= 1, got " + std::to_string(blocks));
  TVLLM_REQUIRE(stage_bytes >= 16 && stage_bytes % 16 == 0,
                "megakernel plan: stage_bytes must be a positive multiple of 16, got " + std::to_string(stage_bytes));
  TVLLM_REQUIRE(max_rows >= 1, "megakernel plan: max_rows must be >= 1, got " + std::to_string(max_rows));
  TVLLM_REQUIRE(warps >= 0, "megakernel plan: warps must be >= 0, got " + std::to_string(warps));
  TVLLM_REQUIRE(stages >= 1 && stages >= warps, "megakernel plan: " + std::to_string(stages) +
                                                    " stages for " + std::to_string(warps) +
                                                    " owner warps (at least one stage each, at least one in all)");
  TVLLM_REQUIRE(warps == 0 || max_rows <= 32,
                "megakernel plan: per-warp stages take at most 32 outputs per chunk (one lane each), got " +
                    std::to_string(max_rows));
  constexpr int64_t kU32 = std::numeric_limits<uint32_t>::max();
  const int P = phases();
  begins_.assign(static_cast<size_t>(blocks) * (P + 1), 0);
  for (int p = 0; p < P; ++p) {
    const MkMatrix& m = matrices_[p];
    TVLLM_REQUIRE(m.outputs >= 0 && m.outputs < kU32 && m.K > 0 && m.K < kU32 && m.elem_bytes > 0,
                  "megakernel plan: phase " + std::to_string(p) + " has a bad shape");
    TVLLM_REQUIRE(m.K * m.elem_bytes % 16 == 0, "megakernel plan: phase " + std::to_string(p) + "'s rows (K = " +
                                                    std::to_string(m.K) + ") are not whole 16-byte packs");
  }
  for (int b = 0; b < blocks; ++b) {
    const size_t block_first = chunks_.size();
    uint32_t task = 0;  // per-warp stages: whole-row chunks and sliced rows dealt round-robin to the warps
    for (int p = 0; p < P; ++p) {
      begins_[static_cast<size_t>(b) * (P + 1) + p] = static_cast<uint32_t>(chunks_.size());
      const MkMatrix& m = matrices_[p];
      const int64_t halves = m.paired ? 2 : 1;
      const int64_t row_bytes = m.K * m.elem_bytes * halves;  // one output's bytes in the stage
      const int64_t first = first_output(m.outputs, blocks, b), last = first_output(m.outputs, blocks, b + 1);
      if (row_bytes <= stage_bytes) {
        // Whole rows: as many as fit a stage, at most max_rows.
        const int64_t per_chunk = std::min<int64_t>(stage_bytes / row_bytes, max_rows);
        for (int64_t r = first; r < last; r += per_chunk) {
          MkChunk c;
          c.phase = static_cast<uint32_t>(p);
          c.row0 = static_cast<uint32_t>(r);
          c.rows = static_cast<uint32_t>(std::min(per_chunk, last - r));
          c.k0 = 0;
          c.kc = static_cast<uint32_t>(m.K);
          c.flags = kMkFirstSlice | kMkLastSlice;
          c.seq = static_cast<uint32_t>(chunks_.size() - block_first);
          c.warp = warps > 0 ? task++ % static_cast<uint32_t>(warps) : 0u;
          chunks_.push_back(c);
        }
      } else {
        // One row is bigger than a stage: slices of its columns, each a whole number of 16-byte packs per half.
        const int64_t pack = 16 / std::min<int64_t>(m.elem_bytes, 16);  // elements per 16 bytes
        const int64_t slice = stage_bytes / (m.elem_bytes * halves) / pack * pack;
        TVLLM_REQUIRE(slice > 0, "megakernel plan: a stage cannot hold one pack of phase " + std::to_string(p));
        for (int64_t r = first; r < last; ++r)
          for (int64_t k = 0; k < m.K; k += slice) {
            MkChunk c;
            c.phase = static_cast<uint32_t>(p);
            c.row0 = static_cast<uint32_t>(r);
            c.rows = 1;
            c.k0 = static_cast<uint32_t>(k);
            c.kc = static_cast<uint32_t>(std::min(slice, m.K - k));
            c.flags = (k == 0 ? kMkFirstSlice : 0u) | (k + slice >= m.K ? kMkLastSlice : 0u);
            c.seq = static_cast<uint32_t>(chunks_.size() - block_first);
            c.warp = warps > 0 ? task % static_cast<uint32_t>(warps) : 0u;  // every slice of a row: one warp
            chunks_.push_back(c);
            if (c.flags & kMkLastSlice) ++task;
          }
      }
    }
    begins_[static_cast<size_t>(b) * (P + 1) + P] = static_cast<uint32_t>(chunks_.size());
    assign_ring(block_first);
  }
  if (warps == 0) return;
  // The warp lists: block by block, warp by warp, phase by phase, each in program order.
  warp_begins_.assign(static_cast<size_t>(blocks) * warps * (P + 1), 0);
  for (int b = 0; b < blocks; ++b)
    for (int w = 0; w < warps; ++w) {
      for (int p = 0; p < P; ++p) {
        warp_begins_[(static_cast<size_t>(b) * warps + w) * (P + 1) + p] = static_cast<uint32_t>(warp_chunks_.size());
        for (uint32_t i = begin(b, p); i < begin(b, p + 1); ++i)
          if (chunks_[i].warp == static_cast<uint32_t>(w)) warp_chunks_.push_back(chunks_[i]);
      }
      warp_begins_[(static_cast<size_t>(b) * warps + w) * (P + 1) + P] = static_cast<uint32_t>(warp_chunks_.size());
    }
}

// Each chunk of the block starting at chunks_[first] gets its (slot, round): megakernel_plan.h, "The ring".
void MegakernelPlan::assign_ring(size_t first) {
  const auto S = static_cast<uint32_t>(stages_);
  if (warps_ == 0) {
    for (size_t i = first; i < chunks_.size(); ++i) {
      chunks_[i].slot = chunks_[i].seq % S;
      chunks_[i].round = chunks_[i].seq / S;
    }
    return;
  }
  // Per-warp stages: warp w owns stages w, w + W, w + 2W, ... (< S); its chunks cycle through them in its order.
  const auto W = static_cast<uint32_t>(warps_);
  std::vector<uint32_t> taken(W, 0);  // chunks of warp w so far
  for (size_t i = first; i < chunks_.size(); ++i) {
    MkChunk& c = chunks_[i];
    const uint32_t owned = (S - c.warp + W - 1) / W;  // stages of warp c.warp (>= 1: S >= W)
    const uint32_t n = taken[c.warp]++;
    c.slot = c.warp + W * (n % owned);
    c.round = n / owned;
  }
}

int64_t MegakernelPlan::chunk_bytes(const MkChunk& c) const {
  const MkMatrix& m = matrices_[c.phase];
  return static_cast<int64_t>(c.rows) * c.kc * m.elem_bytes * (m.paired ? 2 : 1);
}

int64_t MegakernelPlan::block_bytes(int block) const {
  int64_t total = 0;
  for (uint32_t i = begin(block, 0); i < begin(block, phases()); ++i) total += chunk_bytes(chunks_[i]);
  return total;
}

}  // namespace tvllm
