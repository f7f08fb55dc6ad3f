#!/usr/bin/env python3
"""Run Hugging Face transformers on fixed prompts and write the reference outputs every lesson checks
itself against: MODEL_DIR/reference/{activations,generate}.safetensors, manifest.json and, when the
model has a tokenizer, tokenizer_cases.json. weights/README.md documents every tensor.

    python3 weights/tools/make_reference.py MODEL_DIR [--device auto|cpu|cuda] [--max-new-tokens 64]

The model is loaded in fp32 from its stored (bf16) weights with the eager attention implementation, and on
a GPU with TF32 off, so the reference is a plain fp32 computation of the stored model. Any model type
tiny-vllm runs loads (AutoModelForCausalLM: llama, qwen2, qwen3, mistral); the checks below follow each
family's differences (q/k/v and o biases, Qwen3's per-head q/k RMSNorm, Mistral's sliding window). Intermediate
tensors are captured with forward hooks on the modules; the script then recomputes every stage from its
captured inputs in float64 and stops with an error if anything disagrees, so a reference file is never
silently inconsistent.

The model is also run a second time as Hugging Face serves it in bf16 (dtype bfloat16, its default sdpa
attention, same device), and the manifest records how far THAT run is from the fp32 reference: per prompt
("hf_bf16": max and rms |logits_bf16 - logits_fp32|, the final norm's max error, top-1 agreement) and per
generated sequence (the same over the teacher-forced rows of its continuation). That is the bf16 noise
floor of this model: lessons 08 and 10 allow a GPU error of a stated factor times it (a deep random model
amplifies rounding chaotically, so its floor is large; a trained model's is small).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from safetensors_io import weight_checksums  # noqa: E402  (the shared module next to this script)

# ---------------------------------------------------------------------------------------------------------
# Prompts

# p0: a short plain text. p2: as many whole words of LONG_PASSAGE as make more than LONG_MIN_TOKENS tokens
# (so that attention tiles of 64 are crossed whatever the tokenizer). p1: a chat conversation rendered with
# the model's own chat template (or a plain text when the tokenizer has none).
SHORT_TEXT = "The capital of Portugal is"
CHAT_MESSAGES = [{"role": "user", "content": "Give me one tip for baking bread."}]
# Llama 3.2's own template prints today's date unless given one: fix it so the reference is reproducible.
CHAT_TEMPLATE_KWARGS = {"date_string": "26 Jul 2024"}
CHAT_FALLBACK_TEXT = "Question: give me one tip for baking bread.\nAnswer:"
LONG_PASSAGE = (
    "A language model reads a prompt as a sequence of tokens. Each token id selects a row of the embedding "
    "matrix, and the resulting vectors flow through a stack of identical layers. In every layer, attention "
    "lets each position look back at the positions before it, with queries and keys rotated according to "
    "where they sit in the sequence, and a gated feed-forward network then transforms each position on its "
    "own. Residual connections add every result back to the stream that flows past. After the last layer a "
    "final normalisation and a projection onto the vocabulary produce one score for every possible next "
    "token. Greedy decoding picks the highest score, appends it to the sequence and repeats, reusing the "
    "cached keys and values of earlier positions so that each new step only processes one token. Serving "
    "many users at once means batching those steps, scheduling requests as they arrive and finish, and "
    "managing the cache in fixed-size blocks so that memory is never wasted on sequences that end early."
)
LONG_MIN_TOKENS = 100
# Without a tokenizer: seeded random ids, with these lengths (37 and 150 are not multiples of anything
# convenient; 150 crosses two tiles of 64).
RANDOM_PROMPT_LENGTHS = (5, 37, 150)
RANDOM_PROMPT_SEED = 0


@dataclass
class Prompt:
    kind: str               # "text", "chat" or "random"
    ids: list[int]
    text: str | None = None
    messages: list | None = None


def text_prompts(tok) -> list[Prompt]:
    """Three prompts, each starting with exactly one BOS, with different token counts."""
    prompts = [Prompt("text", tok(SHORT_TEXT)["input_ids"], text=SHORT_TEXT)]
    if tok.chat_template:
        # The template writes <|begin_of_text|> itself, so no second BOS from the tokenizer.
        chat = tok.apply_chat_template(CHAT_MESSAGES, tokenize=False, add_generation_prompt=True,
                                       **CHAT_TEMPLATE_KWARGS)
        prompts.append(Prompt("chat", tok(chat, add_special_tokens=False)["input_ids"], text=chat,
                              messages=CHAT_MESSAGES))
    else:
        prompts.append(Prompt("text", tok(CHAT_FALLBACK_TEXT)["input_ids"], text=CHAT_FALLBACK_TEXT))
    words = LONG_PASSAGE.split(" ")
    for n in range(1, len(words) + 1):
        text = " ".join(words[:n])
        ids = tok(text)["input_ids"]
        if len(ids) > LONG_MIN_TOKENS:
            prompts.append(Prompt("text", ids, text=text))
            break
    else:
        raise SystemExit(f"error: LONG_PASSAGE has only {len(ids)} tokens, need > {LONG_MIN_TOKENS}")
    bos = tok.bos_token_id
    for i, p in enumerate(prompts):
        if bos is not None and (p.ids[0] != bos or p.ids.count(bos) != 1):
            raise SystemExit(f"error: prompt {i} should start with exactly one BOS ({bos}): {p.ids[:4]}...")
    return prompts


def random_prompts(vocab_size: int, bos: int | None) -> list[Prompt]:
    """Seeded random ids (BOS first when the model has one), drawn below the first special token when
    the vocabulary is Llama 3's, so the prompt looks like ordinary text to the model."""
    gen = torch.Generator().manual_seed(RANDOM_PROMPT_SEED)
    high = 128000 if vocab_size > 128000 else vocab_size
    prompts = []
    for n in RANDOM_PROMPT_LENGTHS:
        ids = torch.randint(0, high, (n,), generator=gen).tolist()
        if bos is not None:
            ids[0] = bos
        prompts.append(Prompt("random", ids))
    return prompts


# ---------------------------------------------------------------------------------------------------------
# Model loading and capture


def pick_device(requested: str) -> torch.device:
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("error: --device cuda but torch sees no CUDA device")
        # TF32 would round matmul inputs to 10 mantissa bits: the reference must be real fp32.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
    return torch.device(requested)


def load_model(model_dir: Path, device: torch.device, dtype=torch.float32, attn: str = "eager"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attn)
    return model.to(device).eval()


# The bf16 run whose distance from the fp32 reference is the noise floor: Hugging Face as it serves a bf16
# checkpoint (its default attention, sdpa).
BF16_ATTN = "sdpa"


def load_tokenizer(model_dir: Path):
    if not (model_dir / "tokenizer.json").exists():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def captured_layer_indices(num_layers: int) -> list[int]:
    return sorted({0, num_layers - 1})


def _first(x):
    """Decoder layers return a tensor in transformers 5 and a tuple in older versions."""
    return x[0] if isinstance(x, (tuple, list)) else x


class Capture:
    """Forward hooks that record the intermediate tensors of one forward pass, as [T, width] fp32."""

    def __init__(self, model, layers: list[int]):
        self.tensors: dict[str, torch.Tensor] = {}
        self.handles = []
        m = model.model
        self._out(m.embed_tokens, "embed_tokens")
        self._out(m.rotary_emb, "_rope")  # (cos, sin) as used by every attention layer
        self._out(m.norm, "norm")
        for i, layer in enumerate(m.layers):
            self._out(layer, f"layers.{i}.output")
            if i not in layers:
                continue
            p = f"layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            self._out(layer.input_layernorm, p + "input_layernorm")
            self._out(attn.q_proj, p + "q_proj")
            self._out(attn.k_proj, p + "k_proj")
            self._out(attn.v_proj, p + "v_proj")
            if getattr(attn, "q_norm", None) is not None:  # Qwen3: per-head RMSNorm of q and k before RoPE
                self._out(attn.q_norm, p + "q_norm")
                self._out(attn.k_norm, p + "k_norm")
            self._in_out(attn.o_proj, p + "attn", p + "o_proj")
            # The input of post_attention_layernorm is exactly the residual sum HF computed.
            self._in_out(layer.post_attention_layernorm, p + "attn_residual", p + "post_attention_layernorm")
            self._out(mlp.gate_proj, p + "gate_proj")
            self._out(mlp.up_proj, p + "up_proj")
            self._in_out(mlp.down_proj, p + "mlp_act", p + "down_proj")

    def _store(self, name, value):
        if name in self.tensors:
            raise SystemExit(f"error: module for {name} ran twice in one forward pass")
        self.tensors[name] = value

    def _out(self, module, name):
        def hook(mod, args, out):
            if name == "_rope":
                self._store(name, tuple(t.detach() for t in out))
            else:
                self._store(name, _first(out).detach())
        self.handles.append(module.register_forward_hook(hook))

    def _in_out(self, module, in_name, out_name):
        def hook(mod, args, out):
            self._store(in_name, args[0].detach())
            self._store(out_name, _first(out).detach())
        self.handles.append(module.register_forward_hook(hook))

    def remove(self):
        for h in self.handles:
            h.remove()


def config_head_dim(config) -> int:
    """head_dim as the model computes it: explicit where the config has it (Llama, Qwen3, Mistral), else
    hidden_size / num_attention_heads (Qwen2's config class has no head_dim attribute)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rotate_like_hf(q_flat: torch.Tensor, k_flat: torch.Tensor, cos, sin, head_dim: int):
    """q/k after rotary embedding, computed with transformers' own apply_rotary_pos_emb on HF's cos/sin,
    returned in the [T, heads*head_dim] layout of q_proj's output."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    t = q_flat.shape[0]
    q = q_flat.view(1, t, -1, head_dim).transpose(1, 2)  # [1, heads, T, head_dim]
    k = k_flat.view(1, t, -1, head_dim).transpose(1, 2)  # [1, kv_heads, T, head_dim]
    q_rot, k_rot = apply_rotary_pos_emb(q, k, cos, sin)
    return (q_rot.transpose(1, 2).reshape(t, -1).contiguous(),
            k_rot.transpose(1, 2).reshape(t, -1).contiguous())


def run_prompt(model, ids: list[int], layers: list[int], device) -> dict[str, torch.Tensor]:
    """One forward pass over one prompt; returns the contract's tensors (names without the p{i}. prefix)."""
    cap = Capture(model, layers)
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)
    try:
        with torch.no_grad():
            logits = model(input_ids=input_ids, use_cache=False).logits
    finally:
        cap.remove()
    t = len(ids)
    cos, sin = cap.tensors.pop("_rope")
    out = {"input_ids": torch.tensor(ids, dtype=torch.int32),
           "positions": torch.arange(t, dtype=torch.int32)}
    for name, value in cap.tensors.items():
        out[name] = value.reshape(t, -1)
    head_dim = config_head_dim(model.config)
    with torch.no_grad():
        for l in layers:
            p = f"layers.{l}."
            q, k = (p + "q_norm", p + "k_norm") if p + "q_norm" in out else (p + "q_proj", p + "k_proj")
            out[p + "q_rope"], out[p + "k_rope"] = rotate_like_hf(out[q], out[k], cos, sin, head_dim)
    out["logits"] = logits.reshape(t, -1)
    out = {k: v.float().cpu().contiguous() if v.is_floating_point() else v.cpu().contiguous()
           for k, v in out.items()}
    out["_cos"], out["_sin"] = cos[0].float().cpu(), sin[0].float().cpu()  # for the consistency check
    return out


def rope_tables(model, max_t: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's cos/sin for positions 0..max_t-1 ([max_t, head_dim], Llama 3 scaling applied)."""
    positions = torch.arange(max_t, device=device)[None, :]
    dummy = torch.zeros(1, device=device, dtype=torch.float32)  # only its dtype/device are used
    with torch.no_grad():
        cos, sin = model.model.rotary_emb(dummy, positions)
    return cos[0].float().cpu().contiguous(), sin[0].float().cpu().contiguous()


def forward_logits_norm(model, ids: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, vocab] and the final norm's output [T, hidden] of one forward pass, as fp32 on the host."""
    captured = {}
    handle = model.model.norm.register_forward_hook(lambda mod, args, out: captured.update(norm=_first(out)))
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids], dtype=torch.long, device=device), use_cache=False).logits
    finally:
        handle.remove()
    t = len(ids)
    return logits.reshape(t, -1).float().cpu(), captured["norm"].reshape(t, -1).float().cpu()


def noise_floor(bf16: torch.Tensor, fp32: torch.Tensor) -> dict:
    """How far Hugging Face's bf16 logits [T, vocab] are from its fp32 ones: max and rms |difference|, the rms
    of the fp32 logits (for scale) and the top-1 agreement over the rows."""
    diff = (bf16.double() - fp32.double()).abs()
    agree = int((bf16.argmax(-1) == fp32.argmax(-1)).sum())
    return {"logits_max_abs_error": round(float(diff.max()), 6),
            "logits_rms_error": round(float(diff.pow(2).mean().sqrt()), 6),
            "logits_rms": round(float(fp32.double().pow(2).mean().sqrt()), 6),
            "top1_agree": agree, "rows": int(fp32.shape[0])}


def greedy_generate(model, ids: list[int], max_new_tokens: int, eos_ids: list[int], device):
    """model.generate, greedy: the new tokens only (it stops early at an EOS id, which is then included)
    and the smallest top1-top2 logit gap over the steps (how close greedy came to a different choice)."""
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False, temperature=None, top_p=None, top_k=None,  # the model's defaults may sample
            eos_token_id=eos_ids or None,
            pad_token_id=eos_ids[0] if eos_ids else 0,
            return_dict_in_generate=True, output_scores=True,
        )
    top2 = torch.cat(out.scores).float().topk(2, dim=-1).values  # [steps, 2]
    return out.sequences[0, len(ids):].tolist(), float((top2[:, 0] - top2[:, 1]).min())


# ---------------------------------------------------------------------------------------------------------
# Consistency checks: recompute each stage from its captured inputs in float64.

# fp32 matmuls over a few thousand terms agree with float64 to ~1e-6 relative; 1e-4 leaves room for the
# accumulation order of any BLAS while still catching a wrong tensor (which is off by O(1)).
REL_TOL = 1e-4


class ConsistencyError(Exception):
    pass


def check_close(what: str, got: torch.Tensor, want: torch.Tensor, rel: float = REL_TOL) -> float:
    if got.shape != want.shape:
        raise ConsistencyError(f"{what}: shape {tuple(got.shape)} != expected {tuple(want.shape)}")
    scale = max(want.abs().max().item(), 1e-6)
    err = (got.double() - want.double()).abs().max().item() / scale
    if not err <= rel:  # also catches NaN
        raise ConsistencyError(f"{what}: max error {err:.3e} of max |value| {scale:.3e} exceeds {rel:.0e}")
    return err


def rmsnorm64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def attention64(q, k, v, heads: int, kv_heads: int, head_dim: int, window: int | None = None) -> torch.Tensor:
    """Causal grouped-query attention, [T, heads*head_dim] in and out. window (Mistral's sliding_window W):
    position i sees only positions j with i - W < j <= i, transformers' sliding_window_overlay."""
    t = q.shape[0]
    q = q.double().view(t, heads, head_dim).transpose(0, 1)       # [heads, T, d]
    k = k.double().view(t, kv_heads, head_dim).transpose(0, 1)    # [kv_heads, T, d]
    v = v.double().view(t, kv_heads, head_dim).transpose(0, 1)
    group = heads // kv_heads
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    scores = q @ k.transpose(1, 2) / head_dim ** 0.5
    mask = torch.ones(t, t, dtype=torch.bool).triu(1)
    if window is not None:
        mask |= torch.ones(t, t, dtype=torch.bool).tril(-window)  # j <= i - W: out of the window
    probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
    return (probs @ v).transpose(0, 1).reshape(t, heads * head_dim)


def llama3_inv_freq64(config) -> torch.Tensor:
    """Llama 3 rope frequencies, written out independently of transformers, for checking its tables."""
    d = config_head_dim(config)
    rs = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    theta = rs.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    if rs.get("rope_type", "default") != "llama3":
        return inv
    factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    wavelen = 2 * torch.pi / inv
    smooth = (old / wavelen - lo) / (hi - lo)
    mid = (1 - smooth) * inv / factor + smooth * inv
    out = torch.where(wavelen > old / lo, inv / factor, inv)  # long wavelengths: slowed down by factor
    is_mid = (wavelen >= old / hi) & (wavelen <= old / lo)
    return torch.where(is_mid, mid, out)


# HF computes the rope angle position * inv_freq in fp32: ~1 ulp of the angle (1.5e-5 at position 200)
# plus the rounding of inv_freq itself. Unscaled frequencies differ by ~1e-2 at position 100.
ROPE_ABS_TOL = 5e-5


def check_rope(what: str, cos: torch.Tensor, sin: torch.Tensor, config) -> None:
    """cos/sin [T, head_dim] for positions 0..T-1 against an independent Llama 3 frequency formula."""
    angles = torch.arange(cos.shape[0], dtype=torch.float64)[:, None] * llama3_inv_freq64(config)
    angles = torch.cat([angles, angles], -1)  # HF's layout: the head_dim/2 frequencies twice
    check_close(what + " cos", cos, angles.cos(), ROPE_ABS_TOL)  # |cos| peaks at 1: relative == absolute
    check_close(what + " sin", sin, angles.sin(), ROPE_ABS_TOL)


def check_layer(acts: dict, weights: dict, config, l: int, h: torch.Tensor) -> None:
    """One captured decoder layer, stage by stage; h is the layer's input [T, hidden]."""
    p, wp, eps = f"layers.{l}.", f"model.layers.{l}.", config.rms_norm_eps

    def a(name):  # a captured tensor of this layer, in float64
        return acts[p + name].double()

    def linear(x_name, weight_name):  # y = x W^T (+ b when the checkpoint has the bias)
        y = a(x_name) @ weights[wp + weight_name].double().T
        bias = weights.get(wp + weight_name.removesuffix("weight") + "bias")
        return y if bias is None else y + bias.double()

    check_close(p + "input_layernorm", acts[p + "input_layernorm"],
                rmsnorm64(h, weights[wp + "input_layernorm.weight"], eps))
    for proj in ("q_proj", "k_proj", "v_proj"):
        check_close(p + proj, acts[p + proj], linear("input_layernorm", f"self_attn.{proj}.weight"))
    t, d = h.shape[0], config_head_dim(config)
    for norm, proj in (("q_norm", "q_proj"), ("k_norm", "k_proj")):  # Qwen3: RMSNorm over each head's D
        if p + norm in acts:
            per_head = rmsnorm64(acts[p + proj].view(t, -1, d), weights[wp + f"self_attn.{norm}.weight"], eps)
            check_close(p + norm, acts[p + norm], per_head.reshape(t, -1))
    window = getattr(config, "sliding_window", None) if config.model_type == "mistral" else None
    attn = attention64(acts[p + "q_rope"], acts[p + "k_rope"], acts[p + "v_proj"],
                       config.num_attention_heads, config.num_key_value_heads, d, window)
    check_close(p + "attn (recomputed from q_rope, k_rope, v_proj" + (f", window {window})" if window else ")"),
                acts[p + "attn"], attn)
    check_close(p + "o_proj", acts[p + "o_proj"], linear("attn", "self_attn.o_proj.weight"))
    check_close(p + "attn_residual", acts[p + "attn_residual"], h.double() + a("o_proj"), 1e-6)
    check_close(p + "post_attention_layernorm", acts[p + "post_attention_layernorm"],
                rmsnorm64(acts[p + "attn_residual"], weights[wp + "post_attention_layernorm.weight"], eps))
    for proj in ("gate_proj", "up_proj"):
        check_close(p + proj, acts[p + proj], linear("post_attention_layernorm", f"mlp.{proj}.weight"))
    check_close(p + "mlp_act", acts[p + "mlp_act"], torch.nn.functional.silu(a("gate_proj")) * a("up_proj"))
    check_close(p + "down_proj", acts[p + "down_proj"], linear("mlp_act", "mlp.down_proj.weight"))
    check_close(p + "output", acts[p + "output"], a("attn_residual") + a("down_proj"), 1e-6)


def check_prompt(acts: dict, weights: dict, config, layers: list[int]) -> None:
    """Every captured tensor must follow from the previous ones exactly as the Llama forward pass says."""
    ids = acts["input_ids"].long()
    embed = weights["model.embed_tokens.weight"]
    check_close("embed_tokens == E[ids]", acts["embed_tokens"], embed[ids], 0.0)
    check_close("positions", acts["positions"].double(), torch.arange(len(ids)).double(), 0.0)
    check_rope("the prompt's rope", acts["_cos"], acts["_sin"], config)
    h = acts["embed_tokens"]
    for l in range(config.num_hidden_layers):
        if l in layers:
            check_layer(acts, weights, config, l, h)
        h = acts[f"layers.{l}.output"]
    check_close("norm", acts["norm"], rmsnorm64(h, weights["model.norm.weight"], config.rms_norm_eps))
    head = weights.get("lm_head.weight", embed)
    check_close("logits", acts["logits"], acts["norm"].double() @ head.double().T)


# ---------------------------------------------------------------------------------------------------------
# Weight checksums: safetensors_io.weight_checksums (FNV-1a 64 of each stored tensor; lesson 01 checks them).


# ---------------------------------------------------------------------------------------------------------
# Tokenizer cases

TOKENIZER_CASES = [
    ("ascii_sentence", "Hello world! This is a simple sentence."),
    ("corpus_sentence", "The tomatoes have finally turned red, all at once."),
    ("leading_space", " hello"),
    ("empty", ""),
    ("whitespace_runs", "a  b   c    d\t\te  \t f"),
    ("trailing_spaces", "ends with spaces   "),
    ("only_whitespace", "   \n  \t "),
    ("newlines", "line one\nline two\n\nline four\r\nwindows line\n\n\n   indented\n"),
    ("digits", "1 12 123 1234 12345 3.14159 2024-03-15 1,000,000 007"),
    ("contractions", "I'm sure it's fine, they'll know we've done what you'd want. DON'T, IT'S, We'Re."),
    ("punctuation", "Wait... what?! (yes) [no] {maybe} <tag> \"quoted\" 'single' #hash @at $5 100% a/b\\c"),
    ("code", "def f(x):\n    return x * 2  # double it\n\nprint(f(21))\n"),
    ("accents", "Café naïve façade jalapeño Zoë Dvořák Straße crème brûlée"),
    ("cjk", "你好，世界。今天天气很好。日本語のテキストです。안녕하세요"),
    ("emoji", "Great job 🎉🚀 family 👨‍👩‍👧‍👦 thumbs 👍🏽 flag 🇵🇹"),
    ("mixed_scripts", "Доброе утро, Καλημέρα, مرحبا, नमस्ते, Dzień dobry"),
    ("rare_words", "Zyzzyva quixotic xylophone supercalifragilisticexpialidocious"),
    ("special_tokens_in_text",
     "<|begin_of_text|>Hello<|eot_id|> and <|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"),
    ("almost_special", "<|not_a_special_token|> <|eot_id| <|eot_id|>x <|EOT_ID|>"),
]
CHAT_CASE_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 17 times 23?"},
    {"role": "assistant", "content": "  391.  "},
    {"role": "user", "content": "And in hex?"},
]


def tokenizer_cases(tok) -> dict:
    cases = []
    for name, text in TOKENIZER_CASES:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if tok.decode(ids) != text:  # byte-level BPE must round-trip every string exactly
            raise SystemExit(f"error: tokenizer case {name}: decode(encode(text)) != text")
        cases.append({"name": name, "text": text, "ids": ids})
    if tok.chat_template:
        import jinja2

        messages = CHAT_CASE_MESSAGES
        try:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                           **CHAT_TEMPLATE_KWARGS)
        except jinja2.exceptions.TemplateError:  # Mistral v0.1's template refuses a system message
            messages = [m for m in messages if m["role"] != "system"]
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                           **CHAT_TEMPLATE_KWARGS)
        case = {"name": "chat_template", "messages": messages, "add_generation_prompt": True,
                "text": text, "ids": tok(text, add_special_tokens=False)["input_ids"]}
        # A SentencePiece tokenizer (Mistral's) does not give the template's text back: its decoder puts a
        # space before a word that follows a special token. What Hugging Face decodes is then the answer.
        decoded = tok.decode(case["ids"])
        if decoded != text:
            case["decoded"] = decoded
        cases.append(case)
    return {
        "add_special_tokens": False,
        "bos_token": tok.bos_token, "bos_token_id": tok.bos_token_id,
        "eos_token": tok.eos_token, "eos_token_id": tok.eos_token_id,
        "vocab_size": len(tok),
        "cases": cases,
    }


# ---------------------------------------------------------------------------------------------------------
# Output


@dataclass
class Results:
    activations: dict[str, torch.Tensor] = field(default_factory=dict)  # activations.safetensors
    generate: dict[str, torch.Tensor] = field(default_factory=dict)     # generate.safetensors
    prompts: list[dict] = field(default_factory=list)                   # manifest "prompts"
    sequences: list[dict] = field(default_factory=list)                 # manifest "generate.sequences"


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def versions() -> dict:
    import safetensors
    import transformers

    v = {"python": platform.python_version(), "torch": torch.__version__,
         "transformers": transformers.__version__, "safetensors": safetensors.__version__}
    try:
        import tokenizers

        v["tokenizers"] = tokenizers.__version__
    except ImportError:
        pass
    return v


def device_description(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)}, TF32 off)"
    return f"cpu ({platform.machine()})"


def min_margin(logits: torch.Tensor) -> float:
    """Smallest top1 - top2 gap over the rows of logits [T, vocab]."""
    top2 = logits.float().topk(2, dim=-1).values
    return round(float((top2[:, 0] - top2[:, 1]).min()), 6)


@dataclass
class Run:
    """Everything one reference run needs, loaded once."""
    model: object
    tok: object                   # None without tokenizer.json
    device: torch.device
    layers: list[int]             # captured layers
    eos_ids: list[int]
    weights: dict                 # fp32 copies of the stored weights, for the consistency checks
    max_new_tokens: int
    bf16_model: object            # the same checkpoint in bf16 (BF16_ATTN): the noise floor's run


def process_prompt(run: Run, i: int, prompt: Prompt, res: Results) -> None:
    """Capture, check and generate for prompt i; add its tensors and manifest entries to res."""
    acts = run_prompt(run.model, prompt.ids, run.layers, run.device)
    try:
        check_prompt(acts, run.weights, run.model.config, run.layers)
    except ConsistencyError as e:
        raise SystemExit(f"error: prompt p{i}: captured tensors are inconsistent: {e}")
    new, gen_margin = greedy_generate(run.model, prompt.ids, run.max_new_tokens, run.eos_ids, run.device)
    top1 = int(acts["logits"][-1].argmax())
    if new[0] != top1:
        raise SystemExit(f"error: prompt p{i}: generate's first token {new[0]} != argmax of the last logits {top1}")
    # The bf16 noise floor: the prompt's logits and final norm, then the continuation's rows teacher-forced
    # (prompt + new[:-1] in one pass; row P-1+j predicts new[j]), each bf16 vs fp32.
    bf16_logits, bf16_norm = forward_logits_norm(run.bf16_model, prompt.ids, run.device)
    prompt_floor = noise_floor(bf16_logits, acts["logits"])
    prompt_floor["norm_max_abs_error"] = round(float((bf16_norm.double() - acts["norm"].double()).abs().max()), 6)
    forced = prompt.ids + new[:-1]
    rows = slice(len(prompt.ids) - 1, len(forced))
    fp32_forced, _ = forward_logits_norm(run.model, forced, run.device)
    bf16_forced, _ = forward_logits_norm(run.bf16_model, forced, run.device)
    seq_floor = noise_floor(bf16_forced[rows], fp32_forced[rows])
    del acts["_cos"], acts["_sin"]  # checked above; the file holds the full tables instead
    res.activations.update({f"p{i}.{k}": v for k, v in acts.items()})
    res.generate[f"g{i}.prompt_ids"] = torch.tensor(prompt.ids, dtype=torch.int32)
    res.generate[f"g{i}.output_ids"] = torch.tensor(new, dtype=torch.int32)

    info = {"name": f"p{i}", "kind": prompt.kind, "num_tokens": len(prompt.ids), "ids": prompt.ids,
            "min_top1_margin": min_margin(acts["logits"]), "hf_bf16": prompt_floor}
    if prompt.text is not None:
        info["text"] = prompt.text
    if prompt.messages is not None:
        info["messages"] = prompt.messages
    res.prompts.append(info)
    seq = {"name": f"g{i}", "prompt": f"p{i}", "prompt_ids": prompt.ids, "output_ids": new,
           "stopped_at_eos": bool(new[-1] in run.eos_ids),  # HF keeps the EOS it stopped on
           "min_top1_margin": round(gen_margin, 6), "hf_bf16": seq_floor}
    if run.tok is not None:
        seq["output_text"] = run.tok.decode(new)
    res.sequences.append(seq)
    print(f"p{i}: {len(prompt.ids)} tokens ({prompt.kind}), consistent; g{i}: {len(new)} new tokens")
    for name, f in ((f"p{i}", prompt_floor), (f"g{i}", seq_floor)):
        print(f"  {name} HF bf16 vs fp32: max |logit err| {f['logits_max_abs_error']:.4g} = "
              f"{f['logits_max_abs_error'] / max(f['logits_rms'], 1e-30):.3f} x rms {f['logits_rms']:.4g}, "
              f"top-1 agree {f['top1_agree']}/{f['rows']}")


def add_rope_tables(run: Run, prompts: list[Prompt], res: Results) -> int:
    """rope.cos / rope.sin for every position a prompt or its continuation uses; returns max_T."""
    max_t = max(len(p.ids) for p in prompts) + run.max_new_tokens
    cos, sin = rope_tables(run.model, max_t, run.device)
    try:
        check_rope("rope table", cos, sin, run.model.config)
    except ConsistencyError as e:
        raise SystemExit(f"error: {e}")
    res.activations["rope.cos"], res.activations["rope.sin"] = cos, sin
    return max_t


def write_outputs(run: Run, model_dir: Path, res: Results, max_t: int) -> Path:
    from safetensors.torch import save_file

    out = model_dir / "reference"
    out.mkdir(exist_ok=True)
    # Only one metadata key: safetensors writes the metadata map in hash order, so with two keys the
    # header bytes (and the file's checksum) would change from run to run.
    for name, tensors in (("activations", res.activations), ("generate", res.generate)):
        save_file(tensors, str(out / f"{name}.safetensors"), metadata={"format": "pt"})
        (out / f"{name}.safetensors").chmod(0o644)  # save_file creates it private (0600)
    if run.tok is not None:
        write_json(out / "tokenizer_cases.json", tokenizer_cases(run.tok))
    manifest = {
        "producer": "weights/tools/make_reference.py",
        "versions": versions(),
        "device": device_description(run.device),
        "compute_dtype": "float32",
        "attn_implementation": "eager",
        # The noise floor's run: per prompt and per sequence "hf_bf16" (lessons 08 and 10 read it).
        "hf_bf16": {"dtype": "bfloat16", "attn_implementation": BF16_ATTN, "device": device_description(run.device)},
        "model_type": run.model.config.model_type,
        "num_hidden_layers": run.model.config.num_hidden_layers,
        "captured_layers": run.layers,
        "prompts": res.prompts,
        "rope_table_positions": max_t,
        "generate": {"max_new_tokens": run.max_new_tokens, "greedy": True, "eos_token_ids": run.eos_ids,
                     "sequences": res.sequences},
        "consistency_rel_tol": REL_TOL,
        "weights": weight_checksums(model_dir),
    }
    write_json(out / "manifest.json", manifest)
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", type=Path, help="model directory (config.json + safetensors [+ tokenizer])")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                    help="where to run (auto: cuda when available)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="greedy tokens generated per prompt")
    args = ap.parse_args()
    if not (args.model_dir / "config.json").is_file():
        ap.error(f"{args.model_dir}/config.json not found")
    if args.max_new_tokens < 1:
        ap.error("--max-new-tokens must be >= 1")
    return args


def main() -> int:
    args = parse_args()
    torch.manual_seed(0)
    device = pick_device(args.device)
    model = load_model(args.model_dir, device)
    eos = model.generation_config.eos_token_id
    run = Run(
        model=model,
        tok=load_tokenizer(args.model_dir),
        device=device,
        layers=captured_layer_indices(model.config.num_hidden_layers),
        eos_ids=[eos] if isinstance(eos, int) else list(eos or []),
        weights={k: v.detach().float().cpu() for k, v in model.state_dict().items()},
        max_new_tokens=args.max_new_tokens,
        bf16_model=load_model(args.model_dir, device, torch.bfloat16, BF16_ATTN),
    )
    if run.tok is not None:
        prompts = text_prompts(run.tok)
    else:
        prompts = random_prompts(model.config.vocab_size, model.config.bos_token_id)
    res = Results()
    for i, prompt in enumerate(prompts):
        process_prompt(run, i, prompt, res)
    max_t = add_rope_tables(run, prompts, res)
    out = write_outputs(run, args.model_dir, res, max_t)
    print(f"wrote {out}: {len(res.activations)} activation tensors, {len(res.generate)} generate tensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
