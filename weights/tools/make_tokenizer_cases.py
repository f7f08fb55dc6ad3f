#!/usr/bin/env python3
"""Make lesson 09's tokenizer fixtures and the Hugging Face answers the C++ tokenizer is checked against.

    pip install tokenizers          (no torch, no transformers: this script needs only `tokenizers`)
    python3 weights/tools/make_tokenizer_cases.py [--out tests/data/tokenizers] [--corpus weights/corpus]

Fixtures (small BPE tokenizers trained on the project's own corpus, each well under 1 MB), in the styles a
Llama-architecture checkpoint ships:
  llama3_style       byte-level BPE: Split(Llama 3 regex) + ByteLevel(use_regex false), ignore_merges, merges as
                     ["a", "b"] pairs, Llama 3's named special tokens, plus added tokens with lstrip/rstrip and
                     single_word, a TemplateProcessing post-processor that prepends <|begin_of_text|>
  gpt2_style         byte-level BPE: ByteLevel(add_prefix_space false, use_regex true) alone (the GPT-2 regex),
                     merges as "a b" strings (GPT-2's original form), <|endoftext|>
  gpt2_prefix_space  the same model with ByteLevel(add_prefix_space true)
  gpt2_digits        the same model with Sequence[Digits(individual_digits true), ByteLevel]: every digit alone
  llama2_style       SentencePiece-style BPE as Llama 2's tokenizer.json has it: normalizer
                     Sequence[Prepend("▁"), Replace(" ", "▁")], no pre-tokenizer, byte_fallback with the 256
                     <0xNN> tokens, <unk>, decoder Sequence[Replace, ByteFallback, Fuse, Strip], BOS <s>; plus a
                     non-special added token with normalized true
  llama2_metaspace   the same model with the Metaspace pre-tokenizer (prepend_scheme "first", split false) and
                     the Metaspace decoder instead of the normalizer (transformers' legacy=False conversion)
  sp_unk_split       the same merges without byte fallback: Metaspace(prepend_scheme "always", split true), an
                     unknown character becomes <unk> (fuse_unk false)
  mistral_v0_3_style SentencePiece-style BPE as Mistral-7B-v0.3 lays it out: <unk> <s> </s>, then [INST] [/INST]
                     [TOOL_CALLS] ... [control_N] as special added tokens, then the <0xNN> byte tokens;
                     Metaspace(prepend_scheme "first", split false), byte_fallback, the Llama 2 decoder.
                     (Mistral v0.1/v0.2's tokenizer.json is llama2_style's layout: Prepend + Replace normalizer.)
  nemo_style         byte-level BPE as Mistral NeMo's tekken-derived tokenizer.json has it: Split(its regex:
                     upper/lower-case runs, marks as letters, one digit per piece) + ByteLevel, control tokens
                     <unk> <s> </s> [INST] ... <SPECIAL_N> at the first ids, TemplateProcessing with <s>
  qwen2_style        byte-level BPE as Qwen2 / Qwen2.5 / Qwen3 ship it: normalizer NFC, Split(Qwen2's regex: one
                     digit per piece) + ByteLevel(use_regex false), ByteLevel post-processor (no BOS) and decoder,
                     continuing_subword_prefix / end_of_word_suffix "", and Qwen3's added tokens (Qwen2.5's 22,
                     <|endoftext|> <|im_start|> <|im_end|> ... <|file_sep|>, plus <tool_response>
                     </tool_response> <think> </think>), special or not as in the real file
and the bundled weights/tiny-llama3/tokenizer.json (cases only; the file itself is make_tiny_model.py's).

For every fixture, <name>.cases.json holds, for a few hundred texts (scripts, emoji, whitespace, CRLF, digits,
contractions, special-token strings, the empty string, a very long string, odd but valid UTF-8): the ids of
encode(text, add_special_tokens=False), decode(ids) when it differs from the text, and for some texts the ids
with add_special_tokens=True; plus decode cases: random id sequences with decode(ids) and
decode(ids, skip_special_tokens=True). Same bytes on every run with the same `tokenizers` version.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import trainers

ROOT = Path(__file__).resolve().parent.parent.parent

LLAMA3_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's pre-tokenizer: Llama 3's regex with \p{N} instead of \p{N}{1,3} (every digit a piece of its own).
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Mistral NeMo's (tekken-derived) pre-tokenizer: a word is an optional non-letter, then upper-case letters and
# lower-case ones in either order (so "HTTPServer" is "HTTP" + "Server"), marks count as letters; one digit per
# piece; punctuation may swallow a following "/".
NEMO_SPLIT_REGEX = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Its first ids: control tokens (the real file has 1000, up to <SPECIAL_999>).
NEMO_SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                 "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "<pad>", "[PREFIX]", "[MIDDLE]", "[SUFFIX]",
                 *(f"<SPECIAL_{i}>" for i in range(14, 24))]
# Qwen3's added tokens in id order (Qwen2.5's are the first 22), with their "special" flag.
QWEN_ADDED = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
]
LLAMA3_SPECIALS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
]


def read_corpus(corpus_dir: Path) -> list[str]:
    files = sorted(corpus_dir.glob("*.txt"))
    if not files:
        raise SystemExit(f"error: no *.txt files in {corpus_dir}")
    return [f.read_text(encoding="utf-8") for f in files]


# ---- fixtures --------------------------------------------------------------------------------------------


def llama3_style(texts: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainer=trainers.BpeTrainer(
        vocab_size=1100, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in LLAMA3_SPECIALS])
    # Added tokens with the flags the loader must honour: <mask> swallows the spaces around it; [[note]]
    # (not special: decode keeps it with skip_special_tokens) only matches as a whole word.
    tok.add_special_tokens([AddedToken("<mask>", special=True, normalized=False, lstrip=True, rstrip=True)])
    tok.add_tokens([AddedToken("[[note]]", special=False, normalized=False, single_word=True)])
    bos = LLAMA3_SPECIALS[0]
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                      special_tokens=[(bos, tok.token_to_id(bos))]),
    ])
    return tok


def qwen2_style(texts: list[str]) -> str:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.train_from_iterator(texts, trainer=trainers.BpeTrainer(
        vocab_size=1000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    for content, special in QWEN_ADDED:  # one at a time: ids follow the model's, in this order
        tok.add_tokens([AddedToken(content, special=special, normalized=False)])
    t = json.loads(tok.to_str())
    # As Qwen's file has them (our loader accepts "" as "none").
    t["model"]["continuing_subword_prefix"] = ""
    t["model"]["end_of_word_suffix"] = ""
    return json.dumps(t, ensure_ascii=False, indent=2)


def nemo_style(texts: list[str]) -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(NEMO_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainer=trainers.BpeTrainer(
        vocab_size=1100, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
        special_tokens=[AddedToken(s, special=True, normalized=False) for s in NEMO_SPECIALS]))
    bos = "<s>"
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, tok.token_to_id(bos))])
    return tok.to_str(pretty=True)


def gpt2_model(texts: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.train_from_iterator(texts, trainer=trainers.BpeTrainer(
        vocab_size=900, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
    return tok


def as_string_merges(tok_json: dict) -> dict:
    """GPT-2's original form: each merge one "a b" string (a token never contains a space there)."""
    merges = tok_json["model"]["merges"]
    assert all(" " not in a and " " not in b for a, b in merges)
    tok_json["model"]["merges"] = [f"{a} {b}" for a, b in merges]
    return tok_json


def sentencepiece_base(texts: list[str], controls: tuple[str, ...] = ()) -> dict:
    """A Llama 2-shaped BPE model as JSON: <unk> <s> </s>, the `controls` (Mistral v0.3's [INST] ...), the
    256 <0xNN> byte tokens, then the trained pieces (words start with "▁"), with the merges of the training
    run."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tok.train_from_iterator(texts, trainer=trainers.BpeTrainer(vocab_size=700, show_progress=False))
    trained = json.loads(tok.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for c in controls:
        vocab[c] = len(vocab)
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
        if piece not in vocab:
            vocab[piece] = len(vocab)
    specials = [{"id": vocab[s], "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                 "normalized": False, "special": True} for s in ("<unk>", "<s>", "</s>", *controls)]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": specials,
        "normalizer": None, "pre_tokenizer": None,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "<s>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
        },
        "decoder": None,
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": trained["merges"]},
    }


SP_DECODER = {"type": "Sequence", "decoders": [
    {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
    {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}


def llama2_style(base: dict) -> dict:
    t = json.loads(json.dumps(base))
    t["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}
    t["decoder"] = SP_DECODER
    # A non-special added token matched on the normalized text ("▁hello▁world" after the normalizer).
    t["added_tokens"].append({"id": len(t["model"]["vocab"]), "content": "hello world", "single_word": False,
                              "lstrip": False, "rstrip": False, "normalized": True, "special": False})
    return t


def llama2_metaspace(base: dict) -> dict:
    t = json.loads(json.dumps(base))
    t["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False}
    t["decoder"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False}
    return t


# Mistral-7B-v0.3's control tokens (ids 3..): the tool tokens, then [control_8] ... (the real file has them up
# to [control_768]; a few are enough to test that they are matched whole and skipped when decoding).
MISTRAL_V0_3_CONTROLS = ("[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                         "[TOOL_RESULTS]", "[/TOOL_RESULTS]", *(f"[control_{i}]" for i in range(8, 24)))


def mistral_v0_3_style(texts: list[str]) -> dict:
    """Mistral-7B-v0.3's layout: SentencePiece BPE with byte fallback, [INST] / [/INST] as special control
    tokens matched before anything else, the Metaspace pre-tokenizer with prepend_scheme "first" (a "▁" in
    front of the text's first word only, not after every control token), the Llama 2 decoder."""
    t = sentencepiece_base(texts, MISTRAL_V0_3_CONTROLS)
    t["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False}
    t["decoder"] = SP_DECODER
    return t


def sp_unk_split(base: dict) -> dict:
    t = json.loads(json.dumps(base))
    t["model"]["byte_fallback"] = False
    t["model"]["fuse_unk"] = False
    t["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}
    t["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    return t


# ---- texts -----------------------------------------------------------------------------------------------

HAND = [
    ("empty", ""),
    ("space", " "),
    ("two_spaces", "  "),
    ("newline", "\n"),
    ("crlf", "\r\n"),
    ("tab", "\t"),
    ("ascii_sentence", "Hello world! This is a simple sentence."),
    ("leading_space", " hello"),
    ("leading_spaces", "   hello world"),
    ("trailing_spaces", "ends with spaces   "),
    ("trailing_newlines", "ends with newlines\n\n"),
    ("whitespace_runs", "a  b   c    d\t\te  \t f"),
    ("only_whitespace", "   \n  \t "),
    ("newlines", "line one\nline two\n\nline four\r\nwindows line\n\n\n   indented\n"),
    ("crlf_lines", "first\r\nsecond\r\n\r\nthird \r\n fourth\r"),
    ("cr_only", "old\rmac\r\rlines"),
    ("tabs_code", "\tif (x) {\n\t\treturn y;\n\t}\n"),
    ("spaces_before_newline", "a   \n   b \t\n\t c"),
    ("digits", "1 12 123 1234 12345 3.14159 2024-03-15 1,000,000 007"),
    ("digit_run", "12345678901234567890"),
    ("digits_letters", "abc123def4567ghi89 x1y2z3"),
    ("phone", "+44 20 7946 0958, #A-20931-X"),
    ("contractions", "I'm sure it's fine, they'll know we've done what you'd want. DON'T, IT'S, We'Re."),
    ("contractions_upper", "I'M HERE, YOU'LL SEE, WE'VE WON, HE'D GO, SHE'S OK, THEY'RE IN, CAN'T"),
    ("contractions_mixed", "it'S we'Ve they'RE i'M you'LL he'D don'T 's 't 're"),
    ("apostrophes", "rock 'n' roll, '90s, O'Brien's, ''double'' '''"),
    ("curly_quotes", "\u2018quoted\u2019 \u201cdouble\u201d it\u2019s"),
    ("punctuation", "Wait... what?! (yes) [no] {maybe} <tag> \"quoted\" 'single' #hash @at $5 100% a/b\\c"),
    ("punct_runs", "!!!??? ... --- === +++ ;;; ::: ,,, ___"),
    ("code", "def f(x):\n    return x * 2  # double it\n\nprint(f(21))\n"),
    ("code_cpp", "for (int i = 0; i < n; ++i) { out[i] = a[i] * b[i]; }  // axpy-ish"),
    ("json_text", "{\"key\": [1, 2.5, -3e10, true, null], \"s\": \"a\\nb\"}"),
    ("url", "https://example.com/path?q=1&r=two#frag mailto:someone@example.org"),
    ("accents", "Café naïve façade jalapeño Zoë Dvořák Straße crème brûlée"),
    ("combining", "Cafe\u0301 nai\u0308ve e\u0301\u0301 a\u0323\u0302"),
    ("german", "Grüße aus Köln! Übung macht den Meister. Die Straße ist nass."),
    ("french", "Où est la gare, s'il vous plaît ? À gauche, après l'église."),
    ("cyrillic", "Доброе утро! Как дела? Всё хорошо, спасибо. ПРИВЕТ мир"),
    ("greek", "Καλημέρα κόσμε· τι κάνεις; ΑΒΓΔ αβγδ ς"),
    ("arabic", "مرحبا بالعالم، كيف حالك؟ ١٢٣ ٤٥٦"),
    ("hebrew", "שלום עולם, מה שלומך?"),
    ("devanagari", "नमस्ते दुनिया। आप कैसे हैं? क्षत्रिय ०१२३"),
    ("thai", "สวัสดีครับ ภาษาไทย"),
    ("cjk", "你好，世界。今天天气很好。日本語のテキストです。안녕하세요"),
    ("cjk_spaces", "中文 文本 和 English 混合 text"),
    ("fullwidth", "ＡＢＣ１２３！？　全角スペース"),
    ("emoji", "Great job 🎉🚀 family 👨\u200d👩\u200d👧\u200d👦 thumbs 👍🏽 flag 🇵🇹"),
    ("emoji_zwj", "👩\u200d💻 🧑🏿\u200d🚀 🏳\ufe0f\u200d🌈 ❤\ufe0f\u200d🔥 👁\ufe0f\u200d🗨\ufe0f"),
    ("emoji_skin_tones", "👋🏻👋🏼👋🏽👋🏾👋🏿 ✌🏽 🤝🏻"),
    ("emoji_flags", "🇺🇸🇬🇧🇯🇵🇩🇪 🏴\U000e0067\U000e0062\U000e0073\U000e0063\U000e0074\U000e007f"),
    ("emoji_keycaps", "1\ufe0f\u20e3 #\ufe0f\u20e3 *\ufe0f\u20e3 ©\ufe0f ™"),
    ("emoji_run", "😀😃😄😁😆😅😂🤣🥲☺️😊"),
    ("emoji_in_words", "ab😀cd e😀 😀f g😀😀h"),
    ("mixed_scripts", "Доброе утро, Καλημέρα, مرحبا, नमस्ते, Dzień dobry"),
    ("rare_words", "Zyzzyva quixotic xylophone supercalifragilisticexpialidocious"),
    ("math_symbols", "∀x∈ℝ: x² ≥ 0, ∑ᵢ aᵢ ≈ π·r², √2 ≠ ∞, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟙𝟚𝟛"),
    ("currency", "$19.99, €17,50, £15.00, ¥2,300, ₹500, ₿0.1"),
    ("odd_valid_utf8", "\u00ff\u0100 \ufffd \ufeffBOM \uffff \U0010ffff \ud7ff\ue000 \U0001f600"),
    ("controls", "nul\x00in\x01the\x1fmiddle\x7f and \x85 c1 \x9f"),
    ("unicode_spaces", "a\u00a0b\u2000c\u2003d\u202fe\u205ff\u3000g\u1680h"),
    ("unicode_space_runs", "x\u00a0\u00a0 y\u3000\u3000\u3000z \u2028 \u2029 end\u0085\u0085 next\u0085"),
    ("zero_width", "zero\u200bwidth\u200cjoiner\u200d\u2060word\u00ad"),
    ("long_s", "'ſ 'ſt IT'ſ \u212a \u0130stanbul"),
    ("special_tokens_in_text",
     "<|begin_of_text|>Hello<|eot_id|> and <|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"),
    ("almost_special", "<|not_a_special_token|> <|eot_id| <|eot_id|>x <|EOT_ID|>"),
    ("special_adjacent", "<|eot_id|><|eot_id|><|begin_of_text|><|begin_of_text|>"),
    ("special_spaces", " <|eot_id|> x <|eot_id|>  y  <|eot_id|>"),
    ("gpt2_special", "one<|endoftext|>two <|endoftext|> three<|endoftext|>"),
    ("llama2_specials", "<s>[INST] hi [/INST] ok</s><s> again </s> <unk> x<unk>y"),
    ("mask_lstrip", "The capital is   <mask>   of France; <mask>x<mask>"),
    ("note_single_word", "[[note]] a [[note]]b x[[note]] ([[note]]) [[note]]\n"),
    ("hello_world_added", "say hello world, hello  world, Hello world, hello world!"),
    ("chat_llama3", "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are helpful.<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    ("chat_llama2", "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHello! [/INST] Hi there. </s><s>[INST] Bye [/INST]"),
    ("chatml", "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"),
    ("chat_mistral_v0_3", "<s>[INST] Be brief.\n\nWhat is 2+2?[/INST] 4</s>[INST] And 3+3?[/INST]"),
    ("chat_mistral_v0_2", "<s> [INST] What is 2+2? [/INST] 4</s> [INST] And 3+3? [/INST]"),
    ("camel_case", "HTTPServer XMLHttpRequest iPhone McDonald's ÉCOLE École getHTTPResponseCode ABCdef"),
    ("slash_paths", "a/b //c ./d.e/f/ https://x.y/z/?q=1 C:\\Windows\\System32"),
    ("mistral_controls", "[TOOL_CALLS] [AVAILABLE_TOOLS][{}][/AVAILABLE_TOOLS]x[control_8] [control_9][INST]"),
    ("repeated_char", "a" * 300),
    ("repeated_space", " " * 200 + "x"),
    ("repeated_emoji", "😀" * 200),
    ("repeated_word", "the " * 150),
    ("one_long_word", "pneumonoultramicroscopicsilicovolcanoconiosis" * 20),
    ("markdown", "# Title\n\n- item *one*\n- item **two**\n\n```cpp\nint x = 0;\n```\n> quote"),
    ("html", "<div class=\"a\">x &amp; y &lt;z&gt;</div><br/>"),
    ("sentencepiece_chars", "▁ ▁▁ a▁b ▁x"),
    # Texts that NFC changes (Qwen2's normalizer): decomposed accents compose, marks reorder canonically,
    # conjoining Hangul jamo become syllables, singletons map to their canonical twins, composition
    # exclusions stay decomposed, compatibility characters (NFKC's business) stay.
    ("nfc_combining", "e\u0301 a\u0300 o\u0302 u\u0308 n\u0303 c\u0327 A\u030a Cafe\u0301 cre\u0300me bru\u0302le\u0301e"),
    ("nfc_reorder", "a\u0302\u0323 a\u0323\u0302 q\u0307\u0323 x\u0301\u0316 e\u0323\u0302\u0301"),
    ("nfc_hangul_jamo", "\u1100\u1161 \u1100\u1161\u11a8 \u1112\u1161\u11ab\u1100\u1173\u11af \uac00\u11a8 \u1100\u1100\u1161"),
    ("nfc_singletons", "\u212b \u2126 \u212a K \u0340\u0341 \u1fee x\u2000y \u2001 \u0374 \u037e \u0387"),
    ("nfc_exclusions", "\u0958 \u0915\u093c \u2adc \ufb1d \u05d9\u05b4 \u0f43 \u0344"),
    ("nfc_vietnamese", "Tie\u0302\u0301ng Vie\u0323\u0302t ngu\u031bo\u031b\u0300i Ti\u1ebfng Vi\u1ec7t"),
    ("nfc_greek", "\u03b1\u0313\u0301 \u1f00\u0301 \u0391\u0345 \u03c9\u0342\u0345 \u03b9\u0308\u0301"),
    ("nfc_compatibility_kept", "\ufb01 x\u00b2 \u2460 \uff76 \u3300 \u2163 \u00bd \u1e9b\u0323"),
    ("nfc_starts_with_mark", "\u0301abc \u0308"),
    ("nfc_mark_alone", "\u0301"),
    ("nfc_long_mark_run", "a" + "\u0301\u0300\u0302\u0323\u0316" * 10 + " o\u0308"),
    ("nfc_marks_by_special", "<|im_end|>\u0301x e<|im_start|>\u0301 o<|endoftext|>\u0308"),
    ("nfc_mixed", "Zoe\u0308 Dvor\u030ca\u0301k Stras\u0073e \u1100\u1161\u11a8 \u212bngstr\u00f6m"),
    ("qwen_added", "<|im_start|>assistant\n<think>\nhmm\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|>"
                   "<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|><|vision_start|><|image_pad|><|vision_end|>"),
    ("byte_lookalikes", "<0x41> <0xE2><0x82><0xAC> Ġhello Ċ"),
]


def random_texts(rng: random.Random, n: int) -> list[tuple[str, str]]:
    pools = [
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
        "0123456789", " ", "   ", "\t", "\n", "\r\n", "'", ".,;:!?()[]{}<>\"-_/\\@#$%^&*+=~`|",
        "éèêëàâäôöûüçñßøåæœÉÀÇ", "абвгдеёжзийклмнопрстуфхцчшщъыьэюяАБВГД", "αβγδεζηθικλμνξοπρστυφχψωΑΒΓ",
        "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年", "ひらがなカタカナ", "가나다라마바사",
        "مرحباكيفحالك", "नमस्तेदुनियाक्षत्र", "😀🎉🚀👍🏽👨\u200d👩\u200d👧❤\ufe0f🇵🇹✌🏿",
        "\u00a0\u3000\u2003\u0085\u200b\ufeff", "\u0301\u0308\u0323", "'s'S'll'LL're've'd'm't",
        "<|eot_id|>", "<|begin_of_text|>", "<s>", "</s>", "<|endoftext|>", "<mask>", "[[note]]", "▁", "Ġ",
    ]
    out = []
    for i in range(n):
        parts = []
        for _ in range(rng.randint(1, 14)):
            pool = rng.choice(pools)
            if pool.startswith("<") and pool.endswith(">") and len(pool) > 2 or pool in ("[[note]]", "Ġ"):
                parts.append(pool)
            elif len(pool) <= 3:
                parts.append(pool * rng.randint(1, 3))
            else:
                parts.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 8))))
        out.append((f"random.{i}", "".join(parts)))
    return out


def all_texts(corpus: list[str]) -> list[tuple[str, str]]:
    texts = list(HAND)
    lines = [l for doc in corpus for l in doc.split("\n") if l.strip()]
    # Every 4th corpus paragraph, whole (they are a few hundred characters each), and sentences with their
    # spacing kept.
    texts += [(f"corpus.{i}", l) for i, l in enumerate(lines) if i % 4 == 0]
    sentences = [s for l in lines for s in l.split(". ") if s]
    texts += [(f"sentence.{i}", s + ".") for i, s in enumerate(sentences) if i % 7 == 3]
    texts += random_texts(random.Random(9), 120)
    # ~12 KB: long enough to catch work that grows faster than the text (the Llama 2 style has no
    # pre-tokenizer, so the whole text is one BPE word there).
    texts.append(("very_long", "\n\n".join(corpus[:2]) + " 😀👨\u200d👩\u200d👧 " * 20))
    return texts


# ---- cases -----------------------------------------------------------------------------------------------


def make_cases(tok: Tokenizer, texts: list[tuple[str, str]], seed: int) -> dict:
    cases = []
    for k, (name, text) in enumerate(texts):
        ids = tok.encode(text, add_special_tokens=False).ids
        case = {"name": name, "text": text, "ids": ids}
        decoded = tok.decode(ids, skip_special_tokens=False)
        if decoded != text:
            case["decoded"] = decoded
        if k % 10 == 0:
            case["ids_with_special"] = tok.encode(text, add_special_tokens=True).ids
        cases.append(case)
    # Decode cases: random ids over the whole vocabulary, and runs of the lowest ids (single bytes and byte
    # tokens, so that broken UTF-8 and byte-fallback runs occur), each with and without special tokens.
    rng = random.Random(seed)
    n = tok.get_vocab_size(with_added_tokens=True)
    added = sorted(tok.get_added_tokens_decoder().keys())
    decode_cases = []
    for i in range(80):
        length = rng.randint(1, 12)
        if i % 3 == 0:
            ids = [rng.randrange(0, min(n, 300)) for _ in range(length)]
        elif i % 3 == 1 and added:
            ids = [rng.choice(added) if rng.random() < 0.3 else rng.randrange(n) for _ in range(length)]
        else:
            ids = [rng.randrange(n) for _ in range(length)]
        decode_cases.append({"ids": ids, "text": tok.decode(ids, skip_special_tokens=False),
                             "text_skip_special": tok.decode(ids, skip_special_tokens=True)})
    decode_cases.append({"ids": [], "text": "", "text_skip_special": ""})
    return {"cases": cases, "decode_cases": decode_cases}


def dump(obj: dict, path: Path) -> None:
    """One case per line: diffs stay readable and the file stays small."""
    import tokenizers

    lines = ["{", f'  "generator": "weights/tools/make_tokenizer_cases.py",',
             f'  "tokenizers_version": {json.dumps(tokenizers.__version__)},',
             f'  "tokenizer": {json.dumps(obj["tokenizer"])},']
    for key in ("cases", "decode_cases"):
        items = obj[key]
        lines.append(f'  "{key}": [')
        for j, c in enumerate(items):
            lines.append("    " + json.dumps(c, ensure_ascii=False) + ("," if j + 1 < len(items) else ""))
        lines.append("  ]" + ("," if key == "cases" else ""))
    lines.append("}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "tokenizers")
    ap.add_argument("--corpus", type=Path, default=ROOT / "weights" / "corpus")
    ap.add_argument("--bundled", type=Path, default=ROOT / "weights" / "tiny-llama3" / "tokenizer.json")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    corpus = read_corpus(args.corpus)

    fixtures: dict[str, str] = {}  # name -> tokenizer.json text
    fixtures["llama3_style"] = llama3_style(corpus).to_str(pretty=True)
    gpt2 = json.loads(gpt2_model(corpus).to_str())
    fixtures["gpt2_style"] = json.dumps(as_string_merges(gpt2), ensure_ascii=False, indent=2)
    byte_level = gpt2["pre_tokenizer"]
    gpt2["pre_tokenizer"] = dict(byte_level, add_prefix_space=True)
    fixtures["gpt2_prefix_space"] = json.dumps(gpt2, ensure_ascii=False, indent=2)
    gpt2["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True}, byte_level]}
    fixtures["gpt2_digits"] = json.dumps(gpt2, ensure_ascii=False, indent=2)
    base = sentencepiece_base(corpus)
    for name, make in (("llama2_style", llama2_style), ("llama2_metaspace", llama2_metaspace),
                       ("sp_unk_split", sp_unk_split)):
        fixtures[name] = json.dumps(make(base), ensure_ascii=False, indent=2)
    fixtures["qwen2_style"] = qwen2_style(corpus)  # last: the seeds of the fixtures above stay as they were
    fixtures["mistral_v0_3_style"] = json.dumps(mistral_v0_3_style(corpus), ensure_ascii=False, indent=2)
    fixtures["nemo_style"] = nemo_style(corpus)

    texts = all_texts(corpus)
    for seed, (name, text) in enumerate(fixtures.items()):
        tok = Tokenizer.from_str(text)  # what HF makes of exactly the bytes we ship
        (args.out / f"{name}.tokenizer.json").write_text(text + "\n", encoding="utf-8")
        cases = make_cases(tok, texts, seed)
        dump({"tokenizer": f"{name}.tokenizer.json", **cases}, args.out / f"{name}.cases.json")
        roundtrips = sum("decoded" not in c for c in cases["cases"])
        print(f"{name}: vocab {tok.get_vocab_size()}, {len(cases['cases'])} cases ({roundtrips} round-trip), "
              f"{len(cases['decode_cases'])} decode cases, tokenizer.json {len(text.encode()) // 1024} KiB")
    if args.bundled.exists():
        tok = Tokenizer.from_file(str(args.bundled))
        cases = make_cases(tok, texts, 99)
        dump({"tokenizer": "weights/tiny-llama3/tokenizer.json", **cases}, args.out / "tiny-llama3.cases.json")
        bad = [c["name"] for c in cases["cases"] if "decoded" in c]
        print(f"tiny-llama3 (bundled): {len(cases['cases'])} cases, round trips fail for {bad or 'none'}")


if __name__ == "__main__":
    sys.exit(main())
