// Lesson 09: the tokenizer against Hugging Face `tokenizers`.
//
//   TokenizerCases.*    every fixture of tests/data/tokenizers (weights/tools/make_tokenizer_cases.py): for
//                       each of ~350 texts, encode == HF's ids, decode == HF's decode, the incremental decoder
//                       == decode, and (some texts) add_special_tokens == HF
//   TokenizerDecode.*   random id sequences (broken UTF-8, byte-fallback runs, special tokens) == HF's decode
//   TokenizerBundled.*  the bundled model's tokenizer: the same cases, and its reference/tokenizer_cases.json
//   TokenizerStream.*   at every split point the incremental decoder has emitted a prefix of the full text,
//                       whole characters only, and everything that can no longer change
//   TokenizerBytes.*, TokenizerBpe.*   the byte table and the merge loop on their own
//   TokenizerJson.*     malformed tokenizer.json files: each an InputError naming the field
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <functional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/input_error.h"
#include "json_strict.h"
#include "testing/testing.h"
#include "tokenizer.h"
#include "tokenizer_internal.h"

namespace tvllm {
namespace {

using nlohmann::json;

std::filesystem::path fixtures_dir() { return testing::test_data_dir() / "tokenizers"; }

json read_json(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << "cannot read " << path << " (make it with weights/tools/make_tokenizer_cases.py)";
  std::ostringstream s;
  s << in.rdbuf();
  return json::parse(s.str());
}

std::string show(const std::vector<int32_t>& ids, size_t max = 16) {
  std::string s = "[";
  for (size_t i = 0; i < ids.size() && i < max; ++i) s += (i ? ", " : "") + std::to_string(ids[i]);
  return s + (ids.size() > max ? ", ...]" : "]");
}

// The text the incremental decoder emits, id by id; `pieces` (optional) receives each push's output.
std::string stream_decode(const Tokenizer& tok, const std::vector<int32_t>& ids, bool skip_special = false,
                          std::vector<std::string>* pieces = nullptr) {
  IncrementalDecoder stream(tok, skip_special);
  std::string out;
  for (int32_t id : ids) {
    std::string piece = stream.push(id);
    if (pieces) pieces->push_back(piece);
    out += piece;
  }
  std::string rest = stream.finish();
  if (pieces) pieces->push_back(rest);
  return out + rest;
}

// Checks one *.cases.json: returns how many cases passed; each failure is reported (the first few in full).
void check_cases(const Tokenizer& tok, const json& doc, const std::string& label) {
  int passed = 0, failed = 0;
  auto fail = [&](const std::string& name, const std::string& what) {
    if (failed++ < 8) ADD_FAILURE() << label << " case " << name << ": " << what;
  };
  for (const json& c : doc.at("cases")) {
    const std::string name = c.at("name"), text = c.at("text");
    const std::vector<int32_t> want = c.at("ids");
    const std::vector<int32_t> got = tok.encode(text);
    if (got != want) {
      fail(name, "encode: got " + show(got) + " (" + std::to_string(got.size()) + " ids), HF " + show(want) + " (" +
                     std::to_string(want.size()) + " ids)");
      continue;
    }
    const std::string decoded = c.value("decoded", text);  // absent: HF round-trips the text
    const std::string our_decoded = tok.decode(want);
    if (our_decoded != decoded) {
      fail(name, "decode: got \"" + our_decoded + "\", HF \"" + decoded + "\"");
      continue;
    }
    if (stream_decode(tok, want) != decoded) {
      fail(name, "the incremental decoder's text differs from decode()");
      continue;
    }
    if (c.contains("ids_with_special")) {
      const std::vector<int32_t> want_sp = c.at("ids_with_special");
      const std::vector<int32_t> got_sp = tok.encode(text, /*add_special_tokens=*/true);
      if (got_sp != want_sp) {
        fail(name, "encode(add_special_tokens=true): got " + show(got_sp) + ", HF " + show(want_sp));
        continue;
      }
    }
    ++passed;
  }
  EXPECT_EQ(failed, 0) << label << ": " << failed << " of " << doc.at("cases").size() << " cases differ from HF";
  EXPECT_GT(passed, 300) << label << ": the fixture should hold a few hundred cases";
  std::printf("%s: %d of %zu cases equal Hugging Face\n", label.c_str(), passed, doc.at("cases").size());
}

void check_decode_cases(const Tokenizer& tok, const json& doc, const std::string& label) {
  int failed = 0, n = 0;
  for (const json& c : doc.at("decode_cases")) {
    const std::vector<int32_t> ids = c.at("ids");
    for (bool skip : {false, true}) {
      const std::string want = c.at(skip ? "text_skip_special" : "text");
      const std::string got = tok.decode(ids, skip);
      const std::string streamed = stream_decode(tok, ids, skip);
      if ((got != want || streamed != want) && failed++ < 8)
        ADD_FAILURE() << label << " decode " << show(ids) << (skip ? " skip_special_tokens" : "") << ": got \""
                      << got << "\", streamed \"" << streamed << "\", HF \"" << want << "\"";
      ++n;
    }
  }
  EXPECT_EQ(failed, 0) << label << ": " << failed << " of " << n << " decodes differ from HF";
}

void check_fixture(const std::string& name) {
  const Tokenizer tok = Tokenizer::from_file(fixtures_dir() / (name + ".tokenizer.json"));
  const json doc = read_json(fixtures_dir() / (name + ".cases.json"));
  check_cases(tok, doc, name);
}

void check_fixture_decodes(const std::string& name) {
  const Tokenizer tok = Tokenizer::from_file(fixtures_dir() / (name + ".tokenizer.json"));
  check_decode_cases(tok, read_json(fixtures_dir() / (name + ".cases.json")), name);
}

// ---- the fixtures ------------------------------------------------------------------------------------------

TEST(TokenizerCases, Llama3Style) { check_fixture("llama3_style"); }
TEST(TokenizerCases, Gpt2Style) { check_fixture("gpt2_style"); }
TEST(TokenizerCases, Gpt2PrefixSpace) { check_fixture("gpt2_prefix_space"); }
TEST(TokenizerCases, Llama2Style) { check_fixture("llama2_style"); }
TEST(TokenizerCases, Llama2Metaspace) { check_fixture("llama2_metaspace"); }
TEST(TokenizerCases, SentencePieceUnkSplit) { check_fixture("sp_unk_split"); }
TEST(TokenizerCases, Gpt2Digits) { check_fixture("gpt2_digits"); }
TEST(TokenizerCases, Qwen2Style) { check_fixture("qwen2_style"); }
TEST(TokenizerCases, MistralV03Style) { check_fixture("mistral_v0_3_style"); }
TEST(TokenizerCases, NemoStyle) { check_fixture("nemo_style"); }

TEST(TokenizerDecode, Llama3Style) { check_fixture_decodes("llama3_style"); }
TEST(TokenizerDecode, Gpt2Style) { check_fixture_decodes("gpt2_style"); }
TEST(TokenizerDecode, Gpt2PrefixSpace) { check_fixture_decodes("gpt2_prefix_space"); }
TEST(TokenizerDecode, Llama2Style) { check_fixture_decodes("llama2_style"); }
TEST(TokenizerDecode, Llama2Metaspace) { check_fixture_decodes("llama2_metaspace"); }
TEST(TokenizerDecode, SentencePieceUnkSplit) { check_fixture_decodes("sp_unk_split"); }
TEST(TokenizerDecode, Gpt2Digits) { check_fixture_decodes("gpt2_digits"); }
TEST(TokenizerDecode, Qwen2Style) { check_fixture_decodes("qwen2_style"); }
TEST(TokenizerDecode, MistralV03Style) { check_fixture_decodes("mistral_v0_3_style"); }
TEST(TokenizerDecode, NemoStyle) { check_fixture_decodes("nemo_style"); }

// Mistral NeMo's regex cuts a camel-case word where the case changes ("HTTP" + "Server"): BPE never merges
// across, so the ids are those of the two halves. Its control tokens come first; <s> is the BOS.
TEST(TokenizerMistral, NemoSplitsCamelCase) {
  const Tokenizer tok = Tokenizer::from_file(fixtures_dir() / "nemo_style.tokenizer.json");
  std::vector<int32_t> halves = tok.encode("HTTP");
  const std::vector<int32_t> server = tok.encode("Server");
  halves.insert(halves.end(), server.begin(), server.end());
  EXPECT_EQ(tok.encode("HTTPServer"), halves);
  EXPECT_EQ(tok.token_to_id("<s>"), std::optional<int32_t>(1));
  EXPECT_EQ(tok.token_to_id("[INST]"), std::optional<int32_t>(3));
  EXPECT_EQ(tok.encode("hi", true).front(), 1);
  EXPECT_EQ(tok.encode("2024").size(), 4u);  // one digit per piece
}

// Mistral v0.3's layout: [INST] / [/INST] are special tokens matched before the pre-tokenizer, which puts a
// "▁" in front of the text's first word only (prepend_scheme "first"); unknown characters fall back to bytes.
TEST(TokenizerMistral, ControlTokensAndByteFallback) {
  const Tokenizer tok = Tokenizer::from_file(fixtures_dir() / "mistral_v0_3_style.tokenizer.json");
  EXPECT_EQ(tok.token_to_id("[INST]"), std::optional<int32_t>(3));
  EXPECT_EQ(tok.token_to_id("[/INST]"), std::optional<int32_t>(4));
  EXPECT_EQ(tok.token_to_id("<0x00>"), std::optional<int32_t>(3 + 7 + 16));  // after the 23 control tokens
  EXPECT_TRUE(tok.is_special(3));
  const std::vector<int32_t> ids = tok.encode("<s>[INST] hi[/INST]");
  ASSERT_GE(ids.size(), 4u);
  EXPECT_EQ(ids.front(), 1);
  EXPECT_EQ(ids[1], 3);
  EXPECT_EQ(ids.back(), 4);
  // " hi" after [INST]: its own space becomes "▁", no second one is prepended (not the text's start).
  EXPECT_EQ(std::vector<int32_t>(ids.begin() + 2, ids.end() - 1), tok.encode("hi"));
  // A character the vocabulary lacks: its UTF-8 bytes as <0xNN> tokens, and back.
  const std::vector<int32_t> snow = tok.encode("\u2603");  // ☃: "▁" then 3 bytes
  ASSERT_EQ(snow.size(), 4u);
  EXPECT_EQ(snow[1], *tok.token_to_id("<0xE2>"));
  EXPECT_EQ(tok.decode(snow), "\u2603");
  EXPECT_EQ(tok.decode(ids, /*skip_special_tokens=*/true), "hi");
}

// Qwen2's tokenizer: the NFC normalizer and the regex that cuts every digit alone, seen directly.
TEST(TokenizerQwen2, NfcAndSingleDigits) {
  const Tokenizer tok = Tokenizer::from_file(fixtures_dir() / "qwen2_style.tokenizer.json");
  EXPECT_NE(tok.describe().find("NFC"), std::string::npos) << tok.describe();
  // Decomposed and precomposed spellings are one text after NFC: the same ids.
  EXPECT_EQ(tok.encode("Cafe\u0301 \u1100\u1161\u11a8 \u212b"), tok.encode("Caf\u00e9 \uac01 \u00c5"));
  EXPECT_NE(tok.encode("e\u0301"), tok.encode("e"));
  // \p{N} without {1,3}: "2024" is four pieces, so four ids (a digit never merges with a digit).
  EXPECT_EQ(tok.encode("2024").size(), 4u);
  // Added tokens are matched before the normalizer (normalized: false); <think> is not special.
  const int32_t im_start = *tok.token_to_id("<|im_start|>"), think = *tok.token_to_id("<think>");
  EXPECT_TRUE(tok.is_special(im_start));
  EXPECT_FALSE(tok.is_special(think));
  const std::vector<int32_t> ids = tok.encode("<|im_start|><think>");
  EXPECT_EQ(ids, (std::vector<int32_t>{im_start, think}));
  EXPECT_EQ(tok.decode(ids, /*skip_special_tokens=*/true), "<think>");
  // No BOS: the post-processor is ByteLevel alone.
  EXPECT_EQ(tok.encode("hi", true), tok.encode("hi", false));
}

TEST(TokenizerQwen2, NfcFunction) {
  EXPECT_EQ(tok::nfc("e\u0301"), "\u00e9");
  EXPECT_EQ(tok::nfc("a\u0302\u0323"), "\u1ead");       // marks reordered, then composed
  EXPECT_EQ(tok::nfc("\u1100\u1161\u11a8"), "\uac01");  // conjoining jamo -> one syllable
  EXPECT_EQ(tok::nfc("\u212b\u2126"), "\u00c5\u03a9");  // singletons
  EXPECT_EQ(tok::nfc("\u0958"), "\u0915\u093c");        // a composition exclusion
  EXPECT_EQ(tok::nfc("\ufb01\u00b2"), "\ufb01\u00b2");  // compatibility characters stay
  EXPECT_EQ(tok::nfc(std::string("a\0e\u0301", 5)), std::string("a\0\u00e9", 4));  // a NUL is a character
  EXPECT_EQ(tok::nfc(""), "");
  // Where we knowingly differ from HF: utf8proc has Unicode 15's tables, HF's NFC (the crate
  // unicode-normalization-alignments) older ones, from before Unicode 13. Dives Akuru (added in 13) composes
  // here and not in HF; so do marks added since 13, which HF treats as unassigned (not reordered).
  EXPECT_EQ(tok::nfc("\U00011935\U00011930"), "\U00011938");
}

TEST(TokenizerBundled, Cases) {
  const Tokenizer tok = Tokenizer::from_file(testing::tiny_model_dir() / "tokenizer.json");
  const json doc = read_json(fixtures_dir() / "tiny-llama3.cases.json");
  check_cases(tok, doc, "tiny-llama3");
  check_decode_cases(tok, doc, "tiny-llama3");
}

// make_reference.py's cases (the ones the lesson executable checks), with the BOS the template adds.
TEST(TokenizerBundled, ReferenceCases) {
  const Tokenizer tok = Tokenizer::from_file(testing::tiny_model_dir() / "tokenizer.json");
  const json doc = read_json(testing::tiny_model_dir() / "reference" / "tokenizer_cases.json");
  const int32_t bos = doc.at("bos_token_id");
  ASSERT_EQ(tok.template_prefix(), std::vector<int32_t>{bos});
  ASSERT_GE(doc.at("cases").size(), 15u);
  for (const json& c : doc.at("cases")) {
    const std::string text = c.at("text");
    const std::vector<int32_t> want = c.at("ids");
    EXPECT_EQ(tok.encode(text), want) << c.at("name");
    EXPECT_EQ(tok.decode(want), text) << c.at("name");
    std::vector<int32_t> with_bos = want;
    with_bos.insert(with_bos.begin(), bos);
    EXPECT_EQ(tok.encode(text, true), with_bos) << c.at("name");
  }
  EXPECT_EQ(tok.vocab_size(), doc.at("vocab_size").get<int32_t>());
  EXPECT_TRUE(tok.is_special(bos));
  EXPECT_EQ(tok.token_to_id("<|eot_id|>"), std::optional<int32_t>(doc.at("eos_token_id").get<int32_t>()));
}

// ---- the incremental decoder -------------------------------------------------------------------------------

// After every id: what was emitted is a prefix of the full decode, made of whole characters; and for
// byte-level tokenizers nothing is held back that is already final (decode of the prefix, unless that ends
// in an unfinished character).
void check_every_split(const Tokenizer& tok, const std::vector<int32_t>& ids, bool byte_level,
                       const std::string& label) {
  const std::string full = tok.decode(ids);
  std::vector<std::string> pieces;
  ASSERT_EQ(stream_decode(tok, ids, false, &pieces), full) << label;
  std::string emitted;
  for (size_t k = 0; k < ids.size(); ++k) {
    emitted += pieces[k];
    ASSERT_TRUE(is_valid_utf8(pieces[k])) << label << ": piece " << k << " is not whole UTF-8 characters";
    ASSERT_EQ(full.compare(0, emitted.size(), emitted), 0) << label << ": after id " << k << " the text so far \""
                                                           << emitted << "\" is not a prefix of \"" << full << "\"";
    if (byte_level) {
      const std::vector<int32_t> prefix(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(k + 1));
      const std::string so_far = tok.decode(prefix);
      const bool unfinished = so_far.size() >= 3 && so_far.compare(so_far.size() - 3, 3, "\xEF\xBF\xBD") == 0;
      if (!unfinished) {
        ASSERT_EQ(emitted, so_far) << label << ": after id " << k << " text that is final was held back";
      }
    }
  }
}

TEST(TokenizerStream, EverySplitPoint) {
  struct Fixture {
    std::string name;
    bool byte_level;
  };
  for (const Fixture& f : {Fixture{"llama3_style", true}, Fixture{"gpt2_style", true},
                           Fixture{"llama2_style", false}, Fixture{"llama2_metaspace", false}}) {
    const Tokenizer tok = Tokenizer::from_file(fixtures_dir() / (f.name + ".tokenizer.json"));
    const json doc = read_json(fixtures_dir() / (f.name + ".cases.json"));
    const std::set<std::string> chosen = {"emoji_zwj", "emoji_flags", "cjk", "devanagari", "odd_valid_utf8",
                                          "byte_lookalikes", "math_symbols", "leading_spaces", "special_spaces"};
    int checked = 0;
    for (const json& c : doc.at("cases"))
      if (chosen.count(c.at("name"))) {
        check_every_split(tok, c.at("ids"), f.byte_level, f.name + " " + c.at("name").get<std::string>());
        ++checked;
      }
    for (size_t i = 0; i < doc.at("decode_cases").size(); i += 5, ++checked)
      check_every_split(tok, doc.at("decode_cases")[i].at("ids"), f.byte_level, f.name + " decode case");
    EXPECT_GE(checked, 20);
  }
}

// "€" is E2 82 AC: in byte-level BPE that may be three tokens. Nothing may come out until the third.
TEST(TokenizerStream, HoldsBackHalfACharacter) {
  const Tokenizer tok = Tokenizer::from_file(testing::tiny_model_dir() / "tokenizer.json");
  const auto& table = tok::byte_to_unicode();
  std::vector<int32_t> ids;
  for (unsigned char b : std::string("\xE2\x82\xAC")) ids.push_back(*tok.token_to_id(table[b]));
  IncrementalDecoder stream(tok);
  EXPECT_EQ(stream.push(ids[0]), "");
  EXPECT_EQ(stream.push(ids[1]), "");
  EXPECT_EQ(stream.push(ids[2]), "\xE2\x82\xAC");
  EXPECT_EQ(stream.finish(), "");
  // A character that never completes becomes U+FFFD, in decode() and in the stream alike.
  IncrementalDecoder broken(tok);
  EXPECT_EQ(broken.push(ids[0]), "");
  EXPECT_EQ(broken.push(ids[1]), "");
  EXPECT_EQ(broken.finish(), "\xEF\xBF\xBD");
  EXPECT_EQ(tok.decode(std::vector<int32_t>{ids[0], ids[1]}), "\xEF\xBF\xBD");
}

// ---- the byte table and the merge loop ---------------------------------------------------------------------

TEST(TokenizerBytes, ByteLevelTable) {
  const auto& table = tok::byte_to_unicode();
  EXPECT_EQ(table['a'], "a");
  EXPECT_EQ(table['!'], "!");
  EXPECT_EQ(table[' '], "\xC4\xA0");     // U+0120 Ġ
  EXPECT_EQ(table['\n'], "\xC4\x8A");    // U+010A Ċ
  EXPECT_EQ(table[0x00], "\xC4\x80");    // U+0100 Ā: the first non-printable byte
  EXPECT_EQ(table[0xAD], "\xC5\x83");    // U+0143 Ń: the soft hyphen, the last of the 68
  EXPECT_EQ(table[0xA1], "\xC2\xA1");    // ¡ stays itself
  EXPECT_EQ(table[0xFF], "\xC3\xBF");    // ÿ stays itself
  std::set<std::string> distinct(table.begin(), table.end());
  EXPECT_EQ(distinct.size(), 256u);
  for (int b = 0; b < 256; ++b) {
    int len;
    EXPECT_EQ(tok::unicode_to_byte(tok::utf8_decode_at(table[b], 0, &len)), b);
  }
}

// The obvious O(n^2) loop: find the adjacent pair with the lowest (rank, position), merge it, repeat.
std::vector<int32_t> naive_bpe(std::vector<int32_t> ids, const tok::MergeMap& merges) {
  while (true) {
    int best = -1;
    tok::MergeTarget target{};
    for (size_t i = 0; i + 1 < ids.size(); ++i) {
      auto it = merges.find(tok::pair_key(ids[i], ids[i + 1]));
      if (it != merges.end() && (best < 0 || it->second.rank < target.rank)) {
        best = static_cast<int>(i);
        target = it->second;
      }
    }
    if (best < 0) return ids;
    ids[best] = target.new_id;
    ids.erase(ids.begin() + best + 1);
  }
}

std::vector<int32_t> heap_bpe(const std::vector<int32_t>& ids, const tok::MergeMap& merges) {
  std::vector<tok::BpeSymbol> symbols;
  for (size_t i = 0; i < ids.size(); ++i)
    symbols.push_back({ids[i], static_cast<int32_t>(i) - 1, i + 1 < ids.size() ? static_cast<int32_t>(i + 1) : -1});
  tok::bpe_merge(symbols, merges);
  std::vector<int32_t> out;
  for (const auto& s : symbols)
    if (!s.removed) out.push_back(s.id);
  return out;
}

TEST(TokenizerBpe, MergesByRankLeftmostFirst) {
  // ids: a=0 b=1 c=2; ab=3 bc=4 abc=5 aa=6
  tok::MergeMap merges;
  merges[tok::pair_key(1, 2)] = {0, 4};  // b c  (rank 0: first)
  merges[tok::pair_key(0, 1)] = {1, 3};  // a b
  merges[tok::pair_key(3, 2)] = {2, 5};  // ab c
  merges[tok::pair_key(0, 0)] = {3, 6};  // a a
  EXPECT_EQ(heap_bpe({0, 1, 2}, merges), (std::vector<int32_t>{0, 4}));     // b c wins over a b: [a, bc]
  EXPECT_EQ(heap_bpe({0, 1}, merges), (std::vector<int32_t>{3}));           // ab
  EXPECT_EQ(heap_bpe({0, 0, 0}, merges), (std::vector<int32_t>{6, 0}));     // leftmost first: [aa, a]
  EXPECT_EQ(heap_bpe({0, 0, 0, 0}, merges), (std::vector<int32_t>{6, 6}));  // [aa, aa]
  EXPECT_EQ(heap_bpe({2}, merges), (std::vector<int32_t>{2}));
  EXPECT_EQ(heap_bpe({}, merges), (std::vector<int32_t>{}));
}

TEST(TokenizerBpe, EqualsTheNaiveLoopOnRandomWords) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 40; ++trial) {
    // A random merge table over a small alphabet: merging (x, y) makes a new id.
    const int alphabet = 3 + trial % 4;
    tok::MergeMap merges;
    int32_t next_id = alphabet;
    for (int rank = 0; rank < 30; ++rank) {
      const int32_t x = static_cast<int32_t>(rng() % next_id), y = static_cast<int32_t>(rng() % next_id);
      if (merges.count(tok::pair_key(x, y))) continue;
      merges[tok::pair_key(x, y)] = {rank, next_id++};
    }
    for (int w = 0; w < 20; ++w) {
      std::vector<int32_t> word(1 + rng() % 40);
      for (auto& id : word) id = static_cast<int32_t>(rng() % alphabet);
      ASSERT_EQ(heap_bpe(word, merges), naive_bpe(word, merges)) << "trial " << trial << " word " << show(word, 40);
    }
  }
}

// ---- encode / decode edge cases ----------------------------------------------------------------------------

TEST(TokenizerEncode, RejectsInvalidUtf8) {
  const Tokenizer tok = Tokenizer::from_file(testing::tiny_model_dir() / "tokenizer.json");
  try {
    (void)tok.encode("ok \xC3\x28 bad");
    FAIL() << "expected an InputError";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("not valid UTF-8 (byte 3)"), std::string::npos) << e.what();
  }
}

TEST(TokenizerDecode, RejectsAnUnknownId) {
  const Tokenizer tok = Tokenizer::from_file(testing::tiny_model_dir() / "tokenizer.json");
  EXPECT_THROW((void)tok.decode(std::vector<int32_t>{5, tok.vocab_size()}), InputError);
  EXPECT_THROW((void)tok.decode(std::vector<int32_t>{-1}), InputError);
  IncrementalDecoder stream(tok);
  EXPECT_THROW((void)stream.push(tok.vocab_size() + 7), InputError);
}

// ---- malformed tokenizer.json --------------------------------------------------------------------------------

// A small valid byte-level tokenizer; each test breaks one field.
json valid_tokenizer() {
  return json::parse(R"({
    "version": "1.0", "truncation": null, "padding": null,
    "added_tokens": [{"id": 6, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false,
                      "normalized": false, "special": true}],
    "normalizer": null,
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
    "post_processor": {"type": "TemplateProcessing",
                       "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                       "pair": [], "special_tokens": {"<s>": {"id": "<s>", "ids": [6], "tokens": ["<s>"]}}},
    "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
    "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
              "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
              "vocab": {"a": 0, "b": 1, "c": 2, "ab": 3, "abc": 4, "Ġ": 5},
              "merges": ["a b", ["ab", "c"]]}})");
}

void expect_rejected(const std::string& text, const std::string& message) {
  try {
    (void)Tokenizer::from_json(text, "tokenizer.json");
    ADD_FAILURE() << "accepted, expected an InputError containing: " << message;
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(message), std::string::npos)
        << "message: " << e.what() << "\nexpected it to contain: " << message;
  }
}

void expect_rejected(const std::function<void(json&)>& edit, const std::string& message) {
  json t = valid_tokenizer();
  edit(t);
  expect_rejected(t.dump(), message);
}

TEST(TokenizerJson, TheValidOneLoadsAndWorks) {
  const Tokenizer tok = Tokenizer::from_json(valid_tokenizer().dump());
  EXPECT_EQ(tok.encode("abc ab"), (std::vector<int32_t>{4, 5, 3}));
  EXPECT_EQ(tok.encode("abc<s>", true), (std::vector<int32_t>{6, 4, 6}));
  EXPECT_EQ(tok.decode(std::vector<int32_t>{6, 4, 5, 3}, true), "abc ab");
}

TEST(TokenizerJson, RejectsBrokenJson) {
  expect_rejected("{\"model\": ", "tokenizer.json: not valid JSON");
  expect_rejected("[1, 2]", "tokenizer.json: must be a JSON object");
  expect_rejected(R"({"model": {}, "model": {}})", "duplicate key \"model\"");
  expect_rejected("{}", "tokenizer.json: model: is missing");
}

TEST(TokenizerJson, RejectsBadModelFields) {
  expect_rejected([](json& t) { t["model"]["type"] = "WordPiece"; },
                  "model.type: type \"WordPiece\" is not supported (supported: BPE)");
  expect_rejected([](json& t) { t["model"]["type"] = "Unigram"; }, "Unigram models");
  expect_rejected([](json& t) { t["model"].erase("vocab"); }, "model.vocab: is missing");
  expect_rejected([](json& t) { t["model"]["vocab"] = json::array(); }, "model.vocab: must be an object, got an array");
  expect_rejected([](json& t) { t["model"]["vocab"]["a"] = "0"; }, "model.vocab[\"a\"]: must be an integer");
  expect_rejected([](json& t) { t["model"]["vocab"]["a"] = -1; }, "model.vocab[\"a\"]: must be an integer in [0,");
  expect_rejected([](json& t) { t["model"]["vocab"]["c"] = 0; }, "model.vocab: id 0 is given to both");
  expect_rejected([](json& t) { t["model"]["merges"] = "a b"; }, "model.merges: must be an array, got a string");
  expect_rejected([](json& t) { t["model"]["merges"][0] = "ab"; },
                  "model.merges[0]: \"ab\" must be two tokens separated by one space");
  expect_rejected([](json& t) { t["model"]["merges"][0] = "a b c"; }, "model.merges[0]: \"a b c\" must be two");
  expect_rejected([](json& t) { t["model"]["merges"][1] = json::array({"ab"}); },
                  "model.merges[1]: must be \"a b\" or [\"a\", \"b\"]");
  expect_rejected([](json& t) { t["model"]["merges"][1] = json::array({1, 2}); }, "model.merges[1]: must be");
  expect_rejected([](json& t) { t["model"]["merges"][0] = "a x"; }, "model.merges[0]: \"x\" is not in model.vocab");
  expect_rejected([](json& t) { t["model"]["merges"][0] = "b c"; },
                  "model.merges[0]: the merged token \"bc\" is not in model.vocab");
  expect_rejected([](json& t) { t["model"]["dropout"] = 0.1; }, "model.dropout: BPE dropout");
  expect_rejected([](json& t) { t["model"]["unk_token"] = "<unk>"; }, "model.unk_token: \"<unk>\" is not in model.vocab");
  expect_rejected([](json& t) { t["model"]["unk_token"] = 3; }, "model.unk_token: must be a string or null");
  expect_rejected([](json& t) { t["model"]["byte_fallback"] = "yes"; },
                  "model.byte_fallback: must be true or false, got \"yes\"");
  expect_rejected([](json& t) { t["model"]["continuing_subword_prefix"] = "##"; },
                  "model.continuing_subword_prefix: is not supported");
}

TEST(TokenizerJson, RejectsBadAddedTokens) {
  expect_rejected([](json& t) { t["added_tokens"] = json::object(); }, "added_tokens: must be an array");
  expect_rejected([](json& t) { t["added_tokens"][0]["id"] = "6"; }, "added_tokens[0].id: must be an integer");
  expect_rejected([](json& t) { t["added_tokens"][0].erase("content"); }, "added_tokens[0].content: is missing");
  expect_rejected([](json& t) { t["added_tokens"][0]["content"] = ""; }, "added_tokens[0].content: must not be empty");
  expect_rejected([](json& t) { t["added_tokens"][0]["special"] = 1; }, "added_tokens[0].special: must be true or false");
  expect_rejected([](json& t) { t["added_tokens"][0]["id"] = 0; },
                  "added_tokens[0].id: id 0 is already the model's token \"a\"");
  expect_rejected([](json& t) { t["added_tokens"][0]["content"] = "ab"; },
                  "added_tokens[0]: \"ab\" has id 6 here but 3 in model.vocab");
  expect_rejected([](json& t) { t["added_tokens"].push_back(t["added_tokens"][0]); },
                  "added_tokens[1].id: id 6 is used twice");
}

// Files saved after training with truncation or padding on: transformers encodes whole texts with them unless
// asked (truncation=False is the default), and so do we; one line on stderr says the settings are ignored.
TEST(TokenizerJson, TruncationAndPaddingAreIgnored) {
  json t = valid_tokenizer();
  t["truncation"] = {{"direction", "Right"}, {"max_length", 2}, {"strategy", "LongestFirst"}, {"stride", 0}};
  t["padding"] = {{"strategy", {{"Fixed", 8}}}, {"direction", "Right"}, {"pad_to_multiple_of", nullptr},
                  {"pad_id", 5}, {"pad_type_id", 0}, {"pad_token", "Ġ"}};
  ::testing::internal::CaptureStderr();
  const Tokenizer tok = Tokenizer::from_json(t.dump(), "trained/tokenizer.json");
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("trained/tokenizer.json: truncation {"), std::string::npos) << err;
  EXPECT_NE(err.find("\"max_length\":2"), std::string::npos) << err;
  EXPECT_NE(err.find(", padding {"), std::string::npos) << err;
  EXPECT_NE(err.find("ignored"), std::string::npos) << err;
  EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << err;  // once, not per encode
  // Not truncated to 2 ids, not padded to 8: the same ids as the file without the settings.
  const Tokenizer plain = Tokenizer::from_json(valid_tokenizer().dump());
  EXPECT_EQ(tok.encode("abc ab abc ab"), (std::vector<int32_t>{4, 5, 3, 5, 4, 5, 3}));
  EXPECT_EQ(tok.encode("abc ab abc ab"), plain.encode("abc ab abc ab"));
  EXPECT_EQ(tok.encode("abc", true), (std::vector<int32_t>{6, 4}));
}

// A Split pre-tokenizer with a {"String": ...} pattern (a literal, as Hugging Face tokenizers compiles it with
// regex::escape): it loads, and "." is a dot, not any character.
TEST(TokenizerJson, SplitOnALiteralString) {
  const auto with_split = [](const std::string& literal) {
    json t = valid_tokenizer();
    t["model"]["vocab"]["."] = 7;
    t["pre_tokenizer"] = {{"type", "Sequence"},
                          {"pretokenizers",
                           {{{"type", "Split"}, {"pattern", {{"String", literal}}}, {"behavior", "Isolated"},
                             {"invert", false}},
                            {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true},
                             {"use_regex", false}}}}};
    return Tokenizer::from_json(t.dump());
  };
  const Tokenizer space = with_split(" ");
  EXPECT_EQ(space.encode("abc ab"), (std::vector<int32_t>{4, 5, 3}));  // "abc", " " -> "Ġ", "ab"
  const Tokenizer dot = with_split(".");
  EXPECT_EQ(dot.encode("ab.abc"), (std::vector<int32_t>{3, 7, 4}));  // a regex "." would isolate every byte
  EXPECT_EQ(dot.encode("abcab"), (std::vector<int32_t>{4, 3}));
}

TEST(TokenizerJson, RejectsUnsupportedSteps) {
  expect_rejected(
      [](json& t) {
        t["normalizer"] = {{"type", "NFKC"}};
      },
      "normalizer.type: type \"NFKC\" is not supported (supported: NFC, Prepend, Replace, a Sequence of "
      "them, or null); of the Unicode normalization forms only NFC");
  expect_rejected([](json& t) { t["normalizer"] = {{"type", "Replace"}, {"pattern", {{"Regex", " +"}}}, {"content", "▁"}}; },
                  "normalizer.pattern: a Regex pattern in a Replace normalizer is not supported");
  expect_rejected([](json& t) { t["normalizer"] = {{"type", "Lowercase"}}; }, "--prompt-ids");
  expect_rejected([](json& t) { t["pre_tokenizer"] = {{"type", "Whitespace"}}; },
                  "pre_tokenizer.type: type \"Whitespace\" is not supported (supported: Split, ByteLevel, Metaspace");
  expect_rejected([](json& t) { t["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "(a"}}},
                                                      {"behavior", "Isolated"}, {"invert", false}}; },
                  "pre_tokenizer.pattern: the regex does not compile (PCRE2: missing closing parenthesis");
  expect_rejected([](json& t) { t["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "a"}}},
                                                      {"behavior", "Removed"}, {"invert", false}}; },
                  "pre_tokenizer.behavior: \"Removed\" is not supported");
  expect_rejected([](json& t) { t["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "a"}}},
                                                      {"behavior", "Isolated"}, {"invert", true}}; },
                  "pre_tokenizer.invert: true is not supported");
  expect_rejected([](json& t) { t["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Glob", "a"}}},
                                                      {"behavior", "Isolated"}}; },
                  "pre_tokenizer.pattern: must be {\"String\": \"...\"} or {\"Regex\": \"...\"}");
  expect_rejected([](json& t) { t["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "__"}}; },
                  "pre_tokenizer.replacement: must be one character, got \"__\"");
  expect_rejected([](json& t) { t["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "▁"},
                                                      {"prepend_scheme", "sometimes"}}; },
                  "pre_tokenizer.prepend_scheme: must be \"always\", \"first\" or \"never\"");
  expect_rejected([](json& t) { t["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", {{{"type", "Punctuation"}}}}}; },
                  "pre_tokenizer.pretokenizers[0].type: type \"Punctuation\" is not supported");
  expect_rejected([](json& t) { t["pre_tokenizer"] = {{"kind", "ByteLevel"}}; }, "pre_tokenizer.type: is missing");
  expect_rejected([](json& t) { t["decoder"] = {{"type", "WordPiece"}}; },
                  "decoder.type: type \"WordPiece\" is not supported");
  expect_rejected([](json& t) { t["decoder"] = {{"type", "Sequence"}, {"decoders", {{{"type", "ByteLevel"}}, {{"type", "Fuse"}}}}}; },
                  "decoder.decoders[1]: a decoder step after ByteLevel is not supported");
  expect_rejected([](json& t) { t["decoder"] = {{"type", "Sequence"}, {"decoders", {{{"type", "Fuse"}}, {{"type", "ByteFallback"}}}}}; },
                  "decoder.decoders[1]: \"ByteFallback\" after Fuse is not supported");
  expect_rejected([](json& t) { t["decoder"] = {{"type", "Strip"}, {"content", " "}, {"start", -1}, {"stop", 0}}; },
                  "decoder.start: must be an integer in [0, 1000], got -1");
  expect_rejected([](json& t) { t["post_processor"] = {{"type", "BertProcessing"}}; },
                  "post_processor.type: type \"BertProcessing\" is not supported");
  expect_rejected([](json& t) { t["post_processor"]["single"][0]["SpecialToken"]["id"] = "<bos>"; },
                  "post_processor.single[0].SpecialToken.id: \"<bos>\" is not in post_processor.special_tokens");
  expect_rejected([](json& t) { t["post_processor"]["special_tokens"]["<s>"]["ids"][0] = 99; },
                  "post_processor.special_tokens[\"<s>\"].ids[0]: id 99 names no token");
  expect_rejected([](json& t) { t["post_processor"]["single"].erase(1); },
                  "post_processor.single: has no {\"Sequence\": {\"id\": \"A\"}}");
  expect_rejected([](json& t) { t["post_processor"]["single"][1]["Sequence"]["id"] = "B"; },
                  "post_processor.single[1].Sequence.id: must be \"A\" in the single template");
}

}  // namespace
}  // namespace tvllm
