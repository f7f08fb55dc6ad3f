// Lesson 11's engine, async scheduling (lesson 14): the tokens a step feeds before the host has seen them.
//
// With async scheduling the host schedules and launches step N + 1 while the GPU still runs step N, so a
// sequence that decodes in step N + 1 feeds the id step N samples, which only the GPU has. The scheduler marks
// those token rows (ScheduledBatch::pending_tokens: {token row of step N + 1, logits row of step N}); this kernel
// copies each id from step N's output into step N + 1's token buffer, on the stream, after step N's sampler and
// before step N + 1's embedding reads it. Nothing waits: the stream's order is the whole synchronisation.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace tvllm {

// For i < n: token_ids[pairs[2i]] = previous_ids[pairs[2i + 1]]. pairs (device) holds n {token row, source row}
// pairs (PendingToken's layout). Queued on `stream`; n == 0 queues nothing.
void fill_pending_tokens(int32_t* token_ids, const int32_t* previous_ids, const int32_t* pairs, int n,
                         cudaStream_t stream);

}  // namespace tvllm
