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
  // Task: return the text that can be released now (the contract; the design is yours). Over all the
  //   push() calls of a generation, what push() and flush() release, concatenated, is the text up to the
  //   EARLIEST place where any of stops_ occurs, without it; when none occurs, all of it. Release as early as
  //   that allows: hold back only an end of the text that could still grow into a stop string. After a stop,
  //   stopped_ is true and push() releases nothing more. held_ is yours to keep what waits; flush() below
  //   releases it at the end.
  // Hint: a stop string cannot straddle released text (whatever could have been its beginning was held back),
  //   so searching what is held is enough. The held-back end begins where a stop string begins, on a UTF-8
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
