#!/usr/bin/env python3
"""Make a random-weight model with the exact shapes of a real checkpoint, for benchmarks and tests without
downloading anything.

    python3 weights/tools/make_random_model.py --preset llama-3.2-1b --out weights/random-llama-3.2-1b \
        [--seed 0] [--layers N] [--head-dim D] [--dtype bf16|f16|f32] [--device auto|cpu|cuda]

Presets (the shapes and config.json fields of the published checkpoint):
  llama-3.2-1b, llama-3.2-3b   Llama 3.2 (Base/Instruct): tied, llama3 rope scaling. No tokenizer:
                               make_reference.py feeds them seeded random token ids.
  qwen2.5-0.5b                 Qwen2.5-0.5B-Instruct: q/k/v biases, rope_theta 1e6, tied.
  qwen3-0.6b                   Qwen3-0.6B: q_norm/k_norm, head_dim 128 (q width 2048 != hidden 1024), tied.
  mistral-7b                   Mistral-7B-v0.1: sliding_window 4096, untied lm_head, rope_theta 1e4.
The Qwen and Mistral presets also write a tokenizer of the family's style with the real special-token ids
and the family's chat template (family_tokenizers.py), so generate --prompt, chat and serve run on them.

--dtype f32 or f16 makes an F32 or F16 checkpoint (the values as drawn in fp32, or rounded once to fp16),
as some published checkpoints are. --head-dim D keeps the preset's hidden size and head counts, so the
attention width heads*D may differ from hidden_size (Llama's config.json allows it: head_dim is explicit);
e.g. --head-dim 80 checks the code paths for a head_dim that is neither 64 nor 128.

The tensors are drawn directly with torch (on the GPU when there is one: ~2.5 GB of bf16 for 1B) and
written with safetensors under Hugging Face's names, next to a config.json in the Hub's layout, so
transformers' LlamaForCausalLM.from_pretrained loads the directory like a downloaded checkpoint.
The same seed gives the same bytes on the same kind of device (CPU and CUDA random streams differ).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_init  # noqa: E402  (the shared module next to this script)

# The Llama 3.2 presets have tied embeddings and Llama 3 rope scaling with factor 32, which is what
# llama_init.llama_config_dict writes.
LLAMA_PRESETS = {
    "llama-3.2-1b": llama_init.LlamaShape(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64,
    ),
    "llama-3.2-3b": llama_init.LlamaShape(
        vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
        num_attention_heads=24, num_key_value_heads=8, head_dim=128,
    ),
}


@dataclass(frozen=True)
class FamilyPreset:
    """A non-Llama preset: its shapes, the tensors it adds, the tokenizer family (family_tokenizers.py) and
    the config.json fields beyond the shapes, as the Hub checkpoint's config.json has them."""

    shape: llama_init.LlamaShape
    extra: llama_init.FamilyTensors
    tokenizer: str
    write_head_dim: bool  # whether the Hub's config.json names head_dim (Qwen3 does; Qwen2.5, Mistral v0.1 not)
    fields: dict


FAMILY_PRESETS = {
    # Qwen/Qwen2.5-0.5B-Instruct. Qwen2 always has q/k/v biases (no attention_bias key); sliding_window is
    # there but unused because use_sliding_window is false.
    "qwen2.5-0.5b": FamilyPreset(
        shape=llama_init.LlamaShape(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                    num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                    head_dim=64),
        extra=llama_init.FamilyTensors(qkv_bias=True), tokenizer="qwen2.5", write_head_dim=False,
        fields={"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_dropout": 0.0,
                "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
                "initializer_range": 0.02, "max_position_embeddings": 32768, "max_window_layers": 21,
                "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
                "tie_word_embeddings": True, "use_cache": True, "use_sliding_window": False}),
    # Qwen/Qwen3-0.6B: per-head q/k RMSNorm, explicit head_dim 128.
    "qwen3-0.6b": FamilyPreset(
        shape=llama_init.LlamaShape(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                                    num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                                    head_dim=128),
        extra=llama_init.FamilyTensors(qk_norm=True), tokenizer="qwen3", write_head_dim=True,
        fields={"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
                "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
                "hidden_act": "silu", "initializer_range": 0.02, "max_position_embeddings": 40960,
                "max_window_layers": 28, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
                "sliding_window": None, "tie_word_embeddings": True, "use_cache": True,
                "use_sliding_window": False}),
    # mistralai/Mistral-7B-v0.1: a sliding window of 4096 positions, a separate lm_head.
    "mistral-7b": FamilyPreset(
        shape=llama_init.LlamaShape(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                    head_dim=128),
        extra=llama_init.FamilyTensors(tied=False), tokenizer="mistral", write_head_dim=False,
        fields={"architectures": ["MistralForCausalLM"], "model_type": "mistral", "bos_token_id": 1,
                "eos_token_id": 2, "hidden_act": "silu", "initializer_range": 0.02,
                "max_position_embeddings": 32768, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
                "sliding_window": 4096, "tie_word_embeddings": False, "use_cache": True}),
}
PRESETS = {**LLAMA_PRESETS, **{k: v.shape for k, v in FAMILY_PRESETS.items()}}
CORPUS = Path(__file__).resolve().parent.parent / "corpus"  # what the family tokenizers are trained on
DTYPES = {"bf16": (torch.bfloat16, "bfloat16"), "f16": (torch.float16, "float16"),
          "f32": (torch.float32, "float32")}
MAX_POSITION_EMBEDDINGS = 131072
BOS_ID = 128000                     # <|begin_of_text|>
EOS_IDS = [128001, 128008, 128009]  # <|end_of_text|>, <|eom_id|>, <|eot_id|>
FIRST_SPECIAL_ID = 128000           # ids 128000..128255 are Llama 3's special tokens


def pick_device(requested: str) -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but torch sees no CUDA device")
    return requested


def family_config(preset: FamilyPreset, shape: llama_init.LlamaShape, transformers_version: str,
                  torch_dtype: str, sliding_window: int | None = None) -> dict:
    """config.json with the Hub checkpoint's keys (the classic "torch_dtype" / "rope_theta" spelling, see
    llama_init.llama_config_dict) and this model's shapes (--layers / --head-dim change them);
    sliding_window (--sliding-window, Mistral) replaces the checkpoint's window."""
    config = dict(preset.fields)
    if sliding_window is not None:
        config["sliding_window"] = sliding_window
    config.update(hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
                  num_hidden_layers=shape.num_hidden_layers, num_attention_heads=shape.num_attention_heads,
                  num_key_value_heads=shape.num_key_value_heads, vocab_size=shape.vocab_size,
                  torch_dtype=torch_dtype, transformers_version=transformers_version)
    if preset.write_head_dim or shape.head_dim != shape.hidden_size // shape.num_attention_heads:
        config["head_dim"] = shape.head_dim
    if "max_window_layers" in config:  # Qwen: how many layers would use full attention with a window on
        config["max_window_layers"] = min(config["max_window_layers"], shape.num_hidden_layers)
    return config


def write_model(out: Path, preset: str, shape: llama_init.LlamaShape, seed: int, device: str,
                dtype: str, sliding_window: int | None = None) -> dict[str, torch.Tensor]:
    import transformers
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    family = FAMILY_PRESETS.get(preset)
    if family is None:
        extra = llama_init.FamilyTensors()
        bos, eos = BOS_ID, EOS_IDS
        quiet = list(range(FIRST_SPECIAL_ID, shape.vocab_size))  # never-trained special-token rows
    else:
        import family_tokenizers

        extra = family.extra
        ids = family_tokenizers.write_family_tokenizer(out, family.tokenizer, shape.vocab_size, CORPUS,
                                                       llama_init.write_json)
        bos, eos = family.fields["bos_token_id"], family.fields["eos_token_id"]
        if ids["bos_id"] != bos or ids["eos_ids"] != [eos]:
            raise SystemExit(f"error: the tokenizer's special ids {ids} disagree with the preset's config")
        quiet = list(range(ids["real_vocab"], shape.vocab_size))  # fillers and added tokens
    tensors = llama_init.init_weights(shape, seed=seed, device=device, quiet_rows=quiet,
                                      dtype=DTYPES[dtype][0], extra=extra)
    cpu = {name: t.cpu() for name, t in tensors.items()}
    # {"format": "pt"} is the metadata transformers itself writes; from_pretrained checks for it.
    save_file(cpu, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # save_file creates it private (0600)
    if family is None:
        config = llama_init.llama_config_dict(
            shape,
            max_position_embeddings=MAX_POSITION_EMBEDDINGS,
            bos_token_id=BOS_ID,
            eos_token_id=EOS_IDS,
            transformers_version=transformers.__version__,
            torch_dtype=DTYPES[dtype][1],
        )
        generation = {"bos_token_id": bos, "eos_token_id": eos}
    else:
        config = family_config(family, shape, transformers.__version__, DTYPES[dtype][1], sliding_window)
        # Qwen's generation_config.json also stops at <|endoftext|>; the sampling defaults the real files
        # have (Qwen3: temperature 0.6 ...) are left out: references and benchmarks decode greedily.
        generation = {"bos_token_id": bos,
                      "eos_token_id": [eos, bos] if family.tokenizer.startswith("qwen") else eos}
    llama_init.write_json(out / "config.json", config)
    generation["transformers_version"] = transformers.__version__
    llama_init.write_json(out / "generation_config.json", generation)
    return cpu


def verify_loads(out: Path, device: str, expected: dict[str, torch.Tensor], dtype: str) -> None:
    """Load with transformers as any user would, compare a few tensors (every family-specific one), check
    the tokenizer round-trips and run one short forward pass."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, dtype=DTYPES[dtype][0]).to(device).eval()
    state = model.state_dict()
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight"]
    names += [n for n in expected if n.endswith((".bias", "q_norm.weight", "k_norm.weight", "lm_head.weight"))
              and n.startswith(("model.layers.0.", "lm_head"))]
    if sorted(state) != sorted(set(expected) | {"lm_head.weight"}):
        raise SystemExit(f"error: transformers' {type(model).__name__} has tensors "
                         f"{sorted(set(state) ^ (set(expected) | {'lm_head.weight'}))} we did (not) write")
    for name in names:
        if not torch.equal(state[name].cpu(), expected[name]):
            raise SystemExit(f"error: {name} as loaded by transformers differs from the written tensor")
    tied = "lm_head.weight" not in expected
    if tied != (model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()):
        raise SystemExit(f"error: transformers {'did not tie' if tied else 'tied'} lm_head and embed_tokens")
    high = min(FIRST_SPECIAL_ID, model.config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, high, (1, 32), generator=gen)
    if (out / "tokenizer.json").exists():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(out)
        text = "The capital of Portugal is Lisbon. Café, 123!"
        if tok.decode(tok(text, add_special_tokens=False)["input_ids"]) != text:
            raise SystemExit("error: the tokenizer does not round-trip a plain sentence")
        if len(tok) != model.config.vocab_size or tok.eos_token_id != state_eos(model.config):
            raise SystemExit(f"error: tokenizer ({len(tok)} ids, EOS {tok.eos_token_id}) disagrees with config")
        ids = torch.tensor([tok(text)["input_ids"]])
    elif model.config.bos_token_id is not None:
        ids[0, 0] = model.config.bos_token_id
    with torch.no_grad():
        logits = model(ids.to(device)).logits[0].float()
    top2 = logits.topk(2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    if not torch.isfinite(logits).all():
        raise SystemExit("error: non-finite logits from the random model")
    print(f"transformers loads it ({type(model).__name__}): logits {tuple(logits.shape)}, top1-top2 margin "
          f"median {margin.median():.3f}, {(margin > 0.5).float().mean() * 100:.0f}% > 0.5")


def state_eos(config) -> int:
    eos = config.eos_token_id
    return eos[0] if isinstance(eos, list) else eos


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", required=True, choices=sorted(PRESETS), help="which checkpoint's shapes")
    ap.add_argument("--out", required=True, type=Path, help="output model directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=None, help="override the number of layers (quick tests)")
    ap.add_argument("--head-dim", type=int, default=None,
                    help="override head_dim (a multiple of 8 up to 256; heads and hidden size stay)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="stored dtype (default bf16)")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                    help="where the random numbers are drawn (auto: cuda if available)")
    ap.add_argument("--sliding-window", type=int, default=None,
                    help="mistral-7b: this window instead of 4096, e.g. 64, shorter than the reference's prompts, "
                         "so the windowed attention paths run at the real shapes")
    ap.add_argument("--no-verify", action="store_true", help="skip loading the result with transformers")
    args = ap.parse_args()
    if args.sliding_window is not None:
        preset = FAMILY_PRESETS.get(args.preset)
        if preset is None or preset.fields["model_type"] != "mistral":
            raise SystemExit("error: --sliding-window is for the mistral-7b preset (Mistral's sliding_window)")
        if args.sliding_window < 1:
            raise SystemExit("error: --sliding-window must be >= 1")

    shape = PRESETS[args.preset]
    if args.layers is not None:
        if args.layers < 1:
            raise SystemExit("error: --layers must be >= 1")
        shape = llama_init.LlamaShape(**{**shape.__dict__, "num_hidden_layers": args.layers})
    if args.head_dim is not None:
        if args.head_dim < 8 or args.head_dim > 256 or args.head_dim % 8:
            raise SystemExit("error: --head-dim must be a multiple of 8 from 8 to 256")
        shape = llama_init.LlamaShape(**{**shape.__dict__, "head_dim": args.head_dim})
    device = pick_device(args.device)
    t0 = time.time()
    tensors = write_model(args.out, args.preset, shape, args.seed, device, args.dtype, args.sliding_window)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    print(f"wrote {args.out}: {len(tensors)} tensors, {nbytes / 1e9:.2f} GB {args.dtype}, "
          f"{shape.num_hidden_layers} layers, head_dim {shape.head_dim}, drawn on {device} in "
          f"{time.time() - t0:.1f} s")
    if not args.no_verify:
        verify_loads(args.out, device, tensors, args.dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
