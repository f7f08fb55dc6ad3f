// ids -> text. Each id becomes its token string; the decoder steps turn the strings into text:
//
//   byte-level   ByteLevel      every character of a token stands for one byte (the table of
//                               pretokenize.cpp, read backwards); the bytes are UTF-8 text
//   SentencePiece Replace("▁"," ")  "▁the" -> " the"
//                ByteFallback   a run <0xE2><0x82><0xAC> -> the bytes E2 82 AC -> "€"
//                Fuse           all pieces into one string
//                Strip(" ",1,0) drop the one space in front (the "▁" the normalizer added)
//                Metaspace      Replace + Strip in one step ("▁" -> " ", the first token loses its "▁")
//
// Everything runs as a stream (DecodeStream): a token goes in, the text that can no longer change comes
// out. decode() is "push every token, then finish", so IncrementalDecoder cannot disagree with it.
#include <string>
#include <string_view>
#include <vector>

#include "common/exercise.h"
#include "common/input_error.h"
#include "json_strict.h"
#include "tokenizer_internal.h"

namespace tvllm {
namespace tok {

namespace {

const char kReplacementChar[] = "\xEF\xBF\xBD";  // U+FFFD

std::string replace_all(std::string_view s, const std::string& pattern, const std::string& with) {
  std::string out;
  size_t from = 0;
  for (size_t hit; (hit = s.find(pattern, from)) != std::string_view::npos; from = hit + pattern.size())
    out.append(s.substr(from, hit - from)).append(with);
  out.append(s.substr(from));
  return out;
}

// "<0x41>" -> 0x41; -1 when the token is not a byte token.
int byte_token_value(std::string_view t) {
  if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') return -1;
  auto hex = [](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  const int hi = hex(t[3]), lo = hex(t[4]);
  return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

// The bytes a byte-level token stands for. A token with a character outside the table (an added token such
// as "<|x y|>" with a real space) stands for its own UTF-8 bytes, as in HF.
void byte_level_bytes(std::string_view token, std::string& bytes) {
  const size_t start = bytes.size();
  for (size_t i = 0; i < token.size();) {
    int len;
    const int b = unicode_to_byte(utf8_decode_at(token, i, &len));
    if (b < 0) {
      bytes.resize(start);
      bytes.append(token);
      return;
    }
    bytes += static_cast<char>(b);
    i += len;
  }
}

// Strip on one token: at most `start` copies of `c` at the front and `stop` at the back.
std::string strip_token(std::string s, const std::string& c, int start, int stop) {
  size_t front = 0;
  for (int k = 0; k < start && s.compare(front, c.size(), c) == 0; ++k) front += c.size();
  size_t back = s.size();
  for (int k = 0; k < stop && back >= front + c.size() && s.compare(back - c.size(), c.size(), c) == 0; ++k)
    back -= c.size();
  return s.substr(front, back - front);
}

}  // namespace

DecodeStream::DecodeStream(const DecoderSpec& spec) : spec_(&spec), stages_(spec.steps.size()) {
  bool fused = false;
  for (size_t k = 0; k < spec.steps.size(); ++k) {
    stages_[k].fused = fused;
    if (spec.steps[k].kind == DecoderStep::Kind::Fuse) fused = true;
    if (spec.steps[k].kind == DecoderStep::Kind::Strip) stages_[k].strip_left = spec.steps[k].start;
  }
}

void DecodeStream::push(std::string_view token, std::string& out) {
  if (!spec_->present) {  // no decoder: HF joins the tokens with spaces
    if (tokens_++ > 0) out += ' ';
    out.append(token);
    return;
  }
  feed(0, std::string(token), out);
}

void DecodeStream::finish(std::string& out) {
  if (spec_->present) flush(0, out);
}

void DecodeStream::feed(size_t k, std::string piece, std::string& out) {
  if (k == spec_->steps.size()) {
    out += piece;
    return;
  }
  const DecoderStep& step = spec_->steps[k];
  Stage& st = stages_[k];
  switch (step.kind) {
    case DecoderStep::Kind::ByteLevel: {
      // --- exercise 09.3: never half a character ----------------------------------------------------------
      // Task: append the bytes this token stands for to st.bytes (byte_level_bytes does it), then pass on
      //   (feed(k + 1, text, out)) the text of every byte that can no longer change, and keep the rest in
      //   st.bytes. Bytes that are the start of a character whose other bytes have not come yet must wait:
      //   the next token may complete it. Bytes that can never be valid UTF-8 become U+FFFD now, exactly
      //   as decode() of all the ids would turn them (append_utf8_lossy does that conversion).
      // Hint: utf8_incomplete_tail(bytes) is the number of bytes at the end that must wait.
      // Hint: finish() (flush below) turns whatever still waits into U+FFFD.
      // Tests: TokenizerStream.* TokenizerDecode.Llama3Style TokenizerDecode.Gpt2* TokenizerCases.Llama3Style
      // Tests: TokenizerCases.Gpt2* TokenizerBundled.* lesson09_tokenizer_sampling.cpu
      // Tests: TokenizerCases.Qwen2Style TokenizerDecode.Qwen2Style
      // --- solution ---
      byte_level_bytes(piece, st.bytes);
      const size_t ready = st.bytes.size() - utf8_incomplete_tail(st.bytes);
      if (ready == 0) return;
      std::string text;
      append_utf8_lossy(std::string_view(st.bytes).substr(0, ready), text);
      st.bytes.erase(0, ready);
      feed(k + 1, std::move(text), out);
      // --- end of exercise 09.3 ---
      return;
    }
    case DecoderStep::Kind::Metaspace: {
      // HF drops every "▁" of the first token (not only a leading one) unless prepend_scheme is "never".
      const bool first = st.count++ == 0;
      feed(k + 1, replace_all(piece, step.pattern, first && step.prepend ? "" : " "), out);
      return;
    }
    case DecoderStep::Kind::Replace:
      feed(k + 1, replace_all(piece, step.pattern, step.content), out);
      return;
    case DecoderStep::Kind::ByteFallback: {
      const int b = byte_token_value(piece);
      if (b >= 0) {  // part of a run: wait for its end to know whether the bytes are UTF-8
        st.bytes += static_cast<char>(b);
        ++st.count;
        return;
      }
      flush_byte_run(k, out);
      feed(k + 1, std::move(piece), out);
      return;
    }
    case DecoderStep::Kind::Fuse:
      feed(k + 1, std::move(piece), out);
      return;
    case DecoderStep::Kind::Strip: {
      if (!st.fused) {  // on each token
        feed(k + 1, strip_token(std::move(piece), step.content, step.start, step.stop), out);
        return;
      }
      // After Fuse the steps see ONE string: strip its start once, and hold back characters that might
      // turn out to be its end.
      const std::string& c = step.content;
      size_t front = 0;
      while (st.strip_left > 0 && piece.compare(front, c.size(), c) == 0) front += c.size(), --st.strip_left;
      piece.erase(0, front);
      if (piece.empty()) return;
      st.strip_left = 0;
      if (step.stop > 0) {
        size_t back = piece.size();
        int run = 0;
        while (back >= c.size() && piece.compare(back - c.size(), c.size(), c) == 0) back -= c.size(), ++run;
        if (back == 0) {  // nothing but strip characters: all of them may be the end
          st.held += run;
          return;
        }
        std::string text;
        for (int i = 0; i < st.held; ++i) text += c;
        text.append(piece, 0, back);
        st.held = run;
        piece = std::move(text);
      }
      feed(k + 1, std::move(piece), out);
      return;
    }
  }
}

void DecodeStream::flush_byte_run(size_t k, std::string& out) {
  Stage& st = stages_[k];
  if (st.count == 0) return;
  std::string bytes = std::move(st.bytes);
  const int n = st.count;
  st.bytes.clear();
  st.count = 0;
  if (is_valid_utf8(bytes)) {
    feed(k + 1, std::move(bytes), out);
  } else {  // HF: one U+FFFD per byte token of an invalid run
    for (int i = 0; i < n; ++i) feed(k + 1, kReplacementChar, out);
  }
}

void DecodeStream::flush(size_t k, std::string& out) {
  if (k == spec_->steps.size()) return;
  const DecoderStep& step = spec_->steps[k];
  Stage& st = stages_[k];
  if (step.kind == DecoderStep::Kind::ByteLevel && !st.bytes.empty()) {
    std::string text;
    append_utf8_lossy(st.bytes, text);  // an unfinished character at the very end: U+FFFD
    st.bytes.clear();
    feed(k + 1, std::move(text), out);
  } else if (step.kind == DecoderStep::Kind::ByteFallback) {
    flush_byte_run(k, out);
  } else if (step.kind == DecoderStep::Kind::Strip && st.fused && st.held > 0) {
    std::string text;
    for (int i = step.stop; i < st.held; ++i) text += step.content;
    st.held = 0;
    if (!text.empty()) feed(k + 1, std::move(text), out);
  }
  flush(k + 1, out);
}

}  // namespace tok

// ---- the public decode API ---------------------------------------------------------------------------------

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  tok::DecodeStream stream(impl_->decoder);
  std::string out;
  for (int32_t id : ids) {
    const std::string& token = id_to_token(id);  // throws InputError for an unknown id
    if (skip_special_tokens && impl_->special[id]) continue;
    stream.push(token, out);
  }
  stream.finish(out);
  return out;
}

struct IncrementalDecoder::Stream {
  explicit Stream(const tok::DecoderSpec& spec) : stream(spec) {}
  tok::DecodeStream stream;
};

IncrementalDecoder::IncrementalDecoder(const Tokenizer& tokenizer, bool skip_special_tokens)
    : tokenizer_(&tokenizer),
      skip_special_(skip_special_tokens),
      stream_(std::make_unique<Stream>(tokenizer.impl_->decoder)) {}
IncrementalDecoder::IncrementalDecoder(IncrementalDecoder&&) noexcept = default;
IncrementalDecoder::~IncrementalDecoder() = default;

std::string IncrementalDecoder::push(int32_t id) {
  const std::string& token = tokenizer_->id_to_token(id);
  std::string out;
  if (skip_special_ && tokenizer_->impl_->special[id]) return out;
  stream_->stream.push(token, out);
  return out;
}

std::string IncrementalDecoder::finish() {
  std::string out;
  stream_->stream.finish(out);
  return out;
}

}  // namespace tvllm
