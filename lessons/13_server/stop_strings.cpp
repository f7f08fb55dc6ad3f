// Stop strings on decoded text (stop_strings.h).
#include "stop_strings.h"

#include <algorithm>

#include "common/exercise.h"

namespace tvllm::server {

StopMatcher::StopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {
  // An empty stop string would match before the first character: the request parser refuses it.
  stops_.erase(std::remove(stops_.begin(), stops_.end(), std::string()), stops_.end());
}

std::string StopMatcher::push(std::string_view text) {
  // --- exercise 13.2: the stop-string matcher ---------------------------------------------------------------
  // Task: append text to held_ and decide what to release.
  //   1. After a stop (stopped_), release nothing.
  //   2. Find the EARLIEST position in held_ where any of stops_ begins. If there is one: release held_ up to
  //      that position (the stop string and anything after it are dropped), clear held_, set stopped_.
  //   3. Otherwise hold back the longest end of held_ that is a proper prefix of some stop string (it could
  //      still become one when more text comes) and release everything before it.
  //   With no stop strings everything is released at once.
  // Hint: a stop string cannot straddle released text: whatever could have been its beginning was held back,
  //   so searching held_ alone is enough. The held-back end begins where a stop string begins, on a UTF-8
  //   character boundary, so the released text is never half a character.
  // Tests: Protocol13.StopMatcher* Server13.StopStrings
  // --- solution ---
  if (stopped_) return {};
  held_.append(text);
  size_t first = std::string::npos;
  for (const std::string& s : stops_) first = std::min(first, held_.find(s));
  if (first != std::string::npos) {
    std::string out = held_.substr(0, first);
    held_.clear();
    stopped_ = true;
    return out;
  }
  size_t keep = 0;  // the longest end of held_ that a stop string starts with
  for (const std::string& s : stops_) {
    for (size_t n = std::min(held_.size(), s.size() - 1); n > keep; --n) {
      if (held_.compare(held_.size() - n, n, s, 0, n) == 0) {
        keep = n;
        break;
      }
    }
  }
  std::string out = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return out;
  // --- end of exercise 13.2 ---
}

std::string StopMatcher::flush() {
  if (stopped_) return {};
  std::string out;
  out.swap(held_);
  return out;
}

OutputText::OutputText(const Tokenizer* tokenizer, std::vector<std::string> stops)
    : matcher_(std::move(stops)) {
  if (tokenizer) decoder_.emplace(*tokenizer, /*skip_special_tokens=*/true);
}

std::string OutputText::push(int32_t id) {
  if (matcher_.stopped()) return {};
  ++tokens_;
  ids_.push_back(id);
  if (!decoder_) return {};
  if (matcher_.stops().empty()) return decoder_->push(id);  // nothing to hold back
  return matcher_.push(decoder_->push(id));
}

std::string OutputText::finish() {
  if (matcher_.stopped()) return {};
  if (!decoder_) return {};
  if (matcher_.stops().empty()) return decoder_->finish();
  std::string out = matcher_.push(decoder_->finish());  // the decoder's last bytes may still complete a stop
  return out + matcher_.flush();
}

}  // namespace tvllm::server
