// tokenizer.json -> Tokenizer::Impl, validated field by field.
//
// A tokenizer.json (Hugging Face `tokenizers`) is one JSON object with a section per pipeline step:
//   { "added_tokens": [...], "normalizer": {...}|null, "pre_tokenizer": {...}|null, "model": {"type": "BPE",
//     "vocab": {token: id}, "merges": [...]}, "post_processor": {...}|null, "decoder": {...}|null, ... }
// Each section has a "type". We support the types Llama-family BPE tokenizers use and refuse every other
// one by name: a tokenizer that silently skipped a step would give wrong ids, which no later check sees.
// Every message says where ("tokenizer.json: model.merges[12]: ...") and, where there is one, the way out.
#include <algorithm>
#include <cstdio>
#include <limits>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

#include "common/input_error.h"
#include "json_strict.h"
#include "tokenizer_internal.h"

namespace tvllm::tok {

namespace {

using nlohmann::json;

// Ids above this are refused: real vocabularies have ~30k-260k tokens; this bounds the id table.
constexpr int64_t kMaxId = 16 * 1024 * 1024;
// Where to go when this tokenizer cannot be read (the command line takes ids instead of text).
const char kWayOut[] =
    "lesson 09 reads the BPE tokenizers of Llama 3, Llama 2, TinyLlama, Mistral, Qwen2/2.5/3, SmolLM2 and "
    "GPT-2; for another model, give the prompt as token ids (--prompt-ids)";

class Reader {
 public:
  explicit Reader(std::string what) : what_(std::move(what)) {}

  [[noreturn]] void fail(const std::string& path, const std::string& problem) const {
    throw InputError(what_ + ": " + path + ": " + problem);
  }

  static std::string kind(const json& v) {
    switch (v.type()) {
      case json::value_t::null: return "null";
      case json::value_t::boolean: return "a boolean";
      case json::value_t::string: return "a string";
      case json::value_t::array: return "an array";
      case json::value_t::object: return "an object";
      default: return "a number";
    }
  }

  const json& object(const json& v, const std::string& path) const {
    if (!v.is_object()) fail(path, "must be an object, got " + kind(v) + " " + json_snippet(v));
    return v;
  }
  const json& array(const json& v, const std::string& path) const {
    if (!v.is_array()) fail(path, "must be an array, got " + kind(v) + " " + json_snippet(v));
    return v;
  }
  // obj[key], which must exist.
  const json& at(const json& obj, const std::string& path, const char* key) const {
    auto it = obj.find(key);
    if (it == obj.end()) fail(path + "." + key, "is missing");
    return *it;
  }
  // obj[key] or nullptr when missing or null.
  static const json* optional(const json& obj, const char* key) {
    auto it = obj.find(key);
    return it == obj.end() || it->is_null() ? nullptr : &*it;
  }
  std::string string(const json& obj, const std::string& path, const char* key) const {
    const json& v = at(obj, path, key);
    if (!v.is_string()) fail(path + "." + key, "must be a string, got " + kind(v) + " " + json_snippet(v));
    return v.get<std::string>();
  }
  bool boolean(const json& obj, const std::string& path, const char* key, bool fallback) const {
    const json* v = optional(obj, key);
    if (!v) return fallback;
    if (!v->is_boolean()) fail(path + "." + key, "must be true or false, got " + json_snippet(*v));
    return v->get<bool>();
  }
  int64_t integer(const json& v, const std::string& path, int64_t lo, int64_t hi) const {
    if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(hi)))
      fail(path, "must be an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " +
                     json_snippet(v));
    const int64_t x = v.get<int64_t>();
    if (x < lo || x > hi)
      fail(path, "must be an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " +
                     std::to_string(x));
    return x;
  }
  // The "type" of a section, for dispatch.
  std::string type(const json& obj, const std::string& path) const {
    object(obj, path);
    return string(obj, path, "type");
  }
  [[noreturn]] void unsupported(const std::string& path, const std::string& type, const std::string& supported,
                                const std::string& why = "") const {
    fail(path, "type \"" + type + "\" is not supported (supported: " + supported + ")" +
                   (why.empty() ? "" : "; " + why) + "; " + kWayOut);
  }

 private:
  std::string what_;
};

// A pattern object {"String": "..."} or {"Regex": "..."}; returns the text, sets *is_regex.
std::string pattern(const Reader& r, const json& obj, const std::string& path, bool* is_regex) {
  const json& p = r.object(r.at(obj, path, "pattern"), path + ".pattern");
  if (p.size() != 1 || !p.begin().value().is_string() || (p.begin().key() != "String" && p.begin().key() != "Regex"))
    r.fail(path + ".pattern", "must be {\"String\": \"...\"} or {\"Regex\": \"...\"}, got " + json_snippet(p));
  *is_regex = p.begin().key() == "Regex";
  return p.begin().value().get<std::string>();
}

// A string that must be exactly one character ("▁", " ").
std::string one_char(const Reader& r, const json& obj, const std::string& path, const char* key) {
  std::string s = r.string(obj, path, key);
  int len = 0;
  if (!s.empty()) utf8_decode_at(s, 0, &len);
  if (s.empty() || static_cast<size_t>(len) != s.size())
    r.fail(path + "." + key, "must be one character, got \"" + s + "\"");
  return s;
}

PrependScheme prepend_scheme(const Reader& r, const json& obj, const std::string& path) {
  if (const json* v = Reader::optional(obj, "prepend_scheme")) {
    const std::string s = v->is_string() ? v->get<std::string>() : "";
    if (s == "always") return PrependScheme::Always;
    if (s == "first") return PrependScheme::First;
    if (s == "never") return PrependScheme::Never;
    r.fail(path + ".prepend_scheme", "must be \"always\", \"first\" or \"never\", got " + json_snippet(*v));
  }
  // Files written before tokenizers 0.14 say add_prefix_space instead.
  return r.boolean(obj, path, "add_prefix_space", true) ? PrependScheme::Always : PrependScheme::Never;
}

// ---- sections ----------------------------------------------------------------------------------------------

void read_normalizer(const Reader& r, const json& n, const std::string& path, Normalizer& out) {
  const std::string type = r.type(n, path);
  if (type == "Sequence") {
    const json& list = r.array(r.at(n, path, "normalizers"), path + ".normalizers");
    for (size_t i = 0; i < list.size(); ++i)
      read_normalizer(r, list[i], path + ".normalizers[" + std::to_string(i) + "]", out);
  } else if (type == "Prepend") {
    out.steps.push_back({NormalizerStep::Kind::Prepend, r.string(n, path, "prepend"), ""});
  } else if (type == "Replace") {
    bool is_regex = false;
    std::string p = pattern(r, n, path, &is_regex);
    if (is_regex) r.fail(path + ".pattern", "a Regex pattern in a Replace normalizer is not supported (String is)");
    if (p.empty()) r.fail(path + ".pattern", "must not be empty");
    out.steps.push_back({NormalizerStep::Kind::Replace, std::move(p), r.string(n, path, "content")});
  } else if (type == "NFC") {
    out.steps.push_back({NormalizerStep::Kind::NFC, "", ""});
  } else {
    r.unsupported(
        path + ".type", type, "NFC, Prepend, Replace, a Sequence of them, or null",
        type.rfind("NF", 0) == 0 ? "of the Unicode normalization forms only NFC (Qwen2's) is read" : "");
  }
}

void read_pre_tokenizer(const Reader& r, const json& p, const std::string& path,
                        std::vector<PreTokenizerStep>& out) {
  const std::string type = r.type(p, path);
  if (type == "Sequence") {
    const json& list = r.array(r.at(p, path, "pretokenizers"), path + ".pretokenizers");
    for (size_t i = 0; i < list.size(); ++i)
      read_pre_tokenizer(r, list[i], path + ".pretokenizers[" + std::to_string(i) + "]", out);
  } else if (type == "Split") {
    bool is_regex = false;
    const std::string pat = pattern(r, p, path, &is_regex);
    const std::string behavior = r.string(p, path, "behavior");
    if (behavior != "Isolated")
      r.fail(path + ".behavior", "\"" + behavior + "\" is not supported (supported: \"Isolated\", what Llama 3 uses)");
    if (r.boolean(p, path, "invert", false)) r.fail(path + ".invert", "true is not supported (false is)");
    PreTokenizerStep step;
    step.kind = PreTokenizerStep::Kind::Split;
    step.regex = compile_regex(pat, !is_regex, path + ".pattern");
    out.push_back(std::move(step));
  } else if (type == "ByteLevel") {
    PreTokenizerStep step;
    step.kind = PreTokenizerStep::Kind::ByteLevel;
    step.add_prefix_space = r.boolean(p, path, "add_prefix_space", true);  // HF's defaults
    if (r.boolean(p, path, "use_regex", true)) step.regex = compile_regex(kGpt2Regex, false, "GPT-2 regex");
    out.push_back(std::move(step));
  } else if (type == "Metaspace") {
    PreTokenizerStep step;
    step.kind = PreTokenizerStep::Kind::Metaspace;
    step.replacement = one_char(r, p, path, "replacement");
    step.prepend = prepend_scheme(r, p, path);
    step.split = r.boolean(p, path, "split", true);
    out.push_back(std::move(step));
  } else if (type == "Digits") {
    // Rust's char::is_numeric is the Unicode categories N*: one piece per digit, or per run of them.
    PreTokenizerStep step;
    step.kind = PreTokenizerStep::Kind::Split;
    const bool individual = r.boolean(p, path, "individual_digits", false);
    step.regex = compile_regex(individual ? "\\p{N}" : "\\p{N}+", false, path);
    out.push_back(std::move(step));
  } else {
    r.unsupported(path + ".type", type, "Split, ByteLevel, Metaspace, Digits, a Sequence of them, or null");
  }
}

void read_decoder(const Reader& r, const json& d, const std::string& path, DecoderSpec& out) {
  const std::string type = r.type(d, path);
  DecoderStep step{};
  if (type == "Sequence") {
    const json& list = r.array(r.at(d, path, "decoders"), path + ".decoders");
    for (size_t i = 0; i < list.size(); ++i)
      read_decoder(r, list[i], path + ".decoders[" + std::to_string(i) + "]", out);
    return;
  } else if (type == "ByteLevel") {
    step.kind = DecoderStep::Kind::ByteLevel;
  } else if (type == "Metaspace") {
    step.kind = DecoderStep::Kind::Metaspace;
    step.pattern = one_char(r, d, path, "replacement");
    step.prepend = prepend_scheme(r, d, path) != PrependScheme::Never;
  } else if (type == "Replace") {
    step.kind = DecoderStep::Kind::Replace;
    bool is_regex = false;
    step.pattern = pattern(r, d, path, &is_regex);
    if (is_regex) r.fail(path + ".pattern", "a Regex pattern in a Replace decoder is not supported (String is)");
    if (step.pattern.empty()) r.fail(path + ".pattern", "must not be empty");
    step.content = r.string(d, path, "content");
  } else if (type == "ByteFallback") {
    step.kind = DecoderStep::Kind::ByteFallback;
  } else if (type == "Fuse") {
    step.kind = DecoderStep::Kind::Fuse;
  } else if (type == "Strip") {
    step.kind = DecoderStep::Kind::Strip;
    step.content = one_char(r, d, path, "content");
    step.start = static_cast<int>(r.integer(r.at(d, path, "start"), path + ".start", 0, 1000));
    step.stop = static_cast<int>(r.integer(r.at(d, path, "stop"), path + ".stop", 0, 1000));
  } else {
    r.unsupported(path + ".type", type,
                  "ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip, a Sequence of them, or null");
  }
  // The decoder runs as a stream (decode.cpp); these orders would need to see all the text at once.
  const bool after_fuse = std::any_of(out.steps.begin(), out.steps.end(),
                                      [](const DecoderStep& s) { return s.kind == DecoderStep::Kind::Fuse; });
  if (!out.steps.empty() && out.steps.back().kind == DecoderStep::Kind::ByteLevel)
    r.fail(path, "a decoder step after ByteLevel is not supported (ByteLevel must come last)");
  if (after_fuse && (step.kind == DecoderStep::Kind::Metaspace || step.kind == DecoderStep::Kind::ByteFallback))
    r.fail(path, "\"" + type + "\" after Fuse is not supported (put it before Fuse)");
  if (after_fuse && step.kind == DecoderStep::Kind::Replace) {
    int len = 0;
    utf8_decode_at(step.pattern, 0, &len);
    if (static_cast<size_t>(len) != step.pattern.size())
      r.fail(path + ".pattern", "a Replace of more than one character after Fuse is not supported");
  }
  out.steps.push_back(std::move(step));
}

// TemplateProcessing's "single" template: the ids before and after $A.
void read_post_processor(const Reader& r, const json& p, const std::string& path, const Tokenizer::Impl& impl,
                         std::vector<int32_t>& prefix, std::vector<int32_t>& suffix, bool& have_template) {
  const std::string type = r.type(p, path);
  if (type == "Sequence") {
    const json& list = r.array(r.at(p, path, "processors"), path + ".processors");
    for (size_t i = 0; i < list.size(); ++i)
      read_post_processor(r, list[i], path + ".processors[" + std::to_string(i) + "]", impl, prefix, suffix,
                          have_template);
    return;
  }
  if (type == "ByteLevel") return;  // it only adjusts offsets, which we do not report
  if (type != "TemplateProcessing")
    r.unsupported(path + ".type", type, "TemplateProcessing, ByteLevel, a Sequence of them, or null");
  if (have_template) r.fail(path, "a second TemplateProcessing is not supported");
  have_template = true;
  const json& specials = r.object(r.at(p, path, "special_tokens"), path + ".special_tokens");
  const json& single = r.array(r.at(p, path, "single"), path + ".single");
  bool seen_a = false;
  for (size_t i = 0; i < single.size(); ++i) {
    const std::string ip = path + ".single[" + std::to_string(i) + "]";
    const json& item = r.object(single[i], ip);
    if (item.size() != 1) r.fail(ip, "must be {\"SpecialToken\": {...}} or {\"Sequence\": {...}}");
    const std::string& key = item.begin().key();
    const json& body = r.object(item.begin().value(), ip + "." + key);
    const std::string id = r.string(body, ip + "." + key, "id");
    if (key == "Sequence") {
      if (id != "A") r.fail(ip + ".Sequence.id", "must be \"A\" in the single template, got \"" + id + "\"");
      if (seen_a) r.fail(ip, "$A appears twice");
      seen_a = true;
    } else if (key == "SpecialToken") {
      const std::string sp = path + ".special_tokens[\"" + id + "\"]";
      auto it = specials.find(id);
      if (it == specials.end()) r.fail(ip + ".SpecialToken.id", "\"" + id + "\" is not in " + path + ".special_tokens");
      const json& ids = r.array(r.at(r.object(*it, sp), sp, "ids"), sp + ".ids");
      for (size_t k = 0; k < ids.size(); ++k) {
        const auto v = static_cast<int32_t>(r.integer(ids[k], sp + ".ids[" + std::to_string(k) + "]", 0, kMaxId));
        if (static_cast<size_t>(v) >= impl.has_id.size() || !impl.has_id[v])
          r.fail(sp + ".ids[" + std::to_string(k) + "]", "id " + std::to_string(v) + " names no token");
        (seen_a ? suffix : prefix).push_back(v);
      }
    } else {
      r.fail(ip, "must be {\"SpecialToken\": {...}} or {\"Sequence\": {...}}, got key \"" + key + "\"");
    }
  }
  if (!seen_a) r.fail(path + ".single", "has no {\"Sequence\": {\"id\": \"A\"}}: where would the text go?");
}

// model: {"type": "BPE", "vocab": {...}, "merges": [...], ...}
void read_model(const Reader& r, const json& m, Tokenizer::Impl& impl) {
  const std::string path = "model";
  r.object(m, path);
  if (const json* t = Reader::optional(m, "type")) {
    const std::string type = t->is_string() ? t->get<std::string>() : json_snippet(*t);
    if (type != "BPE")
      r.unsupported("model.type", type, "BPE",
                    type == "Unigram" ? "Unigram models (T5, some SentencePiece checkpoints) need Viterbi search" : "");
  }
  BpeModel& bpe = impl.model;
  if (Reader::optional(m, "dropout"))
    r.fail("model.dropout", "BPE dropout (random merges, for training) is not supported; set it to null");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (const json* v = Reader::optional(m, key); v && !(v->is_string() && v->get<std::string>().empty()))
      r.fail(std::string("model.") + key, "is not supported (Llama-family tokenizers have null), got " + json_snippet(*v));
  bpe.fuse_unk = r.boolean(m, path, "fuse_unk", false);
  bpe.byte_fallback = r.boolean(m, path, "byte_fallback", false);
  bpe.ignore_merges = r.boolean(m, path, "ignore_merges", false);

  // vocab: token -> id, ids unique.
  const json& vocab = r.object(r.at(m, path, "vocab"), "model.vocab");
  bpe.vocab.reserve(vocab.size());
  int64_t max_id = -1;
  for (const auto& [token, v] : vocab.items()) {
    const int64_t id = r.integer(v, "model.vocab[\"" + token + "\"]", 0, kMaxId);
    bpe.vocab.emplace(token, static_cast<int32_t>(id));
    max_id = std::max(max_id, id);
  }
  impl.id_to_token.assign(static_cast<size_t>(max_id + 1), std::string());
  impl.has_id.assign(static_cast<size_t>(max_id + 1), 0);
  for (const auto& [token, id] : bpe.vocab) {
    if (impl.has_id[id])
      r.fail("model.vocab", "id " + std::to_string(id) + " is given to both \"" + impl.id_to_token[id] +
                                "\" and \"" + token + "\"");
    impl.has_id[id] = 1;
    impl.id_to_token[id] = token;
  }

  if (const json* unk = Reader::optional(m, "unk_token")) {
    if (!unk->is_string()) r.fail("model.unk_token", "must be a string or null, got " + json_snippet(*unk));
    auto it = bpe.vocab.find(unk->get<std::string>());
    if (it == bpe.vocab.end()) r.fail("model.unk_token", "\"" + unk->get<std::string>() + "\" is not in model.vocab");
    bpe.unk_id = it->second;
  }
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    auto it = bpe.vocab.find(name);
    bpe.byte_tokens[b] = it == bpe.vocab.end() ? -1 : it->second;
  }

  // merges: rank = position. Two forms: "a b" (one space: tokens never contain one there) or ["a", "b"].
  const json& merges = r.array(r.at(m, path, "merges"), "model.merges");
  if (merges.size() > static_cast<size_t>(kMaxId)) r.fail("model.merges", "has too many entries");
  bpe.merges.reserve(merges.size());
  std::string left, right;
  for (size_t i = 0; i < merges.size(); ++i) {
    const std::string mp = "model.merges[" + std::to_string(i) + "]";
    const json& e = merges[i];
    if (e.is_string()) {
      const std::string& s = e.get_ref<const std::string&>();
      const size_t space = s.find(' ');
      if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos)
        r.fail(mp, "\"" + s + "\" must be two tokens separated by one space");
      left = s.substr(0, space);
      right = s.substr(space + 1);
    } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
      left = e[0].get<std::string>();
      right = e[1].get<std::string>();
    } else {
      r.fail(mp, "must be \"a b\" or [\"a\", \"b\"], got " + json_snippet(e));
    }
    auto a = bpe.vocab.find(left), b = bpe.vocab.find(right), ab = bpe.vocab.find(left + right);
    if (a == bpe.vocab.end()) r.fail(mp, "\"" + left + "\" is not in model.vocab");
    if (b == bpe.vocab.end()) r.fail(mp, "\"" + right + "\" is not in model.vocab");
    if (ab == bpe.vocab.end()) r.fail(mp, "the merged token \"" + left + right + "\" is not in model.vocab");
    // A repeated pair: the later rank wins, as in HF (its map is filled in order).
    bpe.merges[pair_key(a->second, b->second)] = {static_cast<int32_t>(i), ab->second};
  }
}

void read_added_tokens(const Reader& r, const json& list, Tokenizer::Impl& impl) {
  r.array(list, "added_tokens");
  std::unordered_set<int32_t> ids;
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string p = "added_tokens[" + std::to_string(i) + "]";
    const json& e = r.object(list[i], p);
    AddedToken t;
    t.id = static_cast<int32_t>(r.integer(r.at(e, p, "id"), p + ".id", 0, kMaxId));
    t.content = r.string(e, p, "content");
    if (t.content.empty()) r.fail(p + ".content", "must not be empty");
    t.special = r.boolean(e, p, "special", false);
    t.lstrip = r.boolean(e, p, "lstrip", false);
    t.rstrip = r.boolean(e, p, "rstrip", false);
    t.single_word = r.boolean(e, p, "single_word", false);
    t.normalized = r.boolean(e, p, "normalized", !t.special);  // HF's default
    if (!ids.insert(t.id).second) r.fail(p + ".id", "id " + std::to_string(t.id) + " is used twice");
    if (!impl.added_by_content.emplace(t.content, t.id).second)
      r.fail(p + ".content", "\"" + t.content + "\" is listed twice");
    auto in_vocab = impl.model.vocab.find(t.content);
    if (in_vocab != impl.model.vocab.end() && in_vocab->second != t.id)
      r.fail(p, "\"" + t.content + "\" has id " + std::to_string(t.id) + " here but " +
                    std::to_string(in_vocab->second) + " in model.vocab");
    if (static_cast<size_t>(t.id) < impl.has_id.size() && impl.has_id[t.id] && impl.id_to_token[t.id] != t.content)
      r.fail(p + ".id", "id " + std::to_string(t.id) + " is already the model's token \"" +
                            impl.id_to_token[t.id] + "\"");
    impl.added.push_back(std::move(t));
  }
}

std::string describe(const Tokenizer::Impl& impl) {
  std::string s = "BPE, " + std::to_string(impl.id_to_token.size()) + " ids (" +
                  std::to_string(impl.model.vocab.size()) + " model tokens, " + std::to_string(impl.added.size()) +
                  " added), " + std::to_string(impl.model.merges.size()) + " merges";
  bool byte_level = false, metaspace = false, split = false;
  for (const auto& st : impl.pre_tokenizer) {
    byte_level |= st.kind == PreTokenizerStep::Kind::ByteLevel;
    metaspace |= st.kind == PreTokenizerStep::Kind::Metaspace;
    split |= st.kind == PreTokenizerStep::Kind::Split;
  }
  if (byte_level) s += split ? ", byte-level (Split regex + ByteLevel)" : ", byte-level (GPT-2 regex)";
  if (metaspace) s += ", Metaspace";
  const bool nfc = std::any_of(impl.normalizer.steps.begin(), impl.normalizer.steps.end(),
                               [](const NormalizerStep& st) { return st.kind == NormalizerStep::Kind::NFC; });
  if (nfc) s += ", NFC";
  if (!impl.normalizer.steps.empty()) s += ", normalizer " + std::to_string(impl.normalizer.steps.size()) + " steps";
  if (impl.model.byte_fallback) s += ", byte_fallback";
  if (impl.model.ignore_merges) s += ", ignore_merges";
  if (!impl.prefix.empty() || !impl.suffix.empty())
    s += ", template adds " + std::to_string(impl.prefix.size() + impl.suffix.size()) + " id(s)";
  return s;
}

}  // namespace

std::unique_ptr<Tokenizer::Impl> load_tokenizer_json(std::string_view json_text, const std::string& what) {
  const Reader r(what);
  const json doc = parse_json_strict(json_text, what);
  if (!doc.is_object()) throw InputError(what + ": must be a JSON object, got " + Reader::kind(doc));
  auto impl = std::make_unique<Tokenizer::Impl>();
  impl->what = what;

  // A file saved after training with truncation (or padding) on keeps the setting. transformers loads it and
  // still encodes whole texts unless the caller asks (truncation=False is __call__'s default), and vLLM uses
  // such files as they are: so do we. The engine limits lengths itself (max_model_len); one line says so.
  std::string ignored;
  for (const char* key : {"truncation", "padding"})
    if (const json* v = Reader::optional(doc, key))
      ignored += std::string(ignored.empty() ? "" : ", ") + key + " " + json_snippet(*v);
  if (!ignored.empty())
    std::fprintf(stderr, "%s: %s: ignored (texts are encoded whole, as transformers does by default)\n",
                 what.c_str(), ignored.c_str());

  if (!doc.contains("model")) r.fail("model", "is missing (every tokenizer.json has one: is this a tokenizer.json?)");
  read_model(r, doc["model"], *impl);
  if (const json* a = Reader::optional(doc, "added_tokens")) read_added_tokens(r, *a, *impl);
  if (const json* n = Reader::optional(doc, "normalizer")) read_normalizer(r, *n, "normalizer", impl->normalizer);
  if (const json* p = Reader::optional(doc, "pre_tokenizer"))
    read_pre_tokenizer(r, *p, "pre_tokenizer", impl->pre_tokenizer);
  if (const json* d = Reader::optional(doc, "decoder")) {
    impl->decoder.present = true;
    read_decoder(r, *d, "decoder", impl->decoder);
  }

  // The id table covers the added tokens too (Llama 3: model ids 0..127999, added 128000..128255).
  int32_t max_id = static_cast<int32_t>(impl->id_to_token.size()) - 1;
  for (const AddedToken& t : impl->added) max_id = std::max(max_id, t.id);
  impl->id_to_token.resize(static_cast<size_t>(max_id + 1));
  impl->has_id.resize(static_cast<size_t>(max_id + 1), 0);
  impl->special.assign(static_cast<size_t>(max_id + 1), 0);
  for (const AddedToken& t : impl->added) {
    // A normalized added token decodes as the normalizer writes it (HF: Llama 2's "hello world" is the
    // token "▁hello▁world", so decode gives " hello world").
    impl->id_to_token[t.id] = t.normalized ? impl->normalizer.apply(t.content) : t.content;
    impl->has_id[t.id] = 1;
    impl->special[t.id] = t.special ? 1 : 0;
  }

  if (const json* p = Reader::optional(doc, "post_processor")) {
    bool have_template = false;
    read_post_processor(r, *p, "post_processor", *impl, impl->prefix, impl->suffix, have_template);
  }

  // Matchers: special tokens first, then the others, each in file order (HF's order: on a tie in position
  // and length, the first wins). normalized tokens are searched for as the normalizer would write them.
  std::vector<const AddedToken*> raw, norm;
  std::vector<std::string> raw_patterns, norm_patterns;
  for (int pass = 0; pass < 2; ++pass)
    for (const AddedToken& t : impl->added) {
      if (t.special != (pass == 0)) continue;
      if (t.normalized) {
        norm.push_back(&t);
        norm_patterns.push_back(impl->normalizer.apply(t.content));
      } else {
        raw.push_back(&t);
        raw_patterns.push_back(t.content);
      }
    }
  impl->raw_matcher.build(std::move(raw), std::move(raw_patterns));
  impl->normalized_matcher.build(std::move(norm), std::move(norm_patterns));
  impl->summary = describe(*impl);
  return impl;
}

}  // namespace tvllm::tok
