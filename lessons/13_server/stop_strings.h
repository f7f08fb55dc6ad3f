// Lesson 13: from the engine's ids to the text a client sees, with OpenAI's stop strings.
//
//   ids ──► IncrementalDecoder (lesson 09: never half a UTF-8 character) ──► StopMatcher ──► text out
//
// A stop string ("\n\n", "User:") ends the completion where it first appears in the decoded text; the stop string
// itself is not returned and finish_reason is "stop". It is matched on TEXT, not ids: "User:" may be one token
// or three, and may start in the middle of one.
//
// Streaming makes this subtle: once text is sent it cannot be taken back. With stop ["User:"], the pieces
//   "Hi! " "Us" "er:"  must come out as  "Hi! "  and then nothing
// so "Us" is HELD BACK while it could still grow into a stop string, and released as soon as it cannot
// ("Us" + "ing" -> "Using" goes out). The matcher holds back the longest end of its text that is a prefix of
// some stop string, never more: a client sees every other character as soon as the decoder has it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer.h"

namespace tvllm::server {

class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops);

  // Appends `text` and returns what can be released now: everything before the earliest stop string, or, when
  // none has appeared, everything but the held-back end. After a match stopped() is true and push() returns "".
  std::string push(std::string_view text);
  // At the end of the generation (no stop string appeared): the held-back text, released.
  std::string flush();
  bool stopped() const { return stopped_; }
  const std::vector<std::string>& stops() const { return stops_; }

 private:
  std::vector<std::string> stops_;
  std::string held_;  // decoded, not yet released
  bool stopped_ = false;
};

// One request's output text: the incremental decoder (special tokens skipped, as vLLM and `tiny-vllm generate`
// do), then the stop strings. Counts the ids it consumed: a stop string's completion_tokens end with the id
// that completed it. Without a tokenizer (a model directory with no tokenizer.json) there is no text: only ids.
class OutputText {
 public:
  // The tokenizer (nullptr: ids only) must outlive this object.
  OutputText(const Tokenizer* tokenizer, std::vector<std::string> stops);
  std::string push(int32_t id);  // the text released by this id (often ""); nothing after stopped()
  std::string finish();          // the rest, at the end of the generation
  bool stopped() const { return matcher_.stopped(); }
  int64_t tokens() const { return tokens_; }
  const std::vector<int32_t>& ids() const { return ids_; }

 private:
  std::optional<IncrementalDecoder> decoder_;
  StopMatcher matcher_;
  int64_t tokens_ = 0;
  std::vector<int32_t> ids_;
};

}  // namespace tvllm::server
