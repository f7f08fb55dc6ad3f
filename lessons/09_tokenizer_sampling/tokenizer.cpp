// The encode pipeline, step by step as Hugging Face runs it (tokenizer.h has the picture):
//
//   "Hi<|eot_id|> there"
//   1. added tokens (raw text)      "Hi" | <|eot_id|> | " there"           special strings are matched, whole
//   2. normalizer, per text piece   Llama 2: " there" -> "▁▁there"
//   3. added tokens (normalized)    tokens with normalized: true, matched in the normalized piece
//   4. pre-tokenizer                Llama 3: " there" -> " there" (one regex match); byte-level: "Ġthere"
//   5. BPE on each word             "Ġthere" -> [ids]
//   6. post-processor, if asked     [<|begin_of_text|>] + ids
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "common/input_error.h"
#include "json_strict.h"
#include "tokenizer_internal.h"

namespace tvllm {

namespace {
constexpr std::uintmax_t kMaxTokenizerFileBytes = 512ull << 20;  // Llama 3's is 9 MB
}  // namespace

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::from_json(std::string_view json_text, const std::string& what) {
  return Tokenizer(tok::load_tokenizer_json(json_text, what));
}

Tokenizer Tokenizer::from_file(const std::filesystem::path& path) {
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  if (ec) throw InputError(path.string() + ": cannot read the tokenizer (" + ec.message() + ")");
  if (size > kMaxTokenizerFileBytes)
    throw InputError(path.string() + ": " + std::to_string(size) + " bytes is too large for a tokenizer.json");
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  if (!in) throw InputError(path.string() + ": cannot read the tokenizer");
  return from_json(text.str(), path.string());
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  size_t bad = 0;
  if (!is_valid_utf8(text, &bad))
    throw InputError("text to encode is not valid UTF-8 (byte " + std::to_string(bad) + ")");
  const Impl& m = *impl_;
  std::vector<int32_t> ids;
  if (add_special_tokens) ids = m.prefix;
  std::vector<tok::Piece> pieces;
  for (const tok::Segment& raw : m.raw_matcher.split(text)) {
    if (raw.id >= 0) {
      ids.push_back(raw.id);
      continue;
    }
    std::string_view normalized = text.substr(raw.begin, raw.end - raw.begin);
    std::string storage;  // only a normalizer needs a copy
    if (!m.normalizer.steps.empty()) normalized = storage = m.normalizer.apply(std::string(normalized));
    for (const tok::Segment& seg : m.normalized_matcher.split(normalized)) {
      if (seg.id >= 0) {
        ids.push_back(seg.id);
        continue;
      }
      pieces.clear();
      pieces.push_back({std::string(normalized.substr(seg.begin, seg.end - seg.begin)), raw.begin == 0 && seg.begin == 0});
      tok::pre_tokenize(m.pre_tokenizer, pieces);
      for (const tok::Piece& word : pieces) m.model.tokenize(word.text, ids);
    }
  }
  if (add_special_tokens) ids.insert(ids.end(), m.suffix.begin(), m.suffix.end());
  return ids;
}

int32_t Tokenizer::vocab_size() const { return static_cast<int32_t>(impl_->id_to_token.size()); }

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  const std::string key(token);
  if (auto it = impl_->added_by_content.find(key); it != impl_->added_by_content.end()) return it->second;
  if (auto it = impl_->model.vocab.find(key); it != impl_->model.vocab.end()) return it->second;
  return std::nullopt;
}

const std::string& Tokenizer::id_to_token(int32_t id) const {
  if (id < 0 || id >= vocab_size() || !impl_->has_id[id])
    throw InputError("token id " + std::to_string(id) + " names no token (the vocabulary has ids 0.." +
                     std::to_string(vocab_size() - 1) + ")");
  return impl_->id_to_token[id];
}

bool Tokenizer::is_special(int32_t id) const { return id >= 0 && id < vocab_size() && impl_->special[id]; }
const std::vector<AddedToken>& Tokenizer::added_tokens() const { return impl_->added; }
const std::vector<int32_t>& Tokenizer::template_prefix() const { return impl_->prefix; }
const std::vector<int32_t>& Tokenizer::template_suffix() const { return impl_->suffix; }
std::string Tokenizer::describe() const { return impl_->summary; }

}  // namespace tvllm
