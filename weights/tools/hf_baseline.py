#!/usr/bin/env python3
"""Hugging Face transformers on the engine's benchmark workloads, same GPU, same model: the baseline that
the course's performance figures are divided by (COURSE.md, "Performance method").

    python3 weights/tools/hf_baseline.py --model weights/random-llama-3.2-1b [--workload all]
        [--dtype bfloat16] [--attn sdpa] [--output table|json] [--max-requests N]

Workloads (random prompt ids, seed 0, EOS never ends a request: min_new_tokens = max_new_tokens):
  decode      batch 1: a prompt of --contexts tokens (default 128 and 4096), --new-tokens (128) greedy tokens
              with model.generate. Decode time = time(generate N tokens) - time(generate 1 token): the
              1-token call is the prefill plus the first token, so the difference is N - 1 decode steps.
              Also the bytes one decode step reads (every weight once, plus the KV cache at the mean
              context) per second, beside the measured device copy bandwidth.
  prefill     batch 1: one forward pass over a --prefill-tokens (1000) prompt with use_cache=True and
              logits_to_keep=1 (what generate's first step does).
  throughput  --requests (256) requests, prompt and output lengths uniform in [--min-len, --max-len]
              ([100, 1024]), drawn with the generator `tiny-vllm bench throughput` uses (lessons/
              11_continuous_batching/engine_bench.h; throughput_workload below is its exact port): SplitMix64
              seeded with --seed; per request, in order: prompt_len = min + next() % (max - min + 1), output_len
              the same way, then prompt_len ids, each next() % id_high (id_high: below the special ids, see
              id_range). So both run the SAME requests. transformers has no continuous batching: requests are taken in order in
              static batches of --batch-size (64), left-padded to the batch's longest prompt, and every
              request of a batch runs for the batch's longest output (vLLM's benchmark_throughput does the
              same for its HF backend). Output tok/s counts only the tokens each request asked for;
              total tok/s adds the prompt tokens. --sort-by-length groups similar lengths first (less
              padding; not what a server that does not know the lengths could do).
Times are wall-clock around the call with the device synchronised, median of --repeats after a warm-up.
Everything runs in --dtype (bfloat16) with --attn (sdpa) and transformers' default dynamic KV cache.

    python3 weights/tools/hf_baseline.py --print-workload 10 --id-high 744 [--seed 0 --min-len --max-len]
prints the first N requests of the throughput workload (prompt and output lengths, first ids) as one JSON line
and exits (no torch needed): tests/test_11_engine.cpp compares it with the C++ generator.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

torch = None  # imported by main(): --print-workload needs no torch (and starts in a blink)

# ---------------------------------------------------------------------------------------------------------
# Setup


def pick_device(requested: str) -> torch.device:
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but torch sees no CUDA device")
    return torch.device(requested)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load_model(model_dir: Path, dtype: str, attn: str, device: torch.device):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype), attn_implementation=attn)
    return model.to(device).eval()


def id_range(config) -> int:
    """Prompt ids are drawn from [0, this): below the first special token when they come after the
    ordinary vocabulary (Llama 3: 128000; the tiny model: 744), else the whole vocabulary."""
    bos = config.bos_token_id
    if isinstance(bos, int) and config.vocab_size // 2 < bos < config.vocab_size:
        return bos
    return config.vocab_size


def eos_ids(model) -> list[int]:
    eos = model.generation_config.eos_token_id or model.config.eos_token_id
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


def weight_bytes(model) -> int:
    """Bytes of every distinct weight tensor (tied embeddings counted once): what one decode step reads."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def kv_bytes_per_token(model) -> int:
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    elem = next(model.parameters()).element_size()
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * elem  # K and V, every layer


def copy_bandwidth(device: torch.device) -> float | None:
    """Device-to-device copy of 1 GiB, read + write bytes per second (median of 10), or None on CPU."""
    if device.type != "cuda":
        return None
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (1 << 30) / statistics.median(times)


# ---------------------------------------------------------------------------------------------------------
# Workloads


def generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, new_tokens: int, eos: list[int],
             pad: int) -> torch.Tensor:
    """Greedy, exactly new_tokens tokens: min_new_tokens masks the EOS ids until the end."""
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, temperature=None, top_p=None, top_k=None,
                         eos_token_id=eos or None, pad_token_id=pad)
    if out.shape[1] - input_ids.shape[1] != new_tokens:
        raise SystemExit(f"error: generate returned {out.shape[1] - input_ids.shape[1]} tokens, "
                         f"asked for {new_tokens}")
    return out


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median wall-clock seconds of fn() over repeats runs, after one warm-up run."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def random_ids(n: int, high: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, high, (n,), generator=gen)


def check_context(model, tokens: int, what: str) -> None:
    limit = model.config.max_position_embeddings
    if tokens > limit:
        raise SystemExit(f"error: {what} needs {tokens} positions, the model has max_position_embeddings "
                         f"{limit}: use smaller --contexts / --new-tokens / --prefill-tokens / --max-len")


def run_decode(model, args, device, copy_bw) -> list[dict]:
    gen = torch.Generator().manual_seed(args.seed)
    eos, pad = eos_ids(model), (eos_ids(model) or [0])[0]
    w_bytes, kv_tok = weight_bytes(model), kv_bytes_per_token(model)
    rows = []
    for ctx in args.contexts:
        check_context(model, ctx + args.new_tokens, f"decode at context {ctx}")
        ids = random_ids(ctx, id_range(model.config), gen)[None].to(device)
        mask = torch.ones_like(ids)
        t_first = timed(lambda: generate(model, ids, mask, 1, eos, pad), device, args.repeats)
        t_all = timed(lambda: generate(model, ids, mask, args.new_tokens, eos, pad), device, args.repeats)
        steps = args.new_tokens - 1
        step_s = (t_all - t_first) / steps
        # One step reads every weight once and the KV cache of the context so far (mean over the steps).
        step_bytes = w_bytes + kv_tok * (ctx + args.new_tokens / 2)
        row = {"workload": "decode", "batch": 1, "context": ctx, "new_tokens": args.new_tokens,
               "first_token_s": t_first, "generate_s": t_all, "decode_tok_s": 1.0 / step_s,
               "ms_per_token": step_s * 1e3, "bytes_per_step": step_bytes, "achieved_GB_s": step_bytes / step_s / 1e9}
        if copy_bw:
            row["pct_of_copy_bw"] = 100 * step_bytes / step_s / copy_bw
        rows.append(row)
        print(f"decode ctx {ctx}: {row['decode_tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
    return rows


def run_prefill(model, args, device) -> list[dict]:
    gen = torch.Generator().manual_seed(args.seed)
    check_context(model, args.prefill_tokens, "prefill")
    ids = random_ids(args.prefill_tokens, id_range(model.config), gen)[None].to(device)

    def forward():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True, logits_to_keep=1)

    t = timed(forward, device, args.repeats)
    print(f"prefill {args.prefill_tokens}: {args.prefill_tokens / t:.0f} tok/s", file=sys.stderr, flush=True)
    return [{"workload": "prefill", "batch": 1, "prompt_tokens": args.prefill_tokens, "seconds": t,
             "prefill_tok_s": args.prefill_tokens / t}]


_MASK64 = (1 << 64) - 1


class SplitMix64:
    """common/random.h's Rng::next_u64, bit for bit."""

    def __init__(self, seed: int):
        self.state = seed & _MASK64

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & _MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)


def throughput_workload(n: int, min_len: int, max_len: int, id_high: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) of n requests: make_throughput_workload in engine_bench.cpp, ported exactly."""
    rng, span = SplitMix64(seed), max_len - min_len + 1
    reqs = []
    for _ in range(n):
        prompt_len = min_len + rng.next() % span
        output_len = min_len + rng.next() % span
        reqs.append(([rng.next() % id_high for _ in range(prompt_len)], output_len))
    return reqs


def make_requests(args, high: int) -> list[tuple[torch.Tensor, int]]:
    """(prompt ids, output length) for every request; --max-requests keeps the first N of the same list."""
    reqs = [(torch.tensor(ids, dtype=torch.long), o)
            for ids, o in throughput_workload(args.requests, args.min_len, args.max_len, high, args.seed)]
    return reqs[: args.max_requests] if args.max_requests else reqs


def run_throughput(model, args, device) -> list[dict]:
    reqs = make_requests(args, id_range(model.config))
    check_context(model, max(len(p) for p, _ in reqs) + max(o for _, o in reqs), "throughput")
    eos, pad = eos_ids(model), (eos_ids(model) or [0])[0]
    order = list(range(len(reqs)))
    if args.sort_by_length:
        order.sort(key=lambda i: (len(reqs[i][0]) + reqs[i][1]), reverse=True)
    batches = [order[i:i + args.batch_size] for i in range(0, len(order), args.batch_size)]

    # Warm-up: a small padded batch, so the first real batch does not pay for kernel loading.
    warm = torch.full((2, 16), pad, dtype=torch.long, device=device)
    generate(model, warm, torch.ones_like(warm), 4, eos, pad)
    sync(device)
    t0 = time.perf_counter()
    generated = 0
    for k, b in enumerate(batches):
        width = max(len(reqs[i][0]) for i in b)
        new = max(reqs[i][1] for i in b)
        ids = torch.full((len(b), width), pad, dtype=torch.long)
        mask = torch.zeros((len(b), width), dtype=torch.long)
        for row, i in enumerate(b):  # left padding: every prompt ends at the last column
            p = reqs[i][0]
            ids[row, width - len(p):] = p
            mask[row, width - len(p):] = 1
        generate(model, ids.to(device), mask.to(device), new, eos, pad)
        generated += len(b) * new
        sync(device)  # (progress only: the batches run one after another anyway)
        done = sum(reqs[i][1] for bb in batches[:k + 1] for i in bb)
        print(f"[{time.perf_counter() - t0:6.1f} s] batch {k + 1}/{len(batches)}: {len(b)} requests, prompts "
              f"padded to {width}, {new} new tokens each; {done} useful output tokens so far", file=sys.stderr,
              flush=True)
    sync(device)
    seconds = time.perf_counter() - t0
    prompt_tokens = sum(len(p) for p, _ in reqs)
    output_tokens = sum(o for _, o in reqs)
    print(f"throughput: {output_tokens / seconds:.0f} output tok/s", file=sys.stderr, flush=True)
    return [{"workload": "throughput", "requests": len(reqs), "batch_size": args.batch_size,
             "batches": len(batches), "batching": ("static batches sorted by length" if args.sort_by_length
                                                   else "static batches in request order"),
             "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
             "generated_tokens_incl_padding": generated, "seconds": seconds,
             "output_tok_s": output_tokens / seconds, "total_tok_s": (prompt_tokens + output_tokens) / seconds}]


# ---------------------------------------------------------------------------------------------------------
# Output


def print_table(info: dict, rows: list[dict]) -> None:
    print(f"Hugging Face transformers {info['transformers']} (torch {info['torch']}) on {info['device']}")
    print(f"model {info['model']}: {info['parameters'] / 1e6:.1f} M parameters, {info['dtype']}, "
          f"attn {info['attn']}, dynamic KV cache, greedy, EOS ignored, random prompt ids (seed {info['seed']})")
    if info.get("copy_GB_s"):
        print(f"measured device copy bandwidth: {info['copy_GB_s']:.0f} GB/s (read + write)")
    for r in rows:
        if r["workload"] == "decode":
            pct = f" = {r['pct_of_copy_bw']:.0f}% of copy" if "pct_of_copy_bw" in r else ""
            print(f"  decode   batch 1, context {r['context']:>5}, {r['new_tokens']} new: "
                  f"{r['decode_tok_s']:8.1f} tok/s ({r['ms_per_token']:.2f} ms/token), "
                  f"weights+KV {r['achieved_GB_s']:.1f} GB/s{pct}")
        elif r["workload"] == "prefill":
            print(f"  prefill  batch 1, {r['prompt_tokens']} tokens: {r['prefill_tok_s']:10.0f} tok/s "
                  f"({r['seconds'] * 1e3:.1f} ms)")
        else:
            print(f"  throughput {r['requests']} requests ({r['batching']}, {r['batches']} batches of up to "
                  f"{r['batch_size']}): {r['output_tok_s']:.0f} output tok/s, {r['total_tok_s']:.0f} total tok/s "
                  f"({r['seconds']:.1f} s; {r['output_tokens']} useful of {r['generated_tokens_incl_padding']} "
                  f"generated tokens)")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="Hugging Face model directory (required unless --print-workload)")
    ap.add_argument("--workload", choices=["decode", "prefill", "throughput", "all"], default="all")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    ap.add_argument("--attn", choices=["sdpa", "eager", "flash_attention_2"], default="sdpa")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--output", choices=["table", "json"], default="table")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per decode/prefill figure (median)")
    ap.add_argument("--contexts", default="128,4096", help="decode prompt lengths, comma-separated")
    ap.add_argument("--new-tokens", type=int, default=128, help="decode: tokens generated per run")
    ap.add_argument("--prefill-tokens", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-requests", type=int, default=0, help="throughput: only the first N requests")
    ap.add_argument("--min-len", type=int, default=100, help="throughput: shortest prompt and output")
    ap.add_argument("--max-len", type=int, default=1024, help="throughput: longest prompt and output")
    ap.add_argument("--batch-size", type=int, default=64, help="throughput: requests per generate call")
    ap.add_argument("--sort-by-length", action="store_true", help="throughput: batch similar lengths")
    ap.add_argument("--print-workload", type=int, default=0, metavar="N",
                    help="print the first N throughput requests (lengths, first ids) as JSON and exit")
    ap.add_argument("--id-high", type=int, default=0,
                    help="--print-workload: ids are drawn below this (default: from --model's config)")
    args = ap.parse_args()
    try:
        args.contexts = [int(c) for c in args.contexts.split(",") if c]
    except ValueError:
        ap.error("--contexts: comma-separated integers")
    if (not args.contexts or min(args.contexts) < 1 or args.new_tokens < 2 or args.prefill_tokens < 1
            or args.repeats < 1 or args.requests < 1 or args.max_requests < 0 or args.batch_size < 1
            or not 1 <= args.min_len <= args.max_len):
        ap.error("sizes must be positive (--new-tokens >= 2, --min-len <= --max-len)")
    if args.print_workload:
        if args.id_high < 1 and args.model is None:
            ap.error("--print-workload needs --id-high or --model")
        return args
    if args.model is None:
        ap.error("--model is required")
    if not (args.model / "config.json").is_file():
        ap.error(f"{args.model}/config.json not found")
    return args


def print_workload(args) -> None:
    high = args.id_high
    if high < 1:
        cfg = json.loads((args.model / "config.json").read_text())
        bos, vocab = cfg.get("bos_token_id"), cfg["vocab_size"]
        high = bos if isinstance(bos, int) and vocab // 2 < bos < vocab else vocab
    reqs = throughput_workload(args.print_workload, args.min_len, args.max_len, high, args.seed)
    print(json.dumps({"prompt_lens": [len(p) for p, _ in reqs], "output_lens": [o for _, o in reqs],
                      "first_ids": [p[0] for p, _ in reqs]}))


def main() -> int:
    args = parse_args()
    if args.print_workload:
        print_workload(args)
        return 0
    global torch
    import torch
    import transformers

    device = pick_device(args.device)
    torch.manual_seed(args.seed)
    model = load_model(args.model, args.dtype, args.attn, device)
    copy_bw = copy_bandwidth(device) if args.workload in ("decode", "all") else None
    info = {"model": str(args.model), "device": (f"cuda ({torch.cuda.get_device_name(device)})"
                                                  if device.type == "cuda" else f"cpu ({platform.machine()})"),
            "torch": torch.__version__, "transformers": transformers.__version__, "dtype": args.dtype,
            "attn": args.attn, "seed": args.seed, "parameters": sum(p.numel() for p in model.parameters()),
            "weight_bytes": weight_bytes(model)}
    if copy_bw:
        info["copy_GB_s"] = copy_bw / 1e9
    rows = []
    with torch.inference_mode():
        if args.workload in ("decode", "all"):
            rows += run_decode(model, args, device, copy_bw)
        if args.workload in ("prefill", "all"):
            rows += run_prefill(model, args, device)
        if args.workload in ("throughput", "all"):
            rows += run_throughput(model, args, device)
    if args.output == "json":
        print(json.dumps({"info": info, "results": rows}, indent=2))
    else:
        print_table(info, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
