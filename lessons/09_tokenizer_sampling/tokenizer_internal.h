// The pieces of a loaded tokenizer, one struct per tokenizer.json section. tokenizer_json.cpp fills them
// (and validates), the other files run them:
//   utf8.cpp          UTF-8 helpers: code points, Unicode whitespace, lossy decoding as Rust does it
//   pretokenize.cpp   added-token matching, normalizers (NFC with utf8proc), pre-tokenizers (PCRE2 regex,
//                     ByteLevel, Metaspace)
//   bpe.cpp           the BPE model: initial symbols, the merge loop, the cache
//   decode.cpp        decoders as a stream (decode() and IncrementalDecoder share it)
//   tokenizer.cpp     the encode pipeline that strings them together
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "tokenizer.h"

namespace tvllm::tok {

// ---- UTF-8 (utf8.cpp) ------------------------------------------------------------------------------------

// Length in bytes of the UTF-8 sequence that starts with `lead` (1 for a stray byte, so loops advance).
int utf8_length(unsigned char lead);
// The code point at s[i] (s must be valid UTF-8 there); *len receives its length in bytes.
uint32_t utf8_decode_at(std::string_view s, size_t i, int* len);
void utf8_append(uint32_t cp, std::string& out);
// Unicode White_Space (what Rust's char::is_whitespace and the regex crate's \s accept).
bool is_unicode_whitespace(uint32_t cp);
// How many bytes at the end of `bytes` are the beginning of a UTF-8 character whose other bytes have not
// arrived yet (0 when the bytes end on a character boundary or with bytes that can never become valid).
size_t utf8_incomplete_tail(std::string_view bytes);
// Appends `bytes` to `out` as Rust's String::from_utf8_lossy does: each maximal ill-formed subsequence
// becomes one U+FFFD (the Unicode "substitution of maximal subparts" rule, which Python's decode also uses).
void append_utf8_lossy(std::string_view bytes, std::string& out);

// ---- byte-level alphabet (pretokenize.cpp) -----------------------------------------------------------------

// GPT-2's table: byte b -> a printable character (as UTF-8). Printable bytes map to themselves; the other
// 68 (controls, space, DEL, NBSP, soft hyphen...) to U+0100.. in order. ' ' -> "Ġ" (U+0120), '\n' -> "Ċ".
const std::array<std::string, 256>& byte_to_unicode();
// The inverse, by code point: the byte, or -1 when the code point is not in the table.
int unicode_to_byte(uint32_t cp);

// ---- added tokens (pretokenize.cpp) ------------------------------------------------------------------------

// A piece of text on its way through the pipeline. at_origin: it starts at byte 0 of the caller's text
// (Metaspace's prepend_scheme "first" prepends "▁" only there).
struct Piece {
  std::string text;
  bool at_origin = false;
};

// One segment of a text split around added tokens: either text (id == -1) or one added token.
struct Segment {
  size_t begin = 0, end = 0;  // byte range in the text that was split
  int32_t id = -1;
};

// Finds added tokens in a text: leftmost match first, the longest at that position (Aho-Corasick's
// LeftmostLongest, which HF uses), honouring lstrip / rstrip / single_word.
class AddedTokenMatcher {
 public:
  // `patterns[i]` is what is searched for token `tokens[i]` (its content, or its normalized content).
  void build(std::vector<const AddedToken*> tokens, std::vector<std::string> patterns);
  bool empty() const { return tokens_.empty(); }
  std::vector<Segment> split(std::string_view text) const;

 private:
  std::vector<const AddedToken*> tokens_;
  std::vector<std::string> patterns_;
  std::array<std::vector<int>, 256> by_first_byte_;  // pattern indices, longest first
};

// ---- normalizer (pretokenize.cpp) --------------------------------------------------------------------------

struct NormalizerStep {
  // NFC: Unicode canonical composition (Qwen2's normalizer), done by utf8proc: "e" + U+0301 -> "é".
  enum class Kind { Prepend, Replace, NFC } kind;
  std::string text;         // Prepend: what to put in front; Replace: the pattern
  std::string replacement;  // Replace: what replaces it
};

// Unicode Normalization Form C of valid UTF-8 (utf8proc: decompose canonically, order the marks, compose).
std::string nfc(std::string_view s);

struct Normalizer {
  std::vector<NormalizerStep> steps;  // empty: no normalizer
  std::string apply(std::string s) const;
};

// ---- pre-tokenizer (pretokenize.cpp) -----------------------------------------------------------------------

class Regex;  // PCRE2, compiled once (pretokenize.cpp)
// Compiles `pattern` (UTF + UCP: \p{L}, \s... are Unicode) or throws InputError "<where>: ...".
std::shared_ptr<const Regex> compile_regex(const std::string& pattern, bool literal, const std::string& where);

// GPT-2's pre-tokenizer regex, which ByteLevel(use_regex: true) splits with.
inline constexpr const char* kGpt2Regex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

enum class PrependScheme { Always, First, Never };

struct PreTokenizerStep {
  enum class Kind { Split, ByteLevel, Metaspace } kind = Kind::Split;
  std::shared_ptr<const Regex> regex;  // Split; ByteLevel with use_regex
  bool add_prefix_space = false;       // ByteLevel
  std::string replacement;             // Metaspace: one character, "▁"
  PrependScheme prepend = PrependScheme::Always;
  bool split = true;                   // Metaspace
};

// Runs the steps in order; each splits every piece further (empty pieces are dropped, as HF does).
void pre_tokenize(const std::vector<PreTokenizerStep>& steps, std::vector<Piece>& pieces);

// ---- BPE model (bpe.cpp) -----------------------------------------------------------------------------------

struct MergeTarget {
  int32_t rank;    // position in model.merges: lower merges first
  int32_t new_id;  // the id of the merged token
};
using MergeMap = std::unordered_map<uint64_t, MergeTarget>;  // key: pair_key(left id, right id)
inline uint64_t pair_key(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

// One symbol of a word during merging: a doubly linked list over a vector, so that a merge is O(1).
struct BpeSymbol {
  int32_t id;
  int32_t prev;  // index of the previous live symbol, -1 at the start
  int32_t next;  // index of the next live symbol, -1 at the end
  bool removed = false;
};

// The merge loop: applies merges by rank (ties: leftmost first) until no adjacent pair has a merge.
// Removed symbols are marked; the survivors, in list order, are the word's tokens.
void bpe_merge(std::vector<BpeSymbol>& symbols, const MergeMap& merges);

struct BpeModel {
  std::unordered_map<std::string, int32_t> vocab;
  MergeMap merges;
  int32_t unk_id = -1;  // -1: no unk_token (an unknown character is dropped, as HF does)
  bool fuse_unk = false;
  bool byte_fallback = false;
  bool ignore_merges = false;
  std::array<int32_t, 256> byte_tokens{};  // byte_fallback: the id of "<0xNN>", or -1

  // Appends the ids of one pre-token (a "word").
  void tokenize(std::string_view word, std::vector<int32_t>& out) const;

 private:
  std::vector<int32_t> merge_word(std::string_view word) const;
  // Words already seen (HF keeps one too): most words of a text repeat. Bounded; words under 256 bytes.
  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache_;
};

// ---- decoder (decode.cpp) ----------------------------------------------------------------------------------

struct DecoderStep {
  enum class Kind { ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip } kind;
  std::string pattern;  // Replace: the pattern; Metaspace: the replacement character
  std::string content;  // Replace: what replaces it; Strip: the character stripped
  bool prepend = true;  // Metaspace: prepend_scheme != "never" (the first token loses its "▁")
  int start = 0;        // Strip: at most this many at the start
  int stop = 0;         // Strip: ... and at the end
};

struct DecoderSpec {
  bool present = false;           // decoder null: tokens joined with " " (what HF does)
  std::vector<DecoderStep> steps; // a Sequence, flattened
};

// The decoder as a stream of tokens: decode() pushes every token then finishes; IncrementalDecoder pushes
// them as they are generated. Both therefore produce the same text by construction; what the stream must
// get right is that the text it has emitted never changes later (it holds back what might).
class DecodeStream {
 public:
  explicit DecodeStream(const DecoderSpec& spec);
  void push(std::string_view token, std::string& out);  // appends the text that is final now
  void finish(std::string& out);                          // appends the rest

 private:
  struct Stage {
    std::string bytes;   // ByteLevel: bytes of an unfinished character; ByteFallback: the run of <0xNN> bytes
    int count = 0;       // Metaspace: tokens seen; ByteFallback: tokens in the run
    bool fused = false;  // a Fuse came before this step: it sees one long string, not tokens
    int strip_left = 0;  // Strip after Fuse: leading characters still to strip
    int held = 0;        // Strip after Fuse: trailing strip characters held back (they may be the end)
  };
  void feed(size_t stage, std::string piece, std::string& out);
  void flush(size_t stage, std::string& out);
  void flush_byte_run(size_t stage, std::string& out);

  const DecoderSpec* spec_;
  std::vector<Stage> stages_;
  size_t tokens_ = 0;  // no decoder: tokens are joined with " "
};

// ---- the whole tokenizer ----------------------------------------------------------------------------------

}  // namespace tvllm::tok

namespace tvllm {

struct Tokenizer::Impl {
  std::string what;  // the file name, for messages
  tok::BpeModel model;
  std::vector<AddedToken> added;
  tok::AddedTokenMatcher raw_matcher;         // added tokens with normalized = false (on the raw text)
  tok::AddedTokenMatcher normalized_matcher;  // normalized = true (on each normalized piece)
  tok::Normalizer normalizer;
  std::vector<tok::PreTokenizerStep> pre_tokenizer;
  std::vector<int32_t> prefix, suffix;  // TemplateProcessing "single": ids around $A
  tok::DecoderSpec decoder;
  std::vector<std::string> id_to_token;  // "" where no token has the id
  std::vector<uint8_t> has_id;           // 1 where a token has the id
  std::vector<uint8_t> special;          // 1 for special added tokens
  std::unordered_map<std::string, int32_t> added_by_content;
  std::string summary;                   // describe()
};

namespace tok {
// tokenizer_json.cpp
std::unique_ptr<Tokenizer::Impl> load_tokenizer_json(std::string_view json_text, const std::string& what);
}  // namespace tok

}  // namespace tvllm
