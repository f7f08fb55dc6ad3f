#!/usr/bin/env python3
"""Lesson 08: the GPU path's bf16 roundings replayed in numpy, to see how far bf16 logits drift from fp32.

  python3 lessons/08_transformer/emulate_bf16.py [MODEL_DIR]      (default: weights/tiny-llama3)

Runs every reference prompt of MODEL_DIR/reference twice through a plain numpy Llama forward: once in fp32
(it must match the reference's logits to ~1e-4: the emulation itself is right) and once rounding to bf16
wherever the GPU kernels round (every op's output; RMSNorm's two roundings; attention's P before P V;
SiLU·mul's act then product; the residual stream on every add; logits in fp32). Prints, per prompt, the
max |logit error| and its spread per rms(logits), the argmax flips and their margins, and how many positions
have a top-1/top-2 margin above a few thresholds: where lesson 08's kGpuLogitErrorPerRms and
kGpuClearMarginPerRms (logits_check.h) come from. Needs numpy only; slow for big models (plain numpy).
"""
import json
import struct
import sys
from pathlib import Path

import numpy as np


def load_safetensors(path):
    raw = Path(path).read_bytes()
    n = struct.unpack('<Q', raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, e in header.items():
        if name == '__metadata__':
            continue
        a, b = e['data_offsets']
        data = raw[8 + n + a:8 + n + b]
        if e['dtype'] == 'BF16':
            arr = (np.frombuffer(data, np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif e['dtype'] == 'F16':
            arr = np.frombuffer(data, np.float16).astype(np.float32)
        elif e['dtype'] == 'F32':
            arr = np.frombuffer(data, np.float32)
        elif e['dtype'] == 'I32':
            arr = np.frombuffer(data, np.int32)
        else:
            raise SystemExit(f'{path}: {name} has dtype {e["dtype"]}')
        out[name] = arr.reshape(e['shape'])
    return out


def bf(x):
    """Round fp32 to bf16 (nearest even), returned as fp32."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7fff + ((u >> 16) & 1)) >> 16
    return (u.astype(np.uint32) << 16).view(np.float32)


class Model:
    def __init__(self, d):
        self.c = json.loads((d / 'config.json').read_text())
        files = sorted(d.glob('*.safetensors'))
        self.w = {}
        for f in files:
            self.w.update(load_safetensors(f))
        c = self.c
        self.H, self.nh, self.nkv = c['hidden_size'], c['num_attention_heads'], c['num_key_value_heads']
        self.hd = c.get('head_dim') or self.H // self.nh
        self.eps, self.L = c['rms_norm_eps'], c['num_hidden_layers']

    def weight(self, name, emulate):
        w = self.w[name]
        return bf(w) if emulate else w  # the GPU holds bf16 weights (exact for a BF16 checkpoint)

    def forward(self, ids, cos, sin, emulate):
        r = bf if emulate else (lambda v: v)
        W = lambda n: self.weight(n, emulate)  # noqa: E731
        hd, nh, nkv = self.hd, self.nh, self.nkv

        def rms(x, w):
            inv = 1 / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + self.eps)
            n = (x * inv).astype(np.float32)
            return r(r(n) * w)  # Hugging Face: normalise, round, times the weight, round

        def lin(x, w):
            return r((x.astype(np.float64) @ w.astype(np.float64).T).astype(np.float32))

        def rope(x, heads):
            x = x.reshape(len(ids), heads, hd)
            half = hd // 2
            rot = np.concatenate([-x[..., half:], x[..., :half]], -1)
            return r((x * cos[:, None, :] + rot * sin[:, None, :]).astype(np.float32).reshape(len(ids), heads * hd))

        def attention(q, k, v):
            T, g = len(ids), nh // nkv
            q, k, v = q.reshape(T, nh, hd), k.reshape(T, nkv, hd), v.reshape(T, nkv, hd)
            out = np.zeros((T, nh, hd), np.float32)
            for h in range(nh):
                s = (q[:, h] @ k[:, h // g].T) / np.sqrt(hd)
                s[np.triu_indices(T, 1)] = -np.inf
                p = np.exp(s - s.max(-1, keepdims=True))
                l = p.sum(-1, keepdims=True)
                out[:, h] = (r(p) @ v[:, h // g]) / l  # the flash kernel rounds P to bf16 before P V
            return r(out.reshape(T, nh * hd))

        x = W('model.embed_tokens.weight')[ids]
        for layer in range(self.L):
            p = f'model.layers.{layer}.'
            n = rms(x, W(p + 'input_layernorm.weight'))
            q = rope(lin(n, W(p + 'self_attn.q_proj.weight')), nh)
            k = rope(lin(n, W(p + 'self_attn.k_proj.weight')), nkv)
            v = lin(n, W(p + 'self_attn.v_proj.weight'))
            x = r(x + lin(attention(q, k, v), W(p + 'self_attn.o_proj.weight')))
            n = rms(x, W(p + 'post_attention_layernorm.weight'))
            g, u = lin(n, W(p + 'mlp.gate_proj.weight')), lin(n, W(p + 'mlp.up_proj.weight'))
            act = r(r((g / (1 + np.exp(-g.astype(np.float64)))).astype(np.float32)) * u)
            x = r(x + lin(act, W(p + 'mlp.down_proj.weight')))
        n = rms(x, W('model.norm.weight'))
        head = W('lm_head.weight') if 'lm_head.weight' in self.w and not self.c.get('tie_word_embeddings') \
            else W('model.embed_tokens.weight')
        return n, (n.astype(np.float64) @ head.astype(np.float64).T).astype(np.float32)  # logits in fp32


def main():
    d = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[2] / 'weights' / 'tiny-llama3')
    model = Model(d)
    ref = load_safetensors(d / 'reference' / 'activations.safetensors')
    thresholds = (0.1, 0.2, 0.3, 0.4, 0.5)
    i = 0
    while f'p{i}.input_ids' in ref:
        ids, want = ref[f'p{i}.input_ids'], ref[f'p{i}.logits']
        cos, sin = ref['rope.cos'][ref[f'p{i}.positions']], ref['rope.sin'][ref[f'p{i}.positions']]
        _, l32 = model.forward(ids, cos, sin, emulate=False)
        n16, l16 = model.forward(ids, cos, sin, emulate=True)
        rms = float(np.sqrt((want.astype(np.float64) ** 2).mean()))
        err = l16 - want
        top = np.sort(want, 1)
        margin = (top[:, -1] - top[:, -2]) / rms
        flips = l16.argmax(1) != want.argmax(1)
        norm = ref[f'p{i}.norm']
        print(f'p{i} ({len(ids)} tokens, rms(logits) {rms:.2f}): fp32 emulation max |err| {np.abs(l32 - want).max():.1e}')
        print(f'  bf16: max |logit err| {np.abs(err).max() / rms:.3f} x rms, std {err.std() / rms:.3f} x rms; '
              f'final norm max |err| {np.abs(n16 - norm).max() / np.abs(norm).max():.3f} x max|norm|')
        print(f'  argmax flips at {flips.sum()}/{len(ids)} positions, margins (x rms) {[round(float(m), 3) for m in margin[flips]]}')
        print('  positions with margin above t x rms: ' +
              ', '.join(f't={t}: {(margin > t).sum()}' for t in thresholds))
        i += 1


if __name__ == '__main__':
    main()
