#!/usr/bin/env python3
"""Make the bundled tiny Llama 3 model (weights/tiny-llama3) deterministically.

    python3 weights/tools/make_tiny_model.py [--out weights/tiny-llama3] [--corpus weights/corpus] [--seed 0]

What it writes (every file byte-identical from run to run with the same library versions):
  tokenizer.json          byte-level BPE trained on weights/corpus with Llama 3's pre-tokenizer, decoder,
                          post-processor and its 256 special tokens appended after the trained vocabulary
  tokenizer_config.json   Llama 3 style: added_tokens_decoder, bos/eos, the chat template, model_max_length
  special_tokens_map.json
  config.json             Llama 3 architecture with small, deliberately awkward sizes (see TINY_SHAPE)
  generation_config.json
  model.safetensors       bf16 weights from a seeded initialisation (llama_init.py), tied embeddings

It then reloads the model in fp32 and prints statistics that show the outputs are not degenerate:
top-1/top-2 logit margins, attention entropy, residual-stream RMS, a greedy sample.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_init  # noqa: E402  (the shared module next to this script)

WEIGHTS_DIR = Path(__file__).resolve().parent.parent

# Sizes chosen so that bugs cannot hide behind coincidences:
#  - q_dim = 6 * 64 = 384 != hidden 336: code that sizes q or o_proj by hidden_size fails;
#  - hidden / heads = 56 != head_dim 64: code that derives head_dim from hidden_size fails;
#  - 336, 600 and 1000 are not powers of two, and 336 = 10.5 warps of 32: a reduction that assumes whole
#    warps, or one thread per element in a block of 256, gets it wrong;
#  - 6 query heads share 2 KV heads (groups of 3): grouped-query attention with an odd group size.
# (hidden 320 was the first plan, but transformers 5 rejects a hidden size that is not a multiple of the
# number of heads even when head_dim is given explicitly, so 336 = 6 * 56 it is.)
TINY_SHAPE = llama_init.LlamaShape(
    vocab_size=1000,
    hidden_size=336,
    intermediate_size=600,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=64,
)
MAX_POSITION_EMBEDDINGS = 2048

# Llama 3's pre-tokenizer regex (the Split pattern in Llama 3's tokenizer.json): contractions, letters with
# an optional leading non-letter, numbers in groups of at most 3 digits, punctuation runs, newlines, spaces.
LLAMA3_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

BOS = "<|begin_of_text|>"
EOS_TEXT = "<|end_of_text|>"
EOM = "<|eom_id|>"
EOT = "<|eot_id|>"  # end of a chat turn: the eos_token of Llama 3.x Instruct

# Llama 3.x Instruct's conversation format, written as a small Jinja template: BOS once, then for every
# message a header naming the role, a blank line, the trimmed content and <|eot_id|>; with
# add_generation_prompt, an open assistant header for the model to continue.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- (message['content'] | trim) + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)


def llama3_special_tokens() -> list[str]:
    """Llama 3.1/3.2's 256 special tokens in id order (ids 128000..128255 there)."""
    named = [
        BOS,
        EOS_TEXT,
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|finetune_right_pad_id|>",
        "<|reserved_special_token_2|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        EOM,
        EOT,
        "<|python_tag|>",
    ]
    reserved = [f"<|reserved_special_token_{i}|>" for i in range(3, 3 + 256 - len(named))]
    return named + reserved


def read_corpus(corpus_dir: Path) -> list[str]:
    """The corpus files in sorted name order (training must see the same sequence on every machine)."""
    files = sorted(corpus_dir.glob("*.txt"))
    if not files:
        raise SystemExit(f"error: no *.txt files in corpus directory {corpus_dir}")
    return [f.read_text(encoding="utf-8") for f in files]


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer shaped exactly like Llama 3's tokenizer.json, trained on texts."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = llama3_special_tokens()
    trained_size = vocab_size - len(specials)
    # ignore_merges=True like Llama 3: a pre-token that is itself in the vocabulary maps to that one id
    # without running the merges (a C++ tokenizer must do the same to match).
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT_REGEX), behavior="isolated", invert=False),
            # use_regex=False: the Split above already did the splitting; ByteLevel only maps bytes to
            # the printable characters that byte-level BPE vocabularies are written in.
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=trained_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: any string is encodable
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size() != trained_size:
        raise SystemExit(
            f"error: BPE training produced {tok.get_vocab_size()} tokens, wanted {trained_size}: "
            "the corpus is too small for that many merges"
        )
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            # Prepends <|begin_of_text|> when add_special_tokens=True, as Llama 3's tokenizer does.
            processors.TemplateProcessing(
                single=f"{BOS} $A",
                pair=f"{BOS} $A {BOS} $B",
                special_tokens=[(BOS, bos_id)],
            ),
        ]
    )
    if tok.get_vocab_size() != vocab_size:
        raise SystemExit(f"error: tokenizer has {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    return tok


def added_token_entry(content: str) -> dict:
    return {
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }


def write_tokenizer_files(tok, out: Path) -> None:
    """tokenizer.json plus the two JSON files in the form Llama 3.2's Hub repositories ship them.

    We write tokenizer_config.json ourselves because transformers 5 would put the chat template in a
    separate chat_template.jinja and drop added_tokens_decoder; real Llama 3 checkpoints (and so the C++
    loader) have both inside tokenizer_config.json.
    """
    tok.save(str(out / "tokenizer.json"), pretty=True)
    specials = llama3_special_tokens()
    config = {
        "added_tokens_decoder": {str(tok.token_to_id(s)): added_token_entry(s) for s in specials},
        "bos_token": BOS,
        "chat_template": CHAT_TEMPLATE,
        # False (Llama 3.2 says True): keeps decode(encode(text)) == text; the clean-up would delete the
        # space in " ." and similar, which a byte-level tokenizer never needs.
        "clean_up_tokenization_spaces": False,
        "eos_token": EOT,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    llama_init.write_json(out / "tokenizer_config.json", config)
    special_map = {key: {k: v for k, v in added_token_entry(s).items() if k != "special"}
                   for key, s in (("bos_token", BOS), ("eos_token", EOT))}
    llama_init.write_json(out / "special_tokens_map.json", special_map)


def tokens_unused_by(tok, texts: list[str]) -> list[int]:
    """Ids the tokenizer never produces on texts (all special tokens, bytes that never stand alone)."""
    used = set()
    for text in texts:
        used.update(tok.encode(text, add_special_tokens=False).ids)
    return [i for i in range(tok.get_vocab_size()) if i not in used]


def build_model(tok, texts: list[str], seed: int):
    """LlamaForCausalLM in bf16 holding the seeded weights, and its config dict."""
    import transformers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    bos_id = tok.token_to_id(BOS)
    # Llama 3.x Instruct stops on any of these three.
    eos_ids = [tok.token_to_id(EOS_TEXT), tok.token_to_id(EOM), tok.token_to_id(EOT)]
    config_dict = llama_init.llama_config_dict(
        TINY_SHAPE,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        bos_token_id=bos_id,
        eos_token_id=eos_ids,
        transformers_version=transformers.__version__,
    )
    # A deep copy: LlamaConfig edits the rope_scaling dict it is given (it adds rope_theta to it).
    config = LlamaConfig(**copy.deepcopy({k: v for k, v in config_dict.items() if k != "transformers_version"}))

    torch.manual_seed(seed)  # LlamaForCausalLM's own init is overwritten below; seeded anyway
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    weights = llama_init.init_weights(
        TINY_SHAPE, seed=seed, device="cpu", quiet_rows=tokens_unused_by(tok, texts)
    )
    missing, unexpected = model.load_state_dict(weights, strict=False)
    # lm_head.weight is tied to embed_tokens and so is the only key we do not provide.
    if unexpected or set(missing) != {"lm_head.weight"}:
        raise SystemExit(f"error: state dict mismatch: missing={missing} unexpected={unexpected}")
    if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise SystemExit("error: lm_head is not tied to embed_tokens")
    # The Llama 3.2 Instruct generation defaults (do_sample with temperature 0.6, top_p 0.9).
    model.generation_config = GenerationConfig(
        bos_token_id=bos_id, eos_token_id=eos_ids, do_sample=True, temperature=0.6, top_p=0.9
    )
    return model, config_dict, weights


def save_model(model, config_dict: dict, out: Path) -> None:
    model.save_pretrained(out)
    # Replace the transformers-5 style config.json by the Hub's classic layout (see llama_init).
    llama_init.write_json(out / "config.json", config_dict)
    (out / "model.safetensors").chmod(0o644)  # safetensors creates it private (0600)


def check_saved(out: Path, weights: dict[str, torch.Tensor]) -> None:
    """The file holds exactly our tensors, bit for bit, and nothing else."""
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
        if names != set(weights):
            raise SystemExit(f"error: saved tensors differ: extra={names - set(weights)} "
                             f"missing={set(weights) - names}")
        for name in sorted(names):
            if not torch.equal(f.get_tensor(name).view(torch.int16), weights[name].view(torch.int16)):
                raise SystemExit(f"error: saved tensor {name} differs from the initialised one")


def check_rope_scaling(model) -> None:
    """Llama 3 scaling must actually change some frequencies at head_dim 64, or lesson 05 tests nothing."""
    rot = model.model.rotary_emb
    d = TINY_SHAPE.head_dim
    plain = 1.0 / (llama_init.LLAMA3_ROPE_THETA ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    scaled = rot.inv_freq.double()
    changed = (scaled - plain).abs() > 1e-6 * plain
    low = (scaled - plain / llama_init.LLAMA3_ROPE_SCALING["factor"]).abs() <= 1e-6 * plain
    print(f"rope: {int(changed.sum())}/{d // 2} frequencies changed by llama3 scaling "
          f"({int(low.sum())} divided by the full factor, {int(changed.sum() - low.sum())} smoothed)")
    if not changed.any() or changed.all():
        raise SystemExit("error: llama3 rope scaling should change some but not all frequencies")


def margin_stats(logits: torch.Tensor) -> torch.Tensor:
    """top1 - top2 logit gap per position; logits [T, vocab]."""
    top2 = logits.topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


def report_statistics(out: Path, texts: list[str]) -> None:
    """Reload in fp32 the way make_reference.py does and show that the outputs are not degenerate."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(out)
    model = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    check_rope_scaling(model)
    # 8 windows of the corpus, 120 tokens each, as a stand-in for "typical input".
    ids_all = tok(" ".join(texts), add_special_tokens=False)["input_ids"]
    step = max(1, (len(ids_all) - 120) // 8)
    margins, ratio, rms = [], [], []
    layer_out: list[torch.Tensor] = []
    for layer in model.model.layers:  # the residual stream after each layer
        layer.register_forward_hook(
            lambda mod, args, out: layer_out.append(out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        for start in range(0, 8 * step, step):
            ids = torch.tensor([[tok.bos_token_id] + ids_all[start:start + 119]])
            layer_out.clear()
            res = model(ids, output_attentions=True)
            embeds = model.model.embed_tokens(ids)
            margins.append(margin_stats(res.logits[0]))
            for att in res.attentions:  # [1, heads, T, T]; rows t >= 16 so "uniform" is meaningful
                p = att[0, :, 16:, :].clamp_min(1e-30)
                ent = -(p * p.log()).sum(-1)
                uniform = torch.log(torch.arange(17, ids.shape[1] + 1, dtype=torch.float32))
                ratio.append((ent / uniform).mean())
            rms.append(torch.stack([h[0].pow(2).mean().sqrt() for h in [embeds] + layer_out]))
        m = torch.cat(margins)
        q = torch.quantile(m, torch.tensor([0.1, 0.25, 0.5, 0.75, 0.9]))
        print(f"logit margin top1-top2 over {m.numel()} positions: min {m.min():.3f} p10 {q[0]:.3f} "
              f"p25 {q[1]:.3f} median {q[2]:.3f} p75 {q[3]:.3f} p90 {q[4]:.3f} max {m.max():.3f}; "
              f"{(m > 0.5).float().mean() * 100:.1f}% > 0.5")
        print(f"attention entropy / uniform entropy (1.0 = uniform): {torch.stack(ratio).mean():.3f}")
        print("residual stream RMS (embeddings, then after each layer): "
              + ", ".join(f"{v:.3f}" for v in torch.stack(rms).mean(0)))
        prompt = tok("The tomatoes have", return_tensors="pt")
        gen = model.generate(**prompt, max_new_tokens=24, do_sample=False, temperature=None, top_p=None,
                             pad_token_id=tok.eos_token_id)
        print(f"greedy sample: {tok.decode(gen[0])!r}")


def sha256_of_dir(out: Path) -> None:
    for f in sorted(out.iterdir()):
        if f.is_file():
            print(f"  {hashlib.sha256(f.read_bytes()).hexdigest()}  {f.stat().st_size:>9}  {f.name}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=WEIGHTS_DIR / "tiny-llama3", help="output model directory")
    ap.add_argument("--corpus", type=Path, default=WEIGHTS_DIR / "corpus", help="tokenizer training texts")
    ap.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    ap.add_argument("--no-stats", action="store_true", help="skip reloading the model for statistics")
    args = ap.parse_args()

    torch.use_deterministic_algorithms(True)
    texts = read_corpus(args.corpus)
    tok = train_tokenizer(texts, TINY_SHAPE.vocab_size)
    args.out.mkdir(parents=True, exist_ok=True)
    write_tokenizer_files(tok, args.out)
    model, config_dict, weights = build_model(tok, texts, args.seed)
    save_model(model, config_dict, args.out)
    check_saved(args.out, weights)
    print(f"wrote {args.out} (vocab {tok.get_vocab_size()}: {tok.get_vocab_size() - 256} trained + 256 special)")
    sha256_of_dir(args.out)
    if not args.no_stats:
        report_statistics(args.out, texts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
