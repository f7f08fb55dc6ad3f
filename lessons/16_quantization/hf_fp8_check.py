#!/usr/bin/env python3
"""Lesson 16: does Hugging Face read what `tiny-vllm quantize` writes, and does it compute the same thing?

    build/bin/tiny-vllm quantize --model weights/tiny-llama3 --out /tmp/tiny-fp8
    python3 lessons/16_quantization/hf_fp8_check.py --fp8 /tmp/tiny-fp8 --bf16 weights/tiny-llama3 \
        --tiny-vllm build/bin/tiny-vllm

Checks, each printed PASS/FAIL (exit 1 if any fails, 2 if a needed package is missing):
  1. torch's plain cast to float8_e4m3fn does NOT saturate (the chapter's claim, section 2.1): 464 -> 448,
     anything above 464 -> NaN; and x.clamp(-448, 448).to(fp8) equals our saturating rule.
  2. our safetensors file, read by the `safetensors` package: F8_E4M3 weights, BF16 scales of shape [out, 1].
  3. dequantized by hand in torch (fp8.float() * scale, rounded to bf16) it equals the weights tiny-vllm uses.
  4. transformers loads the directory (the compressed-tensors package decompresses it) and its greedy ids
     for the chapter's prompt equal `tiny-vllm generate`'s on the same checkpoint (both compute with the
     dequantized bf16 weights; transformers in bf16 or fp32, tiny-vllm's CPU path in fp32).
Needs torch, safetensors, transformers and compressed-tensors; runs on CPU.
"""
import argparse
import json
import subprocess
import sys

PROMPT_IDS = [744, 474, 274, 370, 286, 289, 285, 431, 407, 507, 289, 302]  # "The capital of Portugal is"

failures = 0


def check(name, ok, detail=""):
    global failures
    failures += 0 if ok else 1
    print(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fp8", required=True, help="the directory tiny-vllm quantize wrote")
    ap.add_argument("--bf16", required=True, help="the original checkpoint")
    ap.add_argument("--tiny-vllm", default="build/bin/tiny-vllm")
    ap.add_argument("--new-tokens", type=int, default=6)
    args = ap.parse_args()
    try:
        import torch
        from safetensors import safe_open
    except ImportError as e:
        print(f"missing package: {e}")
        return 2

    # 1. torch's cast
    x = torch.tensor([448.0, 464.0, 464.03125, 479.0, 480.0, float("inf"), -500.0])
    plain = x.to(torch.float8_e4m3fn).float().tolist()
    print("torch cast of", x.tolist(), "->", plain)
    want_nan = [False, False, True, True, True, True, True]
    check("plain cast: 448 and 464 give 448, beyond 464 NaN",
          plain[0] == 448 and plain[1] == 448 and all((v != v) == n for v, n in zip(plain, want_nan)))
    clamped = x.clamp(-448, 448).to(torch.float8_e4m3fn).float().tolist()
    check("clamp then cast saturates", clamped == [448, 448, 448, 448, 448, 448, -448], str(clamped))

    # 2. + 3. the file, and the dequantized weights
    fp8_file = f"{args.fp8}/model.safetensors"
    bf16_file = f"{args.bf16}/model.safetensors"
    with safe_open(fp8_file, "pt") as f, safe_open(bf16_file, "pt") as g:
        names = list(f.keys())
        scales = [n for n in names if n.endswith(".weight_scale")]
        check("quantized Linear weights present", len(scales) > 0, f"{len(scales)} scales")
        worst = 0.0
        for s in scales:
            w = s[: -len("_scale")]
            q, scale = f.get_tensor(w), f.get_tensor(s)
            ok = q.dtype == torch.float8_e4m3fn and scale.shape == (q.shape[0], 1)
            if not ok:
                check(f"{w}: dtype {q.dtype}, scale shape {tuple(scale.shape)}", False)
                continue
            deq = (q.float() * scale.float()).to(torch.bfloat16).float()
            orig = g.get_tensor(w).float()
            # half an E4M3 ulp of |w|/scale is at most 2^-4 |w|/scale (2^-10 among the subnormals, below
            # 2^-6), times the scale; then one rounding to bf16, at most 2^-8 of the value
            bound = torch.maximum(orig.abs(), scale.float() * 2 ** -6) * 2 ** -4 + deq.abs() * 2 ** -8
            worst = max(worst, ((deq - orig).abs() / bound).max().item())
        check("dequantized weights within the FP8 bound of the originals", worst <= 1.0 + 1e-6,
              f"worst {worst:.4f} of the bound")

    # 4. transformers
    try:
        import transformers
    except ImportError as e:
        print(f"missing package: {e}")
        return 2
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.fp8, torch_dtype=torch.float32)
    except Exception as e:  # the message is the finding: what transformers / compressed-tensors refused
        check("transformers loads the FP8 checkpoint", False, f"{type(e).__name__}: {e}")
        return 1
    check("transformers loads the FP8 checkpoint", True, type(model).__name__)
    ids = torch.tensor([PROMPT_IDS])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)[0, len(PROMPT_IDS):].tolist()
    ours = subprocess.run([args.tiny_vllm, "generate", "--model", args.fp8, "--prompt-ids",
                           " ".join(map(str, PROMPT_IDS)), "--max-tokens", str(args.new_tokens), "--device", "cpu",
                           "--output", "json"], capture_output=True, text=True, check=True)
    ours_ids = json.loads(ours.stdout.strip().splitlines()[-1])["ids"]
    n = min(len(out), len(ours_ids))  # an EOS may stop either one earlier
    check("greedy ids: transformers == tiny-vllm on the FP8 checkpoint", out[:n] == ours_ids[:n],
          f"transformers {out}, tiny-vllm {ours_ids}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
