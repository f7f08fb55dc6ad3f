// Lesson 09, part 1: the tokenizer. Text -> token ids -> text, exactly as Hugging Face `tokenizers` does it
// for the BPE tokenizers of Llama-architecture checkpoints, read from their tokenizer.json.
//
//   text ──► added tokens ──► normalizer ──► pre-tokenizer ──► BPE model ──► (post-processor) ──► ids
//            (split out        (Llama 2:      (regex split,     (merges by     (BOS, when asked)
//             first, whole)     "▁" for " ";   byte mapping)     rank)
//                               Qwen2: NFC)
//
//   ids ──► tokens ──► decoder (ByteLevel: chars -> bytes; SentencePiece: "▁" -> " ", <0xNN> -> bytes) ──► text
//
// Two flavours are supported (README.md, "Two flavours"):
//   byte-level BPE     Llama 3, Qwen2/2.5/3, GPT-2, SmolLM2: every byte has a token; pre-tokenizer
//                      Split(regex) and/or ByteLevel; decoder ByteLevel; Qwen's normalizer NFC first
//   SentencePiece BPE  Llama 2, TinyLlama, Mistral: words start with "▁" (normalizer Prepend + Replace, or
//                      pre-tokenizer Metaspace), byte_fallback <0xNN> tokens, <unk>
// Anything else in a tokenizer.json is refused with an InputError naming the field (never silently ignored).
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace tvllm {

// An entry of tokenizer.json's "added_tokens": a string matched in the text BEFORE any other step, as a
// whole, and turned into its id. Special tokens (<|eot_id|>, <s>) are added tokens with special = true.
struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool special = false;      // decode(..., skip_special_tokens=true) drops it
  bool lstrip = false;       // the match swallows the whitespace before it
  bool rstrip = false;       // ... and after it
  bool normalized = false;   // matched in the normalized text (else in the raw text, before normalizing)
  bool single_word = false;  // only matches when no word character touches it on either side
};

class Tokenizer {
 public:
  // Reads and validates a tokenizer.json. Throws InputError naming the file, the field and the way out.
  static Tokenizer from_file(const std::filesystem::path& path);
  // The same from the file's text; `what` names it in error messages.
  static Tokenizer from_json(std::string_view json_text, const std::string& what = "tokenizer.json");

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // Hugging Face's tokenizer.encode(text, add_special_tokens=...).ids. Special-token strings inside the text
  // ARE matched (as HF does). add_special_tokens applies the post-processor (Llama: prepends BOS).
  // Throws InputError when the text is not valid UTF-8. Thread-safe (the BPE cache is locked).
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = false) const;

  // Hugging Face's tokenizer.decode(ids, skip_special_tokens=...). Bytes that do not form UTF-8 become
  // U+FFFD as HF does. Throws InputError for an id that names no token.
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;

  // One more than the largest id (model vocabulary and added tokens).
  int32_t vocab_size() const;
  std::optional<int32_t> token_to_id(std::string_view token) const;  // added tokens first, then the model
  const std::string& id_to_token(int32_t id) const;                  // throws InputError if no such id
  bool is_special(int32_t id) const;
  const std::vector<AddedToken>& added_tokens() const;
  // The ids the post-processor puts before / after the text when add_special_tokens is true.
  const std::vector<int32_t>& template_prefix() const;
  const std::vector<int32_t>& template_suffix() const;
  // One line for a learner: "BPE, 1000 ids (744 model + 256 added), byte-level, ...".
  std::string describe() const;

  struct Impl;  // tokenizer_internal.h

 private:
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  friend class IncrementalDecoder;
};

// Streaming decode for generation: ids come in one at a time, text goes out as soon as it is final.
// It never emits part of a UTF-8 character: bytes of an unfinished character (a byte-level token that is
// half of "€", a run of SentencePiece <0xNN> tokens) wait for the tokens that complete them. The
// concatenation of everything push() and finish() return equals tokenizer.decode(all ids).
//
//   IncrementalDecoder stream(tok);
//   for (int32_t id : generated) std::cout << stream.push(id) << std::flush;
//   std::cout << stream.finish();
class IncrementalDecoder {
 public:
  // The tokenizer must outlive the decoder.
  explicit IncrementalDecoder(const Tokenizer& tokenizer, bool skip_special_tokens = false);
  IncrementalDecoder(IncrementalDecoder&&) noexcept;
  ~IncrementalDecoder();
  std::string push(int32_t id);  // the text that became final with this id (often "", never half a char)
  std::string finish();          // the rest: an unfinished character becomes U+FFFD, as decode() does

 private:
  const Tokenizer* tokenizer_;
  bool skip_special_;
  struct Stream;  // decode.cpp
  std::unique_ptr<Stream> stream_;
};

}  // namespace tvllm
