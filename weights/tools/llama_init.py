"""Shared pieces of make_tiny_model.py and make_random_model.py: Llama shapes, the config.json they write,
and the seeded weight initialisation.

Why a custom initialisation instead of the one transformers uses: an untrained model initialised with
std 0.02 produces nearly uniform attention and nearly flat logits, so a kernel that is slightly wrong still
"matches" the reference and greedy decoding is decided by noise. The scales below are chosen so that
attention is clearly non-uniform, the residual stream stays O(1), and the top-1 logit usually beats the
runner-up by a clear margin. They depend only on the fan-in of each matrix, so the tiny model and the
1B-shaped random model behave alike.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

# Llama 3.x rotary scaling (rope_scaling.rope_type "llama3"), as in Llama 3.2 1B's config.json.
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
LLAMA3_ROPE_THETA = 500000.0


@dataclass(frozen=True)
class LlamaShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim


@dataclass(frozen=True)
class InitScales:
    """Standard deviations, as gains over 1/sqrt(fan_in) (see the module docstring for why)."""

    # std of every logit when the final hidden state has RMS 1 (tied embeddings: logits = h . E).
    # ~9 makes the gap between the best and second-best of ~1000 logits usually > 0.5.
    logit_std: float = 10.0
    # RMSNorm weights are 1 + N(0, norm_jitter): not all ones, so a kernel that forgets the weight fails.
    norm_jitter: float = 0.1
    # q and k gain: the attention score q.k/sqrt(head_dim) then has std ~ qk_gain^2, i.e. softmax is peaky.
    qk_gain: float = 2.0
    # o_proj and down_proj gains: each sub-layer adds a few units of RMS to the residual stream, so the
    # final hidden state is not dominated by the input token's own embedding (with tied embeddings that
    # would make the model predict the token it just read, over and over).
    o_gain: float = 6.0
    down_gain: float = 6.0
    # Embedding rows of tokens the tokenizer never produced on its training text (the special tokens, unused
    # bytes) are scaled by this: as in real checkpoints, where such rows were hardly trained, they rarely
    # win the argmax, so greedy output looks more like text.
    quiet_row_scale: float = 0.5
    # Biases (Qwen2's q/k/v): N(0, bias_std), a shift of about a quarter of a projection's own spread, so a
    # forward that forgot the bias is visibly wrong while q.k still depends mostly on the token.
    bias_std: float = 0.5


@dataclass(frozen=True)
class FamilyTensors:
    """The tensors a family adds to Llama's (make_random_model.py's Qwen and Mistral presets). The defaults
    are Llama 3.2's: no biases, no q/k norms, tied embeddings, so the Llama tensors and their drawing order
    stay exactly as they were."""

    qkv_bias: bool = False   # Qwen2: q_proj/k_proj/v_proj.bias (never o_proj)
    qk_norm: bool = False    # Qwen3: self_attn.q_norm/k_norm.weight, one [head_dim] RMSNorm weight each
    tied: bool = True        # False (Mistral): a separate lm_head.weight, drawn after model.norm


def weight_names_and_shapes(shape: LlamaShape,
                            extra: FamilyTensors = FamilyTensors()) -> list[tuple[str, tuple[int, ...]]]:
    """Hugging Face tensor names and [out, in] shapes, in a fixed order (the order random numbers are
    drawn in, so changing it changes every weight). No lm_head unless extra.tied is False."""
    h, i, q, kv = shape.hidden_size, shape.intermediate_size, shape.q_dim, shape.kv_dim
    out = [("model.embed_tokens.weight", (shape.vocab_size, h))]
    for layer in range(shape.num_hidden_layers):
        p = f"model.layers.{layer}."
        attn = [
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
        ]
        if extra.qkv_bias:
            attn += [(p + "self_attn.q_proj.bias", (q,)), (p + "self_attn.k_proj.bias", (kv,)),
                     (p + "self_attn.v_proj.bias", (kv,))]
        if extra.qk_norm:
            attn += [(p + "self_attn.q_norm.weight", (shape.head_dim,)),
                     (p + "self_attn.k_norm.weight", (shape.head_dim,))]
        out += [(p + "input_layernorm.weight", (h,)), *attn,
            (p + "self_attn.o_proj.weight", (h, q)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (i, h)),
            (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
        ]
    out.append(("model.norm.weight", (h,)))
    if not extra.tied:
        out.append(("lm_head.weight", (shape.vocab_size, h)))
    return out


def _std_for(name: str, dims: tuple[int, ...], shape: LlamaShape, scales: InitScales) -> float:
    """Standard deviation of the normal distribution a weight is drawn from."""
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return scales.logit_std / math.sqrt(shape.hidden_size)
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return scales.norm_jitter * scales.qk_gain  # drawn around qk_gain, see init_weights
    if name.endswith("norm.weight"):
        return scales.norm_jitter
    if name.endswith(".bias"):
        return scales.bias_std
    fan_in = dims[1]
    gain = 1.0
    if name.endswith(("q_proj.weight", "k_proj.weight")):
        gain = scales.qk_gain
    elif name.endswith("o_proj.weight"):
        gain = scales.o_gain
    elif name.endswith("down_proj.weight"):
        gain = scales.down_gain
    return gain / math.sqrt(fan_in)


def init_weights(
    shape: LlamaShape,
    seed: int,
    device: str = "cpu",
    scales: InitScales = InitScales(),
    quiet_rows: list[int] | None = None,
    dtype: torch.dtype = torch.bfloat16,
    extra: FamilyTensors = FamilyTensors(),
) -> dict[str, torch.Tensor]:
    """Every weight tensor of the model in dtype (bf16 unless asked), drawn from one seeded generator in a
    fixed order.

    Values are drawn in fp32 and rounded once to dtype (what is stored; fp32 keeps them as drawn). The
    stream of random numbers differs between CPU and CUDA generators: the same seed gives the same bytes
    on the same kind of device and torch version. quiet_rows: embedding rows to scale by
    scales.quiet_row_scale (in lm_head too when it is separate). extra: the family's additional tensors.

    Qwen3's q_norm / k_norm weights are drawn around qk_gain, not 1: the per-head RMSNorm resets q and k to
    RMS 1 whatever q_proj did, so the gain that makes attention peaky (score std ~ qk_gain^2) has to live
    in the norm weights, as it does in trained Qwen3 checkpoints, whose q/k norm weights are well above 1.
    """
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, dims in weight_names_and_shapes(shape, extra):
        std = _std_for(name, dims, shape, scales)
        w = torch.randn(dims, generator=gen, device=device, dtype=torch.float32) * std
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            w += scales.qk_gain
        elif name.endswith("norm.weight"):
            w += 1.0
        if name.endswith(("embed_tokens.weight", "lm_head.weight")) and quiet_rows:
            w[torch.tensor(quiet_rows, device=device)] *= scales.quiet_row_scale
        tensors[name] = w.to(dtype).contiguous()
    return tensors


def llama_config_dict(
    shape: LlamaShape,
    *,
    max_position_embeddings: int,
    bos_token_id: int | None,
    eos_token_id: int | list[int] | None,
    transformers_version: str,
    rms_norm_eps: float = 1e-5,
    torch_dtype: str = "bfloat16",
) -> dict:
    """config.json in the layout of the Llama 3.2 checkpoints on the Hugging Face Hub.

    transformers 5 itself would write "dtype" and a "rope_parameters" dict that holds rope_theta; we write
    the Hub's classic keys ("torch_dtype", "rope_theta", "rope_scaling") instead, because that is what a
    learner meets in every downloaded Llama 3 checkpoint, and transformers 5 reads them unchanged.
    """
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "hidden_size": shape.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": shape.intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": shape.num_attention_heads,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_key_value_heads": shape.num_key_value_heads,
        "pretraining_tp": 1,
        "rms_norm_eps": rms_norm_eps,
        "rope_scaling": dict(LLAMA3_ROPE_SCALING),
        "rope_theta": LLAMA3_ROPE_THETA,
        "tie_word_embeddings": True,
        "torch_dtype": torch_dtype,
        "transformers_version": transformers_version,
        "use_cache": True,
        "vocab_size": shape.vocab_size,
    }


def write_json(path: Path, obj) -> None:
    """Sorted keys, 2-space indent, trailing newline, UTF-8 kept readable: the same bytes on every run."""
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
