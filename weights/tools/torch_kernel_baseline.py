#!/usr/bin/env python3
"""PyTorch's own kernels on the shapes our lessons benchmark, timed the same way, on the same GPU.

Every lesson's --bench prints our kernels against the measured copy bandwidth / GEMM rate; this prints
what PyTorch (and Hugging Face's Llama code) achieves on identical shapes, so the ratio is measured in
one run. Method as in common/bench.cu: warm-up, L2 flushed before each run (a 2 x L2 memset), CUDA
events around each run, median.

    python3 weights/tools/torch_kernel_baseline.py [--tokens 16384] [--hidden 2048] ...
"""
import argparse
import statistics

import torch
import torch.nn.functional as F


def bench(fn, iters=20, warmup=3, flush=True):
    scratch = torch.empty(2 * 64 * 1024 * 1024, dtype=torch.uint8, device="cuda")  # 128 MiB > 2 x 60 MB L2
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if flush:
            scratch.zero_()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def row(name, ms, nbytes=0.0, flops=0.0, copy_gbs=1.0, gemm_tflops=1.0):
    gbs = nbytes / (ms * 1e-3) / 1e9 if nbytes else 0.0
    tflops = flops / (ms * 1e-3) / 1e12 if flops else 0.0
    print(f"{name:<40} {ms:10.4f} {gbs:10.1f} {100 * gbs / copy_gbs:7.1f}% {tflops:10.1f} {100 * tflops / gemm_tflops:7.1f}%")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--gemm-tokens", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=8192)
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    dev, bf16 = "cuda", torch.bfloat16
    T, H = args.tokens, args.hidden
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}")

    # Ceilings, measured the same way as common/bench.cu
    src = torch.ones(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_gbs = 2 * src.numel() / (bench(lambda: dst.copy_(src), flush=False) * 1e-3) / 1e9
    del src, dst
    n = 8192
    a = torch.rand(n, n, device=dev, dtype=bf16) - 0.5
    b = torch.rand(n, n, device=dev, dtype=bf16) - 0.5
    gemm_tflops = 2 * n**3 / (bench(lambda: a @ b, flush=False, iters=10) * 1e-3) / 1e12
    del a, b
    print(f"ceilings: copy {copy_gbs:.0f} GB/s, bf16 GEMM {gemm_tflops:.0f} TFLOP/s (8192^3)")
    print(f"{'pytorch op':<40} {'median ms':>10} {'GB/s':>10} {'%copy':>8} {'TFLOP/s':>10} {'%gemm':>8}")
    r = lambda *a, **k: row(*a, **k, copy_gbs=copy_gbs, gemm_tflops=gemm_tflops)

    # Embedding gather (lesson 03): read T rows, write T rows
    table = torch.randn(args.vocab, H, device=dev, dtype=bf16)
    ids = torch.randint(0, args.vocab, (T,), device=dev)
    r(f"F.embedding [{T} x {H}]", bench(lambda: F.embedding(ids, table)), 2 * T * H * 2)
    del table

    # RMSNorm (lesson 04): read x, write out
    x = torch.randn(T, H, device=dev, dtype=bf16)
    w = torch.randn(H, device=dev, dtype=bf16)
    r(f"F.rms_norm [{T} x {H}]", bench(lambda: F.rms_norm(x, (H,), w, 1e-5)), 2 * T * H * 2)

    def hf_rmsnorm(h):  # Hugging Face LlamaRMSNorm.forward
        hf = h.to(torch.float32)
        hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5)
        return w * hf.to(h.dtype)

    r(f"HF LlamaRMSNorm [{T} x {H}]", bench(lambda: hf_rmsnorm(x)), 2 * T * H * 2)
    r(f"elementwise x * 2 [{T} x {H}]", bench(lambda: x * 2), 2 * T * H * 2)
    del x

    # RoPE (lesson 05): q [T, heads, d], k [T, kv, d], rotate-half as in HF's apply_rotary_pos_emb
    d = args.head_dim
    q = torch.randn(1, args.heads, T, d, device=dev, dtype=bf16)
    k = torch.randn(1, args.kv_heads, T, d, device=dev, dtype=bf16)
    cos = torch.randn(1, 1, T, d, device=dev, dtype=bf16)
    sin = torch.randn(1, 1, T, d, device=dev, dtype=bf16)

    def rotate_half(t):
        return torch.cat((-t[..., d // 2:], t[..., : d // 2]), dim=-1)

    def hf_rope():
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    qk_bytes = 2 * (args.heads + args.kv_heads) * T * d * 2
    r(f"HF apply_rotary_pos_emb [{T} tok]", bench(hf_rope), qk_bytes)
    del q, k, cos, sin

    # Linear (lesson 06): x [Tg, H] @ W^T, W [inter, H]
    Tg, N = args.gemm_tokens, args.intermediate
    xg = torch.randn(Tg, H, device=dev, dtype=bf16)
    wg = torch.randn(N, H, device=dev, dtype=bf16)
    r(f"F.linear {Tg}x{H} by {H}x{N}", bench(lambda: F.linear(xg, wg)), 0, 2.0 * Tg * H * N)
    x1 = torch.randn(1, H, device=dev, dtype=bf16)
    r(f"F.linear decode 1x{H} by {H}x{N}", bench(lambda: F.linear(x1, wg)), N * H * 2)
    del xg, wg

    # Attention (lessons 07 and 15): causal GQA via SDPA (flash backend), one sequence per length, at the
    # model's head_dim and at 128 (lesson 15's second tile width). FLOPs as lesson 07 and lesson 15 count
    # them: n (n + 1) / 2 visible (query, key) pairs, 4 * head_dim each (QK^T and PV), in every head.
    for hd in dict.fromkeys((d, 128)):
        tag = "" if hd == d else f" d={hd}"
        for n_tok in (512, 1024, 2048, 4096, 8192, 16384):
            qa = torch.randn(1, args.heads, n_tok, hd, device=dev, dtype=bf16)
            ka = torch.randn(1, args.kv_heads, n_tok, hd, device=dev, dtype=bf16)
            va = torch.randn(1, args.kv_heads, n_tok, hd, device=dev, dtype=bf16)
            fn = lambda: F.scaled_dot_product_attention(qa, ka, va, is_causal=True, enable_gqa=True)
            flops = 4.0 * args.heads * hd * n_tok * (n_tok + 1) / 2
            r(f"SDPA causal GQA{tag} n={n_tok}", bench(fn), 0, flops)
            del qa, ka, va


if __name__ == "__main__":
    main()
