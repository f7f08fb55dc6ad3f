#!/usr/bin/env python3
"""Tiny random models of the Llama-like families of issue 18, with transformers' greedy references.

For each family (qwen2, qwen3, mistral with a window shorter than the prompt, llama with attention_bias and
mlp_bias) this builds a model of a few KB-scale layers with Hugging Face transformers in fp32, saves
config.json + model.safetensors under tests/data/models/<family>/, and writes reference.json:
  prompt_ids, greedy_ids (model.generate, do_sample=False, fp32) and the prompt's last-row logits.
The C++ test (tests/test_08_families.cpp, to come) asserts our CPU greedy ids equal greedy_ids exactly and the
logits agree within an fp32 tolerance.

Usage: python3 weights/tools/make_family_models.py [--out tests/data/models] [--seed 0]
Needs: torch, transformers, safetensors (CPU wheels are enough).
"""
import argparse
import json
import os

import torch
import transformers

# Small on purpose (tens of KB in fp32 each): hidden 32, 2 layers, vocab 200. GQA (4 q heads, 2 kv heads)
# is kept so grouping is exercised; head_dim 8 by default, explicit 16 where the family allows it (a multiple of 8: the GPU kernels run them too).
COMMON = dict(vocab_size=200, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, hidden_act="silu")

FAMILIES = {
    # Qwen2: q/k/v biases, none on o; rope_theta 1e6; tied embeddings as the small releases.
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              dict(rope_theta=1e6, tie_word_embeddings=True, use_sliding_window=False)),
    # Qwen3: q_norm / k_norm per head, explicit head_dim 16 (q width 64 != hidden 32), no biases.
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
              dict(head_dim=16, rope_theta=1e6, tie_word_embeddings=True, attention_bias=False,
                   use_sliding_window=False)),
    # Mistral: a sliding window of 5 positions, shorter than the prompt; explicit head_dim 16 (as NeMo: q width != hidden).
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM,
                dict(head_dim=16, sliding_window=5, rope_theta=10000.0, tie_word_embeddings=False)),
    # Llama with biases everywhere the config allows.
    "llama_bias": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                   dict(attention_bias=True, mlp_bias=True, rope_theta=10000.0, tie_word_embeddings=False)),
}

# Seed 0 makes a Qwen2 that repeats one token twelve times (a weak test of generation); seed 2 varies its ids.
SEED_OFFSET = {"qwen2": 2}

PROMPT = [1, 17, 190, 45, 9, 133, 71, 150, 3, 88, 12]  # 11 tokens: longer than Mistral's window of 5
NEW_TOKENS = 12


def make(family, out_root, seed):
    cfg_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed + SEED_OFFSET.get(family, 0))
    kwargs = dict(COMMON, **extra)
    if family == "mistral":
        kwargs["attn_implementation"] = "eager"  # eager applies the window mask exactly as written
    config = cfg_cls(**{k: v for k, v in kwargs.items() if k != "attn_implementation"})
    model = model_cls(config).to(torch.float32).eval()
    if "attn_implementation" in kwargs:
        model.config._attn_implementation = "eager"
    # Random init gives tiny weights (std 0.02) and near-uniform logits; scale them up so greedy choices are
    # decided by clear margins, not by fp32 rounding. Norm weights and biases get noise too so that a forward
    # that skipped them would differ.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.3 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / (p.shape[-1] ** 0.5))
    out = os.path.join(out_root, family)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for junk in ("generation_config.json",):
        path = os.path.join(out, junk)
        if os.path.exists(path):
            os.remove(path)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        logits = model(ids).logits[0, -1].tolist()
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    ref = {"family": family, "transformers": transformers.__version__, "torch": torch.__version__,
           "dtype": "float32", "prompt_ids": PROMPT, "greedy_ids": gen[0, len(PROMPT):].tolist(),
           "last_logits": [float(f"{x:.6g}") for x in logits]}
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump(ref, f, indent=1)
    print(family, "greedy", ref["greedy_ids"])
    if family == "mistral":  # the window must matter, or the test would not test it
        model.config.sliding_window = None
        with torch.no_grad():
            nowin = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                   do_sample=False, eos_token_id=None, pad_token_id=0)
        assert nowin[0, len(PROMPT):].tolist() != ref["greedy_ids"], "the window changed nothing"
        print("mistral without its window", nowin[0, len(PROMPT):].tolist())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="tests/data/models")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--family", choices=sorted(FAMILIES), action="append")
    a = ap.parse_args()
    for fam in a.family or sorted(FAMILIES):
        make(fam, a.out, a.seed)


if __name__ == "__main__":
    main()
