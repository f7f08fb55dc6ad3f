// Everything that happens to the text before the BPE model sees it:
//   added tokens      found first, whole (AddedTokenMatcher)
//   normalizer        Llama 2: Prepend("▁") + Replace(" " -> "▁"); Qwen2: NFC (utf8proc)
//   pre-tokenizer     cut the text into "words" that BPE never merges across:
//                       Split      a regex (Llama 3's), every match and every gap a piece
//                       ByteLevel  bytes -> printable characters (optionally GPT-2's regex first)
//                       Metaspace  " " -> "▁", a "▁" in front, optionally a cut before every "▁"
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/exercise.h"
#include "common/input_error.h"
#include "tokenizer_internal.h"

namespace tvllm::tok {

// ---- the byte-level alphabet -----------------------------------------------------------------------------

namespace {

std::array<std::string, 256> build_byte_table() {
  std::array<std::string, 256> table;
  // --- exercise 09.1: the byte-level alphabet ---------------------------------------------------------
  // Task: fill table[b] with the UTF-8 of the character GPT-2's bytes_to_unicode() gives byte b. Bytes
  //   that are printable stay themselves: '!'..'~' (0x21..0x7E), '¡'..'¬' (0xA1..0xAC) and '®'..'ÿ'
  //   (0xAE..0xFF). The other 68 bytes (controls, space, DEL, 0x80..0xA0, the soft hyphen 0xAD) get the
  //   code points 256, 257, ... in increasing byte order.
  // Hint: utf8_append(cp, table[b]) writes a code point as UTF-8. Byte b stays b when printable, so 'a'
  //   is "a"; ' ' (0x20) is the 33rd non-printable byte, so it becomes U+0100 + 32 = U+0120 "Ġ".
  // Hint: why bother: a vocabulary is a JSON object of strings, and every byte must be writable as one.
  // Tests: TokenizerBytes.* TokenizerCases.Llama3Style TokenizerCases.Gpt2* TokenizerDecode.Llama3Style
  // Tests: TokenizerDecode.Gpt2* TokenizerBundled.* TokenizerStream.* lesson09_tokenizer_sampling.cpu
  // Tests: TokenizerCases.Qwen2Style TokenizerDecode.Qwen2Style TokenizerQwen2.NfcAndSingleDigits
  // --- solution ---
  auto printable = [](int b) { return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE; };
  uint32_t next = 256;
  for (int b = 0; b < 256; ++b) utf8_append(printable(b) ? static_cast<uint32_t>(b) : next++, table[b]);
  // --- end of exercise 09.1 ---
  return table;
}

}  // namespace

const std::array<std::string, 256>& byte_to_unicode() {
  static const std::array<std::string, 256> table = build_byte_table();
  return table;
}

int unicode_to_byte(uint32_t cp) {
  // The table's code points are all below 256 + 68 = 324.
  static const std::array<int16_t, 324> inverse = [] {
    std::array<int16_t, 324> inv;
    inv.fill(-1);
    const auto& table = byte_to_unicode();
    for (int b = 0; b < 256; ++b) {
      int len;
      const uint32_t cp = utf8_decode_at(table[b], 0, &len);
      if (cp < inv.size()) inv[cp] = static_cast<int16_t>(b);
    }
    return inv;
  }();
  return cp < inverse.size() ? inverse[cp] : -1;
}

// ---- PCRE2 -------------------------------------------------------------------------------------------------

// A compiled pattern. Hugging Face runs these patterns with Oniguruma; PCRE2 with PCRE2_UTF (code points,
// not bytes) and PCRE2_UCP (\s, \w, \d and the POSIX classes are Unicode, like Oniguruma's) gives the same
// matches for the patterns real tokenizers use.
class Regex {
 public:
  explicit Regex(pcre2_code* code) : code_(code) {
    // JIT-compiled matching is several times faster; when the platform has no JIT, the interpreter runs.
    (void)pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Calls on_match(begin, end) for every non-overlapping match, left to right (empty matches advance one
  // character, as every regex engine's find-all does). `s` must be valid UTF-8.
  template <class F>
  void for_each_match(std::string_view s, F&& on_match) const {
    MatchState& st = match_state();
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
    size_t offset = 0;
    while (offset <= s.size()) {
      int rc = pcre2_match(code_, subject, s.size(), offset, PCRE2_NO_UTF_CHECK, st.data, st.context);
      if (rc == PCRE2_ERROR_JIT_STACKLIMIT)  // a very long match: let the interpreter do this one
        rc = pcre2_match(code_, subject, s.size(), offset, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, st.data, st.context);
      if (rc == PCRE2_ERROR_NOMATCH) return;
      if (rc < 0) throw InputError("pre-tokenizer regex failed on the text: " + error_text(rc));
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(st.data);
      const size_t b = ov[0], e = ov[1];
      on_match(b, e);
      if (e > b) {
        offset = e;
      } else {  // an empty match: step over one character
        if (b >= s.size()) return;
        int len;
        utf8_decode_at(s, b, &len);
        offset = b + len;
      }
    }
  }

  static std::string error_text(int code) {
    PCRE2_UCHAR buf[256];
    pcre2_get_error_message(code, buf, sizeof buf);
    return reinterpret_cast<const char*>(buf);
  }

 private:
  // Per-thread match buffers: encode() is const and may run on several threads at once.
  struct MatchState {
    pcre2_match_data* data = pcre2_match_data_create(1, nullptr);
    pcre2_jit_stack* stack = pcre2_jit_stack_create(32 * 1024, 4 * 1024 * 1024, nullptr);
    pcre2_match_context* context = pcre2_match_context_create(nullptr);
    MatchState() { pcre2_jit_stack_assign(context, nullptr, stack); }
    ~MatchState() {
      pcre2_match_context_free(context);
      pcre2_jit_stack_free(stack);
      pcre2_match_data_free(data);
    }
  };
  static MatchState& match_state() {
    thread_local MatchState state;
    return state;
  }

  pcre2_code* code_;
};

std::shared_ptr<const Regex> compile_regex(const std::string& pattern, bool literal, const std::string& where) {
  int error = 0;
  PCRE2_SIZE error_offset = 0;
  // PCRE2_LITERAL refuses PCRE2_UCP ("invalid option bits with PCRE2_LITERAL"): a literal has no \w or \d
  // whose meaning UCP could change, so a {"String": " "} pattern compiles without it.
  const uint32_t options = literal ? PCRE2_UTF | PCRE2_LITERAL : PCRE2_UTF | PCRE2_UCP;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), options,
                                   &error, &error_offset, nullptr);
  if (!code)
    throw InputError(where + ": the regex does not compile (PCRE2: " + Regex::error_text(error) + " at offset " +
                     std::to_string(error_offset) + ")");
  return std::make_shared<const Regex>(code);
}

// ---- added tokens ------------------------------------------------------------------------------------------

namespace {

// The regex crate's \w (HF checks single_word with it): letters, marks, digits, connector punctuation.
// PCRE2's Unicode \w is letters, numbers and '_' (plus marks in newer PCRE2): the same for every case that
// matters (an ASCII or letter neighbour), a rare mark or Nl/No number may differ.
bool is_word_char(std::string_view s, size_t at) {
  static const std::shared_ptr<const Regex> word = compile_regex("^\\w", false, "internal \\w");
  int len;
  utf8_decode_at(s, at, &len);
  bool found = false;
  word->for_each_match(s.substr(at, len), [&](size_t, size_t) { found = true; });
  return found;
}

// Start of the last character of s[0, end).
size_t previous_char(std::string_view s, size_t end) {
  size_t i = end - 1;
  while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
  return i;
}

}  // namespace

void AddedTokenMatcher::build(std::vector<const AddedToken*> tokens, std::vector<std::string> patterns) {
  tokens_ = std::move(tokens);
  patterns_ = std::move(patterns);
  for (auto& bucket : by_first_byte_) bucket.clear();
  for (size_t i = 0; i < patterns_.size(); ++i)
    if (!patterns_[i].empty())
      by_first_byte_[static_cast<unsigned char>(patterns_[i][0])].push_back(static_cast<int>(i));
  // Longest first, so the first pattern that matches at a position is the longest there; equal lengths
  // keep the order HF gives them (special tokens first, then the others, each in file order).
  for (auto& bucket : by_first_byte_)
    std::stable_sort(bucket.begin(), bucket.end(),
                     [&](int a, int b) { return patterns_[a].size() > patterns_[b].size(); });
}

std::vector<Segment> AddedTokenMatcher::split(std::string_view text) const {
  std::vector<Segment> out;
  size_t start_offset = 0;  // end of what has been emitted
  size_t pos = 0;           // where the search continues (after the previous match, even a discarded one)
  const size_t n = text.size();
  while (pos < n) {
    // The leftmost position where some pattern matches, and the longest pattern there.
    int found = -1;
    size_t at = pos;
    for (; at < n && found < 0; ++at)
      for (int k : by_first_byte_[static_cast<unsigned char>(text[at])])
        if (text.compare(at, patterns_[k].size(), patterns_[k]) == 0) {
          found = k;
          break;
        }
    if (found < 0) break;
    --at;  // the loop stepped past the match position
    size_t start = at, stop = at + patterns_[found].size();
    pos = stop;
    const AddedToken& t = *tokens_[found];
    if (t.single_word) {
      const bool word_before = start > 0 && is_word_char(text, previous_char(text, start));
      const bool word_after = stop < n && is_word_char(text, stop);
      if (word_before || word_after) continue;  // part of a longer word: not this token
    }
    if (t.lstrip) {  // swallow the whitespace before it (not what an earlier token already took)
      size_t s = start;
      while (s > 0) {
        const size_t p = previous_char(text, s);
        int len;
        if (!is_unicode_whitespace(utf8_decode_at(text, p, &len))) break;
        s = p;
      }
      start = std::max(s, start_offset);
    }
    if (t.rstrip) {  // ... and after it
      while (stop < n) {
        int len;
        if (!is_unicode_whitespace(utf8_decode_at(text, stop, &len))) break;
        stop += len;
      }
    }
    start = std::max(start, start_offset);
    if (start_offset < start) out.push_back({start_offset, start, -1});
    out.push_back({start, stop, t.id});
    start_offset = stop;
    pos = std::max(pos, stop);
  }
  if (start_offset < n) out.push_back({start_offset, n, -1});
  return out;
}

// ---- normalizer --------------------------------------------------------------------------------------------

std::string nfc(std::string_view s) {
  if (s.empty()) return {};
  // The flags of utf8proc_NFC(), which we cannot call: it stops at the first NUL byte, and a text may hold
  // one. With an explicit length every byte is read. STABLE: the composition Unicode fixed forever (the
  // normalization stability policy), which is what every NFC implementation, Rust's included, produces.
  utf8proc_uint8_t* out = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()),
                                          static_cast<utf8proc_ssize_t>(s.size()), &out,
                                          static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  if (n < 0) throw InputError(std::string("NFC normalization failed (utf8proc: ") + utf8proc_errmsg(n) + ")");
  std::string result(reinterpret_cast<const char*>(out), static_cast<size_t>(n));
  std::free(out);
  return result;
}

std::string Normalizer::apply(std::string s) const {
  for (const NormalizerStep& step : steps) {
    if (step.kind == NormalizerStep::Kind::NFC) {
      s = nfc(s);
    } else if (step.kind == NormalizerStep::Kind::Prepend) {
      if (!s.empty()) s.insert(0, step.text);  // HF prepends nothing to an empty string
    } else {
      std::string out;
      size_t from = 0;
      for (size_t hit; (hit = s.find(step.text, from)) != std::string::npos; from = hit + step.text.size())
        out.append(s, from, hit - from).append(step.replacement);
      out.append(s, from, std::string::npos);
      s = std::move(out);
    }
  }
  return s;
}

// ---- pre-tokenizers ----------------------------------------------------------------------------------------

namespace {

// Cuts `piece` at the regex's matches: every match is a piece and so is every gap between them
// (HF's behavior "Isolated").
void split_isolated(const Regex& re, Piece&& piece, std::vector<Piece>& out) {
  const std::string& s = piece.text;
  size_t last = 0;
  auto emit = [&](size_t b, size_t e) {
    if (e > b) out.push_back({s.substr(b, e - b), piece.at_origin && b == 0});
  };
  re.for_each_match(s, [&](size_t b, size_t e) {
    emit(last, b);
    emit(b, e);
    last = e;
  });
  emit(last, s.size());
}

std::string to_byte_level(std::string_view s) {
  const auto& table = byte_to_unicode();
  std::string out;
  out.reserve(s.size() * 2);
  for (unsigned char c : s) out += table[c];
  return out;
}

}  // namespace

void pre_tokenize(const std::vector<PreTokenizerStep>& steps, std::vector<Piece>& pieces) {
  for (const PreTokenizerStep& step : steps) {
    std::vector<Piece> next;
    next.reserve(pieces.size());
    for (Piece& piece : pieces) {
      switch (step.kind) {
        case PreTokenizerStep::Kind::Split:
          split_isolated(*step.regex, std::move(piece), next);
          break;
        case PreTokenizerStep::Kind::ByteLevel: {
          if (step.add_prefix_space && piece.text[0] != ' ') piece.text.insert(0, 1, ' ');
          const size_t first = next.size();
          if (step.regex)
            split_isolated(*step.regex, std::move(piece), next);
          else
            next.push_back(std::move(piece));
          for (size_t k = first; k < next.size(); ++k) next[k].text = to_byte_level(next[k].text);
          break;
        }
        case PreTokenizerStep::Kind::Metaspace: {
          std::string s;  // " " -> "▁"
          for (char c : piece.text) {
            if (c == ' ') s += step.replacement;
            else s += c;
          }
          const bool starts = s.compare(0, step.replacement.size(), step.replacement) == 0;
          if (!starts && (step.prepend == PrependScheme::Always ||
                          (step.prepend == PrependScheme::First && piece.at_origin)))
            s.insert(0, step.replacement);
          if (!step.split) {
            next.push_back({std::move(s), piece.at_origin});
            break;
          }
          // A cut before every "▁" (HF's "MergedWithNext": the "▁" starts the next word).
          size_t from = 0;
          for (size_t hit = s.find(step.replacement, 1); hit != std::string::npos;
               hit = s.find(step.replacement, hit + 1)) {
            next.push_back({s.substr(from, hit - from), piece.at_origin && from == 0});
            from = hit;
          }
          next.push_back({s.substr(from), piece.at_origin && from == 0});
          break;
        }
      }
    }
    pieces.clear();
    for (Piece& p : next)
      if (!p.text.empty()) pieces.push_back(std::move(p));
  }
}

}  // namespace tvllm::tok
