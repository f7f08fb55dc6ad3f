// Lesson 08: StepInputs, one step's inputs in buffers allocated once and refilled by async copies.
#include <algorithm>
#include <string>

#include "common/errors.h"
#include "transformer.h"

namespace tvllm {

namespace {
// Offsets (in int32 elements) of the three arrays inside the staging and device buffers.
struct Layout {
  int64_t ids = 0, positions = 0, rows = 0, total = 0;
  explicit Layout(const EngineLimits& l)
      : ids(0),
        positions(l.max_tokens),
        rows(2 * l.max_tokens),
        total(2 * l.max_tokens + l.max_logits_rows) {}
};
}  // namespace

StepInputs::StepInputs(const ModelConfig& config, const EngineLimits& limits, Device device)
    : vocab_(config.vocab_size),
      limits_(limits.resolved(config)),
      device_(device),
      batch_(limits_.max_sequences, device) {
  const size_t bytes = static_cast<size_t>(Layout(limits_).total) * sizeof(int32_t);
  staging_ =
      HostBuffer(bytes, device == Device::CUDA ? HostBuffer::Kind::Pinned : HostBuffer::Kind::Pageable);
  if (device == Device::CUDA) {
    device_buffer_ = DeviceBuffer(bytes);
    TVLLM_CUDA_CHECK(cudaEventCreateWithFlags(&copied_, cudaEventDisableTiming));
  }
}

StepInputs::~StepInputs() {
  if (copied_) {
    cudaEventSynchronize(copied_);  // the staging buffer must outlive a copy still reading it
    cudaEventDestroy(copied_);
  }
}

int32_t* StepInputs::staging(int64_t offset) const { return staging_.as<int32_t>() + offset; }

void StepInputs::set(const std::vector<int32_t>& token_ids, const std::vector<int64_t>& q_lens,
                     const std::vector<int64_t>& k_lens, const std::vector<int32_t>& logits_rows,
                     cudaStream_t stream) {
  // 1. Validate everything before touching anything: a bad step leaves the previous one intact.
  const int64_t B = static_cast<int64_t>(q_lens.size());
  TVLLM_REQUIRE(B >= 1, "step: no sequences");
  TVLLM_REQUIRE(k_lens.size() == q_lens.size(),
                "step: " + std::to_string(B) + " q_lens but " + std::to_string(k_lens.size()) + " k_lens");
  TVLLM_REQUIRE(B <= limits_.max_sequences,
                "step: " + std::to_string(B) + " sequences exceed the engine's limit of " +
                    std::to_string(limits_.max_sequences) + " (EngineLimits::max_sequences)");
  int64_t T = 0;
  for (int64_t b = 0; b < B; ++b) {
    const std::string seq = "step: sequence " + std::to_string(b);
    TVLLM_REQUIRE(q_lens[b] >= 1, seq + " has no new tokens (q_len " + std::to_string(q_lens[b]) + ")");
    TVLLM_REQUIRE(k_lens[b] >= q_lens[b], seq + " has " + std::to_string(q_lens[b]) +
                                              " new tokens but k_len " + std::to_string(k_lens[b]) +
                                              " (k_len counts them too)");
    TVLLM_REQUIRE(k_lens[b] <= limits_.max_context,
                  seq + " reaches " + std::to_string(k_lens[b]) + " tokens, beyond the context limit of " +
                      std::to_string(limits_.max_context) +
                      " (max_position_embeddings or EngineLimits::max_context)");
    T += q_lens[b];
  }
  TVLLM_REQUIRE(
      static_cast<int64_t>(token_ids.size()) == T,
      "step: " + std::to_string(token_ids.size()) + " token ids for " + std::to_string(T) + " new tokens");
  TVLLM_REQUIRE(T <= limits_.max_tokens,
                "step: " + std::to_string(T) + " tokens exceed the engine's token budget of " +
                    std::to_string(limits_.max_tokens) + " (EngineLimits::max_tokens)");
  for (int64_t t = 0; t < T; ++t)
    TVLLM_REQUIRE(token_ids[t] >= 0 && token_ids[t] < vocab_,
                  "step: token id " + std::to_string(token_ids[t]) + " at position " + std::to_string(t) +
                      " is outside the vocabulary [0, " + std::to_string(vocab_) + ")");
  const int64_t R = static_cast<int64_t>(logits_rows.size());
  TVLLM_REQUIRE(R <= limits_.max_logits_rows,
                "step: " + std::to_string(R) + " logits rows exceed the limit of " +
                    std::to_string(limits_.max_logits_rows) + " (EngineLimits::max_logits_rows)");
  for (int64_t r = 0; r < R; ++r)
    TVLLM_REQUIRE(logits_rows[r] >= 0 && logits_rows[r] < T,
                  "step: logits row " + std::to_string(logits_rows[r]) + " is not one of the step's " +
                      std::to_string(T) + " tokens");

  // 2. The previous step's copies may still be reading the staging buffer: wait for them (only them).
  if (copy_pending_) {
    TVLLM_CUDA_CHECK(cudaEventSynchronize(copied_));
    copy_pending_ = false;
  }

  // 3. The per-sequence layout (cu_seqlens_q/k; its own async copy on `stream`), then the staging buffer:
  //    ids, positions (query i of sequence b sits at k_len - q_len + i), logits rows.
  batch_.set_lengths(q_lens, k_lens, stream);
  const Layout at(limits_);
  std::copy(token_ids.begin(), token_ids.end(), staging(at.ids));
  int32_t* pos = staging(at.positions);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < q_lens[b]; ++i) *pos++ = static_cast<int32_t>(k_lens[b] - q_lens[b] + i);
  std::copy(logits_rows.begin(), logits_rows.end(), staging(at.rows));

  // 4. One async copy per array, then the event that says the staging buffer is free again.
  if (device_ == Device::CUDA) {
    auto* dev = device_buffer_.as<int32_t>();
    auto copy = [&](int64_t offset, int64_t count) {
      if (count > 0)
        TVLLM_CUDA_CHECK(cudaMemcpyAsync(dev + offset, staging(offset),
                                         static_cast<size_t>(count) * sizeof(int32_t), cudaMemcpyHostToDevice,
                                         stream));
    };
    copy(at.ids, T);
    copy(at.positions, T);
    copy(at.rows, R);
    TVLLM_CUDA_CHECK(cudaEventRecord(copied_, stream));
    copy_pending_ = true;
  }
  tokens_ = T;
  rows_ = R;
}

void StepInputs::set_prompts(const std::vector<std::vector<int32_t>>& prompts, bool all_rows,
                             cudaStream_t stream) {
  std::vector<int32_t> ids, rows;
  std::vector<int64_t> lengths;
  for (const std::vector<int32_t>& p : prompts) {
    const auto first = static_cast<int32_t>(ids.size());
    ids.insert(ids.end(), p.begin(), p.end());
    lengths.push_back(static_cast<int64_t>(p.size()));
    if (all_rows) {
      for (size_t i = 0; i < p.size(); ++i) rows.push_back(first + static_cast<int32_t>(i));
    } else if (!p.empty()) {
      rows.push_back(static_cast<int32_t>(ids.size()) - 1);
    }
  }
  set(ids, lengths, lengths, rows, stream);
}

TensorView StepInputs::token_ids() const {
  void* p = device_ == Device::CUDA ? device_buffer_.as<int32_t>() + Layout(limits_).ids
                                    : staging(Layout(limits_).ids);
  return TensorView::contiguous(p, DType::I32, device_, {tokens_});
}
TensorView StepInputs::positions() const {
  const int64_t at = Layout(limits_).positions;
  void* p = device_ == Device::CUDA ? device_buffer_.as<int32_t>() + at : staging(at);
  return TensorView::contiguous(p, DType::I32, device_, {tokens_});
}
TensorView StepInputs::logits_rows() const {
  const int64_t at = Layout(limits_).rows;
  void* p = device_ == Device::CUDA ? device_buffer_.as<int32_t>() + at : staging(at);
  return TensorView::contiguous(p, DType::I32, device_, {rows_});
}
const int32_t* StepInputs::host_token_ids() const { return staging(Layout(limits_).ids); }
const int32_t* StepInputs::host_positions() const { return staging(Layout(limits_).positions); }
const int32_t* StepInputs::host_logits_rows() const { return staging(Layout(limits_).rows); }

}  // namespace tvllm
