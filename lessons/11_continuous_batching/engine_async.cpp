// Lesson 11's engine with async scheduling (lesson 14, engine.h: EngineConfig::async_scheduling).
//
// The synchronous step (engine.cpp, exercise 11.3) leaves the GPU idle while the host works between two steps:
//
//   host   | schedule N | prepare N | launch N |  wait ........ | postprocess N, events | schedule N+1 | ...
//   GPU    |                        | step N ....................|                                     | step N+1
//
// Here the host schedules and launches step N + 1 while the GPU still runs step N, then reads step N's ids:
//
//   host   | advance N | inbox | schedule N+1 | prepare + launch N+1 | wait N | resolve N, events | advance N+1 |
//   GPU    | step N ............................................... | step N+1 ..................................
//
// What makes it possible is that everything the next step needs from this one is known without its ids except
// the ids themselves (Scheduler::advance / resolve), and those stay on the GPU: the next step's token rows are
// filled from this step's id buffer by a kernel queued in between (pending_tokens.h). The one stream orders it
// all: step N's sampler, the copy of its ids to the host, the fill, step N + 1. A sequence freed while a step is
// in flight (an abort, an EOS seen one step late) is written to by that step only where its KV used to be, and a
// block reused by someone else is written by its new owner later in the same stream order before it is read.
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

#include "common/errors.h"
#include "engine.h"
#include "pending_tokens.h"

namespace tvllm {

static_assert(sizeof(PendingToken) == 2 * sizeof(int32_t), "fill_pending_tokens reads PendingToken as int32 pairs");

void Engine::step_async() {
  // 1. What the step in flight computes is known without its ids: num_computed, and a placeholder for each id.
  if (in_flight_) scheduler_.advance(in_flight_->batch);
  process_inbox();  // aborts free their KV now, also under the step in flight
  ScheduledBatch batch = scheduler_.schedule();

  // 2. The next step goes to the GPU before we wait for the one in flight.
  std::optional<InFlight> next;
  if (!batch.empty()) {
    const int half = in_flight_ ? 1 - in_flight_->half : 0;
    try {
      next = launch_async(batch, half);
    } catch (const std::exception& e) {
      fail_batch(batch, e.what());  // still ours: launch_async takes it only once the step is queued
    }
  }

  // 3. The ids of the step in flight: wait for their copy only, then the events. The next step is in flight from
  //    here on, whatever happens below (an exception in resolve() must not lose it).
  std::optional<InFlight> done = std::move(in_flight_);
  in_flight_ = std::move(next);
  if (done) {
    std::vector<int32_t> ids;
    try {
      ids = wait_ids(*done, !in_flight_.has_value());
    } catch (const std::exception& e) {
      // The stream is shared: a failure seen here may be the next step's as much as this one's.
      fail_batch(done->batch, e.what());
      if (in_flight_) fail_batch(in_flight_->batch, e.what());
      in_flight_.reset();
      update_stats();
      return;
    }
    deliver_tokens(scheduler_.resolve(done->batch, ids));
  }
  update_stats();
}

Engine::InFlight Engine::launch_async(ScheduledBatch& batch, int half) {
  const int64_t rows = prepare_and_launch(batch);
  // The ids' copy to the host, behind the step on the stream; the next step's sampler overwrites ids_device_
  // only after it. Each step in turn uses its own half of ids_host_: the host reads this one while the next
  // step's copy may already be queued.
  int32_t* host = ids_host_.as<int32_t>() + static_cast<int64_t>(half) * limits_.max_logits_rows;
  if (rows > 0) {
    if (weights_.device == Device::CUDA) {
      TVLLM_CUDA_CHECK(cudaMemcpyAsync(host, ids_device_.data(), static_cast<size_t>(rows) * sizeof(int32_t),
                                       cudaMemcpyDeviceToHost, ctx_.stream()));
      TVLLM_CUDA_CHECK(cudaEventRecord(ids_copied_[half], ctx_.stream()));
    } else {
      std::memcpy(host, ids_device_.data(), static_cast<size_t>(rows) * sizeof(int32_t));
    }
  }
  return InFlight{std::move(batch), rows, half};
}

std::vector<int32_t> Engine::wait_ids(const InFlight& step, bool last) {
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  if (weights_.device == Device::CUDA) {
    if (last) {
      ctx_.check_tokens();  // nothing behind it: wait for the whole stream and read the bad-token flag too
    } else if (step.rows > 0) {
      TVLLM_CUDA_CHECK(cudaEventSynchronize(ids_copied_[step.half]));  // not the step launched after it
    }
  }
  host_time_.wait_s += std::chrono::duration<double>(Clock::now() - t0).count();
  const int32_t* host = ids_host_.as<int32_t>() + static_cast<int64_t>(step.half) * limits_.max_logits_rows;
  return std::vector<int32_t>(host, host + step.rows);
}

std::vector<int32_t> Engine::token_ids_for(const ScheduledBatch& batch) const {
  if (weights_.device == Device::CPU)  // the step before ran to its end already: its ids are in ids_device_
    return batch.token_ids_filled(
        {ids_device_.view().ptr<const int32_t>(), static_cast<size_t>(limits_.max_logits_rows)});
  // Any valid id passes StepInputs's host check; fill_pending_on_device writes the real one after the copy.
  std::vector<int32_t> ids = batch.token_ids;
  for (const PendingToken& p : batch.pending_tokens) ids.at(static_cast<size_t>(p.token_row)) = 0;
  return ids;
}

void Engine::fill_pending_on_device(const ScheduledBatch& batch) {
  if (weights_.device != Device::CUDA) return;  // token_ids_for wrote them on the host
  const auto n = static_cast<int>(batch.pending_tokens.size());
  if (pending_staging_.data() == nullptr || n > limits_.max_sequences)
    throw std::logic_error("engine: " + std::to_string(n) + " pending tokens without async scheduling's buffers "
                           "(EngineConfig::async_scheduling) or beyond max_sequences");
  // The staging buffer is read by the previous step's copy: wait for that copy (only it), as StepInputs does.
  if (pending_copy_queued_) TVLLM_CUDA_CHECK(cudaEventSynchronize(pending_copied_));
  std::memcpy(pending_staging_.data(), batch.pending_tokens.data(), static_cast<size_t>(n) * sizeof(PendingToken));
  const cudaStream_t stream = ctx_.stream();
  TVLLM_CUDA_CHECK(cudaMemcpyAsync(pending_device_.data(), pending_staging_.data(),
                                   static_cast<size_t>(n) * sizeof(PendingToken), cudaMemcpyHostToDevice, stream));
  TVLLM_CUDA_CHECK(cudaEventRecord(pending_copied_, stream));
  pending_copy_queued_ = true;
  // After StepInputs::set's copy of the token ids (queued before us on the stream), before the step reads them.
  fill_pending_tokens(step_.token_ids().ptr<int32_t>(), ids_device_.view().ptr<const int32_t>(),
                      static_cast<const int32_t*>(pending_device_.data()), n, stream);
}

void Engine::fail_batch(const ScheduledBatch& batch, const std::string& error) {
  for (const ScheduledSequence& s : batch.seqs) {
    const Sequence* seq = scheduler_.find(s.seq_id);  // by id: it may have been released since
    if (seq == nullptr || seq->is_finished()) continue;
    scheduler_.abort(s.seq_id, FinishReason::Error);
    finish_request(by_seq_.at(s.seq_id), error);
  }
}

}  // namespace tvllm
