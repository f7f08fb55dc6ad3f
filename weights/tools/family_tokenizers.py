"""Tokenizer files for make_random_model.py's Qwen and Mistral presets: the family's tokenizer STYLE, trained
small on the project's corpus, laid out at the real checkpoint's ids, so the engine's whole text path
(tokenize, chat template, detokenize, serve) runs on a random model of the real shapes without a download.

    qwen2.5 / qwen3   byte-level BPE as Qwen ships it (NFC normalizer, Qwen2's split regex, ByteLevel
                      post-processor and decoder, no BOS): make_tokenizer_cases.qwen2_style, ~1000 trained
                      ids, then the added tokens at their real ids (<|endoftext|> = 151643, <|im_start|> =
                      151644, <|im_end|> = 151645, ...; Qwen3 adds <tool_response> ... </think> up to 151668)
    mistral           SentencePiece-style BPE with byte fallback as Mistral-7B-v0.1's tokenizer.json has it
                      (Llama 2's layout: <unk> <s> </s>, the 256 <0xNN> tokens, then the pieces; Prepend +
                      Replace normalizer; TemplateProcessing with <s>)

The ids between the trained tokens and the model's vocab_size (Qwen: below and above the added tokens) are filled with "<fillerN>" tokens that no merge
produces: encode never returns them, but a random model may well choose one, and every id it can choose must
decode (the engine refuses an id that names no token, as Hugging Face's decode does). Their embedding and
lm_head rows are the "quiet" ones (llama_init.InitScales.quiet_row_scale), as untrained rows are in real
checkpoints.

tokenizer_config.json carries the family's real chat template (copied from tests/data/chat_templates/, where
the real templates are kept with their transformers renderings), the real special-token strings and
tokenizer_class PreTrainedTokenizerFast, so transformers uses tokenizer.json exactly as written.
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
TEMPLATES = ROOT / "tests" / "data" / "chat_templates"

QWEN_FIRST_ADDED_ID = 151643  # <|endoftext|> in every Qwen2 / Qwen2.5 / Qwen3 tokenizer


def _filler(i: int) -> str:
    return f"<filler{i}>"


def _added_entry(content: str, token_id: int, special: bool) -> dict:
    return {"id": token_id, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": special}


def _fill(vocab: dict[str, int], upto: int) -> None:
    """Give every id below `upto` that has no token a filler token."""
    used = set(vocab.values())
    for i in range(upto):
        if i not in used:
            name = _filler(i)
            assert name not in vocab, name
            vocab[name] = i


def qwen_tokenizer(texts: list[str], vocab_size: int, num_added: int) -> dict:
    """Qwen's tokenizer.json: the trained byte-level BPE at ids 0.., fillers, then the first num_added of Qwen3's
    added tokens (22: Qwen2.5's, 26: Qwen3's) from 151643 on, then fillers up to vocab_size - 1 (the JSON
    object)."""
    from make_tokenizer_cases import QWEN_ADDED, qwen2_style

    t = json.loads(qwen2_style(texts))
    vocab = {tok: i for tok, i in t["model"]["vocab"].items() if i < QWEN_FIRST_ADDED_ID}
    added = QWEN_ADDED[:num_added]
    added_ids = {QWEN_FIRST_ADDED_ID + k for k in range(len(added))}
    if max(vocab.values()) >= QWEN_FIRST_ADDED_ID or max(added_ids) >= vocab_size:
        raise SystemExit("error: the Qwen tokenizer layout does not fit vocab_size")
    # Hugging Face's tokenizers gives an added token the id after the model's last unless the model's vocab
    # holds the same string: so each added token is also a vocab entry at its id (as <s> is in Llama 2's
    # file), which keeps the real ids with fillers both below and above them.
    for k, (content, _) in enumerate(added):
        vocab[content] = QWEN_FIRST_ADDED_ID + k
    _fill(vocab, vocab_size)
    t["model"]["vocab"] = dict(sorted(vocab.items(), key=lambda kv: kv[1]))
    t["added_tokens"] = [_added_entry(c, QWEN_FIRST_ADDED_ID + k, s) for k, (c, s) in enumerate(added)]
    return t


def mistral_tokenizer(texts: list[str], vocab_size: int) -> dict:
    """Mistral-7B-v0.1's tokenizer.json layout (Llama 2's), filled to vocab_size ids."""
    from make_tokenizer_cases import SP_DECODER, sentencepiece_base

    t = sentencepiece_base(texts)
    t["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}
    t["decoder"] = SP_DECODER
    vocab = t["model"]["vocab"]
    if len(vocab) > vocab_size:
        raise SystemExit("error: the Mistral tokenizer has more pieces than vocab_size")
    _fill(vocab, vocab_size)
    return t


def _template(name: str) -> str:
    return json.loads((TEMPLATES / name / "tokenizer_config.json").read_text(encoding="utf-8"))["chat_template"]


def write_family_tokenizer(out: Path, family: str, vocab_size: int, corpus_dir: Path, write_json) -> dict:
    """Writes tokenizer.json and tokenizer_config.json for family "qwen2.5", "qwen3" or "mistral"; returns
    {"bos_id", "eos_ids", "real_vocab"}: the special ids config.json names and the number of ids below which
    the tokenizer's trained tokens lie (everything else is a filler or an added token: a quiet row)."""
    from make_tokenizer_cases import read_corpus

    texts = read_corpus(corpus_dir)
    qwen = family in ("qwen2.5", "qwen3")
    if qwen:
        t = qwen_tokenizer(texts, vocab_size, 22 if family == "qwen2.5" else 26)
    elif family == "mistral":
        t = mistral_tokenizer(texts, vocab_size)
    else:
        raise ValueError(family)
    real_vocab = min(i for tok, i in t["model"]["vocab"].items() if tok.startswith("<filler"))
    # tokenizer_config.json lists the added tokens by id, as transformers writes it.
    added_decoder = {str(e["id"]): {k: v for k, v in e.items() if k != "id"} for e in t["added_tokens"]}
    if qwen:
        config = {
            # As Qwen's own tokenizer_config.json: no BOS, <|im_end|> ends a turn, <|endoftext|> pads.
            "add_bos_token": False,
            "add_prefix_space": False,
            "added_tokens_decoder": added_decoder,
            "bos_token": None,
            "chat_template": _template("qwen2_5" if family == "qwen2.5" else "qwen3"),
            "clean_up_tokenization_spaces": False,
            "eos_token": "<|im_end|>",
            "errors": "replace",
            "model_max_length": 131072,
            "pad_token": "<|endoftext|>",
            "split_special_tokens": False,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "unk_token": None,
        }
        ids = {"bos_id": QWEN_FIRST_ADDED_ID, "eos_ids": [QWEN_FIRST_ADDED_ID + 2], "real_vocab": real_vocab}
    else:
        config = {
            "add_bos_token": True,
            "add_eos_token": False,
            "added_tokens_decoder": added_decoder,
            "bos_token": "<s>",
            # Mistral-7B-Instruct-v0.1's template as released (the base v0.1 repository ships none; the
            # instruct model has the same shapes and tokenizer).
            "chat_template": _template("mistral_v0_1_release"),
            "clean_up_tokenization_spaces": False,
            "eos_token": "</s>",
            "legacy": True,
            "model_max_length": 32768,
            "pad_token": None,
            "spaces_between_special_tokens": False,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "unk_token": "<unk>",
        }
        ids = {"bos_id": 1, "eos_ids": [2], "real_vocab": real_vocab}
    (out / "tokenizer.json").write_text(json.dumps(t, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    write_json(out / "tokenizer_config.json", config)
    return ids
