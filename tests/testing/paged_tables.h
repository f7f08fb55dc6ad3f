// Block tables for the paged-attention GPU suites (lesson 12's kernels, lesson 15's paged wgmma kernel): blocks
// handed out from a shuffled pool, so that a kernel which assumes neighbouring positions live in neighbouring
// blocks fails. Header-only.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "common/random.h"

namespace tvllm::testing {

// Tables for sequences of these context lengths (bs positions per block) from a shuffled pool of num_blocks.
// With share_from >= 0 the last sequence starts with share_blocks blocks of sequence share_from (a
// prefix-cache hit).
inline std::vector<std::vector<int32_t>> shuffled_tables(const std::vector<int64_t>& k_lens, int64_t bs,
                                                         int64_t num_blocks, uint64_t seed, int share_from = -1,
                                                         int64_t share_blocks = 0) {
  std::vector<int32_t> order(static_cast<size_t>(num_blocks));
  std::iota(order.begin(), order.end(), 0);
  Rng rng(seed);
  for (size_t i = order.size() - 1; i > 0; --i)
    std::swap(order[i], order[rng.below(static_cast<int64_t>(i) + 1)]);
  std::vector<std::vector<int32_t>> tables(k_lens.size());
  size_t next = 0;
  for (size_t b = 0; b < k_lens.size(); ++b) {
    if (share_from >= 0 && b + 1 == k_lens.size())
      tables[b].assign(tables[share_from].begin(), tables[share_from].begin() + share_blocks);
    while (static_cast<int64_t>(tables[b].size()) * bs < k_lens[b]) tables[b].push_back(order.at(next++));
  }
  return tables;
}

}  // namespace tvllm::testing
