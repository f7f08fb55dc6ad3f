// Lesson 11: one request as the scheduler sees it.
//
//   tokens:   | prompt p0 p1 ... p(P-1) | output o0 o1 ... |
//              <------ num_computed ------>|<-- still to feed -->|
//
// A sequence is a list of tokens (the prompt, then the ids generated so far) and ONE number that says how far
// the model has got: num_computed, the tokens whose k and v are already in the KV cache. Every step feeds
// some of the tokens [num_computed, num_tokens()) and, when it feeds the last one, samples the next id:
//
//   a prompt's first step     num_computed 0 (or a prefix-cache hit), feeds a chunk of the prompt
//   a decode step             exactly one token left to feed: the id sampled last step
//   after a preemption        num_computed back to 0: prompt AND output are fed again (recomputation), and
//                             the last one's logits give the next id, as if nothing had happened
//
// That single rule covers prefill, chunked prefill, prefix hits, decode and recomputation (vLLM v1's model).
// Host-only, plain C++20: no GPU anywhere in this lesson's scheduler.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "sampling.h"  // lesson 09: SamplingParams (temperature, top_k, top_p, seed)

namespace tvllm {

// Where a sequence is. Preempted is a waiting sequence that ran before and lost its KV cache.
enum class SequenceState { Waiting, Running, Preempted, Finished };
// Why it finished: a stop id (EOS or a stop id of the request), max_tokens or a full context (length),
// aborted by the caller, or an error the engine reported.
enum class FinishReason { None, Stop, Length, Abort, Error };

// Async scheduling (lesson 14): the host schedules step N + 1 while the GPU still runs step N, so the id step N
// samples for a sequence is not known yet when step N + 1 must feed it. The sequence's output then ends with
// this placeholder; the engine fills the token on the device from step N's ids (ScheduledBatch::pending_tokens)
// and Scheduler::resolve() writes the real id over it when step N's ids reach the host.
inline constexpr int32_t kPendingToken = -1;

std::string_view sequence_state_name(SequenceState state);  // "waiting", "running", "preempted", "finished"
std::string_view finish_reason_name(FinishReason reason);   // "", "stop", "length", "abort", "error"

// What a request asks for, besides its prompt.
struct RequestParams {
  SamplingParams sampling;        // how the engine picks each id (the scheduler does not look at it)
  int64_t max_tokens = 16;        // new ids at most (>= 1)
  bool ignore_eos = false;        // do not stop at the model's EOS ids (benchmarks)
  std::vector<int32_t> stop_ids;  // more ids that stop the request (always, even with ignore_eos)
};

class Sequence {
 public:
  Sequence(int64_t id, std::vector<int32_t> prompt, RequestParams params)
      : id(id), prompt(std::move(prompt)), params(std::move(params)) {}

  int64_t id;  // given in arrival order: a smaller id arrived earlier (fairness uses it)
  std::vector<int32_t> prompt;
  RequestParams params;
  SequenceState state = SequenceState::Waiting;
  std::vector<int32_t> output;  // the ids generated so far
  int64_t num_computed = 0;     // tokens whose k, v are in the KV cache
  FinishReason finish_reason = FinishReason::None;
  // Where its KV cache lives, as the allocator gave it: {slot} for a contiguous cache (lesson 11), the block
  // table for a paged one (lesson 12). Empty while it holds nothing.
  std::vector<int32_t> kv_blocks;
  // Async scheduling (lesson 14): the logits row of the step in flight that samples this sequence's next id, or
  // -1. Set by Scheduler::advance(), cleared by resolve(). While it is set, output ends with kPendingToken,
  // unless that id is certainly the last (max_tokens or the context reached): nothing will feed it.
  int32_t pending_row = -1;
  // For statistics and tests.
  int64_t num_preemptions = 0;    // times its KV cache was taken away
  int64_t num_cached_tokens = 0;  // tokens its last admission found in the prefix cache

  int64_t prompt_len() const { return static_cast<int64_t>(prompt.size()); }
  int64_t num_tokens() const { return static_cast<int64_t>(prompt.size() + output.size()); }
  // Token i of prompt + output.
  int32_t token(int64_t i) const {
    return i < prompt_len() ? prompt[static_cast<size_t>(i)] : output[static_cast<size_t>(i - prompt_len())];
  }
  // Tokens still to feed before the next id can be sampled: 1 when decoding.
  int64_t num_uncomputed() const { return num_tokens() - num_computed; }
  bool is_finished() const { return state == SequenceState::Finished; }
};

}  // namespace tvllm
