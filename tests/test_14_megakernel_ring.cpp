// Lesson 14 on the CPU: the megakernel's ring of shared-memory stages (megakernel_plan.h, "The ring"), simulated.
//
// One block of the kernel: the producer issues the plan's chunks in program order, each into its stage (slot)
// after waiting on the stage's `empty` mbarrier with parity (round & 1) ^ 1; the readers — per-warp stages: each
// warp its own list; shared stages: one reader, all warps together — wait on the stage's `full` mbarrier with
// parity round & 1, read, and arrive once on `empty`. An mbarrier is modelled as the hardware keeps it: a count
// of completed phases, of which a parity wait sees only the low bit (it passes iff count & 1 != parity). A phase
// of the plan starts for a reader only when every chunk of the earlier phases was read (the grid barrier).
//
// The schedule is random but seeded (the same every run): which agent moves next, each agent's speed (one reader
// sometimes very slow), and when each bulk copy lands (copies land in any order). For every stage the simulation
// follows its fills and reads and reports the first of:
//   - a fill issued while the stage's previous fill is not yet read and freed (it overwrites bytes in use),
//   - a fill whose round is not the stage's fill count (its waiters would use the wrong parity),
//   - a parity wait that passes while the stage's landed fill count is not the waiter's round + 1, or while the
//     stage holds another chunk: the waiter passed on an OLDER fill's parity and reads the wrong bytes,
//   - nobody able to move before the end: a deadlock (on the GPU the watchdog traps).
// The first per-warp version's rule (slot = seq % S, round = seq / S for every scheme) is simulated too: it must
// fail (a stage's fills then belong to different warps), while the plan's (slot, round) must pass every schedule.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "megakernel_plan.h"

namespace tvllm {
namespace {

struct Job {
  uint32_t slot, round, phase;
};

// One block's ring as the kernel walks it: the producer's jobs in program order, each reader's list of job
// indices in its order.
struct BlockRing {
  int stages = 0, phases = 0;
  std::vector<Job> jobs;
  std::vector<std::vector<uint32_t>> readers;
};

enum class Rule { Plan, OldSeqModS };

BlockRing ring_of(const MegakernelPlan& plan, int block, Rule rule) {
  BlockRing r;
  r.stages = plan.stages();
  r.phases = plan.phases();
  const auto S = static_cast<uint32_t>(plan.stages());
  for (uint32_t i = plan.begin(block, 0); i < plan.begin(block, plan.phases()); ++i) {
    const MkChunk& c = plan.chunks()[i];
    r.jobs.push_back(rule == Rule::Plan ? Job{c.slot, c.round, c.phase} : Job{c.seq % S, c.seq / S, c.phase});
  }
  if (plan.warps() == 0) {
    r.readers.emplace_back();
    for (uint32_t n = 0; n < r.jobs.size(); ++n) r.readers[0].push_back(n);
    return r;
  }
  r.readers.resize(static_cast<size_t>(plan.warps()));
  for (int w = 0; w < plan.warps(); ++w)
    for (uint32_t i = plan.warp_begin(block, w, 0); i < plan.warp_begin(block, w, plan.phases()); ++i)
      r.readers[w].push_back(plan.warp_chunks()[i].seq);
  return r;
}

// One random schedule of the block's ring; "" when nothing went wrong, else the first violation.
std::string simulate(const BlockRing& r, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const auto S = static_cast<size_t>(r.stages);
  const size_t R = r.readers.size(), n = r.jobs.size();
  std::vector<uint64_t> full_done(S, 0), empty_done(S, 0), issued(S, 0), freed(S, 0);
  std::vector<int64_t> content(S, -1);  // the chunk whose bytes the stage holds (the last landed fill)
  std::vector<uint32_t> pending;        // chunks issued whose bytes have not landed
  std::vector<size_t> total(static_cast<size_t>(r.phases), 0), read(static_cast<size_t>(r.phases), 0);
  for (const Job& j : r.jobs) ++total[j.phase];
  size_t next_fill = 0;
  std::vector<size_t> pos(R, 0);
  std::vector<int64_t> reading(R, -1);
  // Speeds: agent 0 the producer, 1 the copy engine (landings), 2 + k reader k. Every fourth seed one reader crawls.
  std::uniform_real_distribution<double> speed(1.0, 8.0);
  std::vector<double> weight(R + 2);
  for (double& w : weight) w = speed(rng);
  if (seed % 4 == 0 && R > 1) weight[2 + rng() % R] = 0.05;
  const auto open_phase = [&] {  // the first phase some chunk of which is not yet read: the grid barrier's
    size_t p = 0;
    while (p < total.size() && read[p] == total[p]) ++p;
    return p;
  };
  const auto at = [](uint32_t chunk, const Job& j) {
    return "chunk " + std::to_string(chunk) + " (stage " + std::to_string(j.slot) + ", round " +
           std::to_string(j.round) + ")";
  };
  for (;;) {
    const size_t phase_open = open_phase();
    std::vector<size_t> movable;
    if (next_fill < n) {
      const Job& j = r.jobs[next_fill];
      if ((empty_done[j.slot] & 1u) != ((j.round & 1u) ^ 1u)) movable.push_back(0);
    }
    if (!pending.empty()) movable.push_back(1);
    for (size_t k = 0; k < R; ++k) {
      if (reading[k] >= 0) {
        movable.push_back(2 + k);
      } else if (pos[k] < r.readers[k].size()) {
        const Job& j = r.jobs[r.readers[k][pos[k]]];
        if (j.phase <= phase_open && (full_done[j.slot] & 1u) != (j.round & 1u)) movable.push_back(2 + k);
      }
    }
    if (movable.empty()) {
      bool done = next_fill == n;
      for (size_t k = 0; k < R; ++k) done = done && pos[k] == r.readers[k].size();
      return done ? "" : "deadlock: nobody can move, " + std::to_string(next_fill) + " of " + std::to_string(n) +
                             " chunks issued";
    }
    double sum = 0.0;
    for (size_t a : movable) sum += weight[a];
    double pick = std::uniform_real_distribution<double>(0.0, sum)(rng);
    size_t agent = movable.back();
    for (size_t a : movable) {
      if (pick < weight[a]) {
        agent = a;
        break;
      }
      pick -= weight[a];
    }
    if (agent == 0) {  // the producer's empty wait passed: issue the fill
      const auto chunk = static_cast<uint32_t>(next_fill++);
      const Job& j = r.jobs[chunk];
      if (freed[j.slot] != issued[j.slot])
        return "overwrite: " + at(chunk, j) + " issued while the stage's previous fill is not yet read";
      if (j.round != issued[j.slot])
        return "wrong round: " + at(chunk, j) + " is fill " + std::to_string(issued[j.slot]) + " of its stage";
      ++issued[j.slot];
      pending.push_back(chunk);
    } else if (agent == 1) {  // some issued copy's bytes land (any of them: bulk copies complete in any order)
      const size_t i = rng() % pending.size();
      const uint32_t chunk = pending[i];
      pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i));
      ++full_done[r.jobs[chunk].slot];
      content[r.jobs[chunk].slot] = chunk;
    } else {
      const size_t k = agent - 2;
      if (reading[k] >= 0) {  // done reading: free the stage (one arrival on empty)
        const Job& j = r.jobs[static_cast<size_t>(reading[k])];
        ++empty_done[j.slot];
        ++freed[j.slot];
        ++read[j.phase];
        reading[k] = -1;
        ++pos[k];
      } else {  // the full wait passed: is it this chunk's fill that landed?
        const uint32_t chunk = r.readers[k][pos[k]];
        const Job& j = r.jobs[chunk];
        if (full_done[j.slot] != j.round + 1u || content[j.slot] != chunk)
          return "parity aliasing: reader " + std::to_string(k) + "'s wait for " + at(chunk, j) +
                 " passed with " + std::to_string(full_done[j.slot]) + " fills landed (the stage holds chunk " +
                 std::to_string(content[j.slot]) + ")";
        reading[k] = chunk;
      }
    }
  }
}

// The plan's static promises: slots in range; shared stages: the kernel's counter rule (slot = seq % S, round =
// seq / S: its producer and consumers count n themselves); per-warp stages: every stage has one owner warp.
void expect_static_ring(const MegakernelPlan& plan) {
  const auto S = static_cast<uint32_t>(plan.stages());
  for (int b = 0; b < plan.blocks(); ++b) {
    std::vector<int64_t> owner(S, -1);
    for (uint32_t i = plan.begin(b, 0); i < plan.begin(b, plan.phases()); ++i) {
      const MkChunk& c = plan.chunks()[i];
      ASSERT_LT(c.slot, S) << "block " << b << " chunk " << c.seq;
      if (plan.warps() == 0) {
        ASSERT_EQ(c.slot, c.seq % S);
        ASSERT_EQ(c.round, c.seq / S);
      } else {
        if (owner[c.slot] < 0) owner[c.slot] = c.warp;
        ASSERT_EQ(owner[c.slot], static_cast<int64_t>(c.warp)) << "block " << b << ": stage " << c.slot
                                                                << " shared by two warps";
      }
    }
    // The warp lists carry the same (slot, round) as the producer's list.
    if (plan.warps() > 0)
      for (int w = 0; w < plan.warps(); ++w)
        for (uint32_t i = plan.warp_begin(b, w, 0); i < plan.warp_begin(b, w, plan.phases()); ++i) {
          const MkChunk& c = plan.warp_chunks()[i];
          const MkChunk& orig = plan.chunks()[plan.begin(b, 0) + c.seq];
          ASSERT_EQ(c.slot, orig.slot);
          ASSERT_EQ(c.round, orig.round);
        }
  }
}

// Every schedule of `seeds` on blocks `blocks` passes; returns the number of simulated runs.
int expect_every_schedule_passes(const MegakernelPlan& plan, const std::vector<int>& blocks, int seeds) {
  int runs = 0;
  for (int b : blocks) {
    const BlockRing ring = ring_of(plan, b, Rule::Plan);
    for (int s = 0; s < seeds; ++s, ++runs) {
      const std::string v = simulate(ring, 1000u * static_cast<uint64_t>(b) + static_cast<uint64_t>(s));
      EXPECT_EQ(v, "") << "block " << b << ", seed " << s;
      if (!v.empty()) return runs;
    }
  }
  return runs;
}

// The first violation the old rule shows over `seeds` schedules of block `block`, or "".
std::string first_violation_of_the_old_rule(const MegakernelPlan& plan, int block, int seeds) {
  const BlockRing ring = ring_of(plan, block, Rule::OldSeqModS);
  for (int s = 0; s < seeds; ++s) {
    const std::string v = simulate(ring, static_cast<uint64_t>(s));
    if (!v.empty()) return "seed " + std::to_string(s) + ": " + v;
  }
  return "";
}

// Llama-3.2-1B: hidden 2048, intermediate 8192, 32 heads / 8 kv heads of 64, vocab 128,256.
std::vector<MkMatrix> llama_1b(int layers, int64_t elem_bytes = 2) {
  std::vector<MkMatrix> m;
  for (int l = 0; l < layers; ++l) {
    m.push_back({(32 + 2 * 8) * 64, 2048, elem_bytes, false});  // qkv
    m.push_back({2048, 32 * 64, elem_bytes, false});            // o
    m.push_back({8192, 2048, elem_bytes, true});                // gate|up
    m.push_back({2048, 8192, elem_bytes, false});               // down
  }
  m.push_back({128256, 2048, 2, false});  // the lm_head stays BF16
  return m;
}

// The kernel's geometry on an H200 (132 SMs, 227 KiB of shared memory per block): per-warp stages 12 stages of
// 16 KiB for 11 warps; shared stages 6 stages of 32 KiB (megakernel.cu, megakernel_prepare).
TEST(Megakernel14Ring, TheFirstPerWarpRuleFailsAtThe1BShape) {
  const MegakernelPlan plan(llama_1b(2), 132, 16384, 12, 32, 11);
  const std::string v = first_violation_of_the_old_rule(plan, 0, 50);
  std::printf("    the old rule (stage seq %% 12, round seq / 12), 11 warps: %s\n", v.c_str());
  EXPECT_NE(v, "") << "the simulation must catch the first version's bug";
  // The shared-stages scheme (one reader) was never affected: the same rule passes every schedule there.
  const MegakernelPlan shared(llama_1b(2), 132, 32768, 6, 128);
  EXPECT_EQ(first_violation_of_the_old_rule(shared, 0, 20), "");
  // Nor were the GPU tests' small models (the bundled one: hidden 336, intermediate 600, 6 / 2 heads of 64,
  // vocab 1000): no phase gives a block more than 12 chunks, and the grid barrier lines the warps up between
  // phases, so no stage is filled twice within a phase. That is why the first version passed them.
  const MegakernelPlan small({{(6 + 2 * 2) * 64, 336, 2, false}, {336, 384, 2, false}, {600, 336, 2, true},
                              {336, 600, 2, false}, {1000, 336, 2, false}},
                             132, 16384, 12, 32, 11);
  for (int b : {0, 131}) EXPECT_EQ(first_violation_of_the_old_rule(small, b, 50), "") << "block " << b;
}

TEST(Megakernel14Ring, PerWarpStagesAtThe1BShapeOnAnH200) {
  const MegakernelPlan plan(llama_1b(2), 132, 16384, 12, 32, 11);
  expect_static_ring(plan);
  EXPECT_EQ(expect_every_schedule_passes(plan, {0, 1, 65, 131}, 40), 160);
  // Warp 0 owns stages 0 and 11, every other warp one: its chunks alternate between its two.
  const std::vector<MkChunk>& c = plan.chunks();
  EXPECT_EQ(c[0].warp, 0u);
  EXPECT_EQ(c[0].slot, 0u);
  EXPECT_EQ(c[0].round, 0u);
  EXPECT_EQ(c[1].slot, 1u);  // warp 1's stage
  EXPECT_EQ(c[11].warp, 0u);
  EXPECT_EQ(c[11].slot, 11u);  // warp 0's second stage
  EXPECT_EQ(c[22].slot, 0u);   // warp 0's third chunk: its first stage again, second fill
  EXPECT_EQ(c[22].round, 1u);
  EXPECT_EQ(c[12].slot, 1u);  // warp 1's second chunk: its only stage, second fill
  EXPECT_EQ(c[12].round, 1u);
}

TEST(Megakernel14Ring, SharedStagesAtThe1BShapeOnAnH200) {
  const MegakernelPlan plan(llama_1b(2), 132, 32768, 6, 128);
  expect_static_ring(plan);
  EXPECT_EQ(expect_every_schedule_passes(plan, {0, 131}, 20), 40);
}

TEST(Megakernel14Ring, SixteenLayersAndFp8Rows) {
  // The whole 1B program of one block (16 layers, ~1,100 chunks), and FP8-resident rows (twice the rows per
  // stage).
  const MegakernelPlan plan(llama_1b(16), 132, 16384, 12, 32, 11);
  expect_static_ring(plan);
  expect_every_schedule_passes(plan, {0}, 8);
  EXPECT_NE(first_violation_of_the_old_rule(plan, 0, 8), "");
  const MegakernelPlan fp8(llama_1b(2, 1), 132, 16384, 12, 32, 11);
  expect_static_ring(fp8);
  expect_every_schedule_passes(fp8, {0, 131}, 20);
}

TEST(Megakernel14Ring, OddShapesStageCountsAndWarps) {
  // hidden 328, intermediate 904, vocab 1009 (prime), head_dim 128; a row bigger than a stage (K = 14336, sliced
  // into slices that stay with one warp); few blocks (long programs) and many (some idle).
  const std::vector<MkMatrix> odd = {{128 * 5 + 2 * 128, 328, 2, false}, {328, 640, 2, false},
                                     {904, 328, 2, true}, {328, 904, 2, false}, {1009, 328, 2, false}};
  const std::vector<MkMatrix> sliced = {{96, 14336, 2, false}, {300, 640, 2, true}, {77, 14336, 2, false}};
  for (const auto& [m, stage] : {std::pair{odd, int64_t{1024}}, std::pair{odd, int64_t{656}},
                                 std::pair{sliced, int64_t{16384}}, std::pair{sliced, int64_t{6000}}})
    for (int blocks : {1, 3, 7, 200}) {
      // (stages, warps): one stage per warp, a few warps owning two, one warp owning all, shared stages.
      for (const auto& [S, W] : {std::pair{11, 11}, std::pair{12, 11}, std::pair{7, 3}, std::pair{16, 4},
                                 std::pair{3, 1}, std::pair{1, 1}, std::pair{6, 0}, std::pair{2, 0},
                                 std::pair{1, 0}}) {
        SCOPED_TRACE(::testing::Message() << blocks << " blocks, stage " << stage << ", " << S << " stages, " << W
                                          << " warps");
        const MegakernelPlan plan(m, blocks, stage, S, 32, W);
        expect_static_ring(plan);
        expect_every_schedule_passes(plan, {0, blocks - 1}, 6);
        if (::testing::Test::HasFailure()) return;
      }
    }
}

TEST(Megakernel14Ring, TheOldRuleFailsOnOddShapesToo) {
  // Not only the 1B shape: any per-warp plan with more than one warp per stage cycle (the small models the
  // first version passed on the GPU have few chunks per block and phase; here one block takes them all).
  const std::vector<MkMatrix> odd = {{128 * 5 + 2 * 128, 328, 2, false}, {328, 640, 2, false},
                                     {904, 328, 2, true}, {328, 904, 2, false}, {1009, 328, 2, false}};
  const MegakernelPlan plan(odd, 1, 1024, 12, 32, 11);
  const std::string v = first_violation_of_the_old_rule(plan, 0, 50);
  std::printf("    odd shape, 1 block: %s\n", v.c_str());
  EXPECT_NE(v, "");
}

}  // namespace
}  // namespace tvllm
