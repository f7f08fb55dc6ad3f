#!/usr/bin/env python3
"""Make a random-weight model with the exact shapes of a real Llama checkpoint, for benchmarks and tests
without downloading anything. No tokenizer: make_reference.py feeds it seeded random token ids.

    python3 weights/tools/make_random_model.py --preset llama-3.2-1b --out weights/random-llama-3.2-1b \
        [--seed 0] [--layers N] [--head-dim D] [--dtype bf16|f16|f32] [--device auto|cpu|cuda]

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
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_init  # noqa: E402  (the shared module next to this script)

# Shapes of the published checkpoints' config.json files. Both have tied embeddings and Llama 3 rope
# scaling with factor 32, which is what llama_init.llama_config_dict writes.
PRESETS = {
    "llama-3.2-1b": llama_init.LlamaShape(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64,
    ),
    "llama-3.2-3b": llama_init.LlamaShape(
        vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
        num_attention_heads=24, num_key_value_heads=8, head_dim=128,
    ),
}
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


def write_model(out: Path, shape: llama_init.LlamaShape, seed: int, device: str,
                dtype: str) -> dict[str, torch.Tensor]:
    import transformers
    from safetensors.torch import save_file

    quiet = list(range(FIRST_SPECIAL_ID, shape.vocab_size))  # never-trained special-token rows
    tensors = llama_init.init_weights(shape, seed=seed, device=device, quiet_rows=quiet,
                                      dtype=DTYPES[dtype][0])
    cpu = {name: t.cpu() for name, t in tensors.items()}
    out.mkdir(parents=True, exist_ok=True)
    # {"format": "pt"} is the metadata transformers itself writes; from_pretrained checks for it.
    save_file(cpu, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # save_file creates it private (0600)
    config = llama_init.llama_config_dict(
        shape,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_IDS,
        transformers_version=transformers.__version__,
        torch_dtype=DTYPES[dtype][1],
    )
    llama_init.write_json(out / "config.json", config)
    generation = {"bos_token_id": BOS_ID, "eos_token_id": EOS_IDS,
                  "transformers_version": transformers.__version__}
    llama_init.write_json(out / "generation_config.json", generation)
    return cpu


def verify_loads(out: Path, device: str, expected: dict[str, torch.Tensor], dtype: str) -> None:
    """Load with transformers as any user would, compare a few tensors, run one short forward pass."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(out, dtype=DTYPES[dtype][0]).to(device).eval()
    state = model.state_dict()
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight"):
        if not torch.equal(state[name].cpu(), expected[name]):
            raise SystemExit(f"error: {name} as loaded by transformers differs from the written tensor")
    if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise SystemExit("error: transformers did not tie lm_head to embed_tokens")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, FIRST_SPECIAL_ID, (1, 32), generator=gen)
    ids[0, 0] = BOS_ID
    with torch.no_grad():
        logits = model(ids.to(device)).logits[0].float()
    top2 = logits.topk(2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    if not torch.isfinite(logits).all():
        raise SystemExit("error: non-finite logits from the random model")
    print(f"transformers loads it: logits {tuple(logits.shape)}, top1-top2 margin median "
          f"{margin.median():.3f}, {(margin > 0.5).float().mean() * 100:.0f}% > 0.5")


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
    ap.add_argument("--no-verify", action="store_true", help="skip loading the result with transformers")
    args = ap.parse_args()

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
    tensors = write_model(args.out, shape, args.seed, device, args.dtype)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    print(f"wrote {args.out}: {len(tensors)} tensors, {nbytes / 1e9:.2f} GB {args.dtype}, "
          f"{shape.num_hidden_layers} layers, head_dim {shape.head_dim}, drawn on {device} in "
          f"{time.time() - t0:.1f} s")
    if not args.no_verify:
        verify_loads(args.out, device, tensors, args.dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
