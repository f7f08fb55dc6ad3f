#!/usr/bin/env python3
"""Train the bundled tiny model (weights/tiny-llama3) on the project's own corpus, so that it speaks.

    python3 weights/tools/train_tiny_model.py --device cuda --in-place        # a minute or two on one H200
    python3 weights/tools/train_tiny_model.py --device cpu --steps 20 --batch 4 --out /tmp/tiny-trained

make_tiny_model.py gives the model its tokenizer, its config and seeded random weights that are good for
checking kernels but say nothing. This script keeps the config and the tokenizer exactly as they are and
replaces only model.safetensors by weights trained on weights/corpus:
  - weights/corpus/*.txt           the tokenizer's own training texts (make_tiny_model.py reads only these,
                                   so adding training text never changes the tokenizer);
  - weights/corpus/training/*.txt  more plain English written for the model;
  - weights/corpus/training/*.chat short conversations ("User:" / "Assistant:" lines, optionally a
                                   "System:" line first, conversations separated by a blank line), rendered
                                   with the model's own chat template, so `tiny-vllm chat` gets an answer
                                   that ends with <|eot_id|>.
Every text file becomes <|begin_of_text|> + its tokens; the documents are shuffled with the seed and joined
into one stream, and every step reads --batch windows of --seq-len + 1 tokens at seeded random offsets.

The model: the config as it is (2 layers, hidden 336, 6 heads / 2 KV heads, head_dim 64, tied embeddings,
llama3 rope), a fresh seeded initialisation (std 0.02, the residual projections scaled by 1/sqrt(2 layers)),
trained in fp32 (or bf16 autocast) with AdamW and a cosine schedule, eager attention and deterministic
algorithms: the same seed, device kind and library versions give the same weights. The result is stored
as bf16 under the same tensor names (no lm_head: tied), ~4.5 MB.

At the end it reloads the stored file the way make_reference.py does (fp32 compute, eager, CPU) and prints
the corpus loss, the top-1/top-2 logit margins over corpus text, and greedy continuations (32 tokens) of
three corpus sentences, two prompts the corpus does not contain, and one chat turn.

After --in-place, regenerate the references: python3 weights/tools/make_reference.py weights/tiny-llama3 --device cpu
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import shutil
import sys
import time
from pathlib import Path

# Deterministic cuBLAS needs this before CUDA is initialised (see torch.use_deterministic_algorithms).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

WEIGHTS_DIR = Path(__file__).resolve().parent.parent
MODEL_FILES = ("config.json", "generation_config.json", "special_tokens_map.json", "tokenizer.json",
               "tokenizer_config.json")

# Greedy samples printed at the end. The corpus prefixes must occur in the corpus and the unseen prompts
# must not (checked), so the printout says what it claims.
CORPUS_PREFIXES = [
    "Bread, the slow way. Mix 500 g of flour,",
    "Lisbon, Tuesday. The trams here climb hills",
    "The capital of Portugal is",  # make_reference.py's first prompt; training/geography.txt says Lisbon
]
UNSEEN_PROMPTS = [
    "On the first warm evening of the year, my neighbour",
    "My favourite thing about winter is",
]
CHAT_PROMPT = [{"role": "user", "content": "Give me one tip for baking bread."}]  # make_reference.py's chat
SAMPLE_TOKENS = 32


# ---------------------------------------------------------------------------------------------------------
# Data


def parse_conversations(text: str, path: Path) -> list[list[dict]]:
    """Conversations from a .chat file: blocks separated by blank lines, each line "Role: content" with the
    roles System (first line only), User and Assistant; a line without a role continues the previous one."""
    roles = {"System": "system", "User": "user", "Assistant": "assistant"}
    out = []
    for n, block in enumerate(b for b in text.replace("\r\n", "\n").split("\n\n") if b.strip()):
        messages: list[dict] = []
        for line in block.strip().split("\n"):
            head, sep, rest = line.partition(":")
            if sep and head in roles:
                messages.append({"role": roles[head], "content": rest.strip()})
            elif messages:
                messages[-1]["content"] += "\n" + line.strip()
            else:
                raise SystemExit(f"error: {path}: conversation {n + 1} does not start with a role: {line!r}")
        if not any(m["role"] == "assistant" for m in messages):
            raise SystemExit(f"error: {path}: conversation {n + 1} has no Assistant line")
        out.append(messages)
    return out


def load_documents(corpus: Path, tok) -> tuple[list[list[int]], dict[str, int], str]:
    """Token ids of every document, counts per kind, and all plain text (for the sample checks)."""
    bos = tok.bos_token_id
    text_files = sorted(corpus.glob("*.txt")) + sorted((corpus / "training").glob("*.txt"))
    chat_files = sorted((corpus / "training").glob("*.chat"))
    if not text_files:
        raise SystemExit(f"error: no *.txt files in {corpus}")
    docs, plain = [], []
    counts = {"text files": 0, "text tokens": 0, "conversations": 0, "chat tokens": 0}
    for f in text_files:
        text = f.read_text(encoding="utf-8")
        plain.append(text)
        # verbose=False: the files are longer than model_max_length, which is fine for training windows.
        docs.append([bos] + tok(text, add_special_tokens=False, verbose=False)["input_ids"])
        counts["text files"] += 1
        counts["text tokens"] += len(docs[-1])
    for f in chat_files:
        for messages in parse_conversations(f.read_text(encoding="utf-8"), f):
            # The template writes <|begin_of_text|> itself, as in make_reference.py's chat prompt.
            rendered = tok.apply_chat_template(messages, tokenize=False)
            plain.append(rendered)
            docs.append(tok(rendered, add_special_tokens=False)["input_ids"])
            counts["conversations"] += 1
            counts["chat tokens"] += len(docs[-1])
    return docs, counts, "\n".join(plain)


def token_stream(docs: list[list[int]], seed: int) -> torch.Tensor:
    """All documents in a seeded order, one after the other: [total tokens] int64."""
    order = torch.randperm(len(docs), generator=torch.Generator().manual_seed(seed)).tolist()
    return torch.tensor([t for i in order for t in docs[i]], dtype=torch.long)


# ---------------------------------------------------------------------------------------------------------
# Model


def fresh_model(model_dir: Path, seed: int):
    """LlamaForCausalLM with model_dir's config, fp32, eager attention, seeded initialisation."""
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    if config.model_type != "llama" or not config.tie_word_embeddings:
        raise SystemExit("error: expected a Llama config with tied embeddings")
    torch.manual_seed(seed)
    model = LlamaForCausalLM._from_config(config, attn_implementation="eager", dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    residual_scale = 1.0 / math.sqrt(2 * config.num_hidden_layers)  # each layer adds two residual branches
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):  # lm_head is tied: not listed separately
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                std = 0.02 * (residual_scale if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0)
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise SystemExit("error: lm_head is not tied to embed_tokens")
    return model


def lr_at(step: int, args) -> float:
    """Linear warm-up, then cosine from --lr down to --lr * --min-lr-ratio at the last step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model, stream: torch.Tensor, args, device: torch.device) -> float:
    """The training loop; returns the mean loss over the last --log-every steps."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]  # RMSNorm weights
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(args.seed + 1)  # data order: CPU generator, same on every machine
    window = torch.arange(args.seq_len + 1)
    stream_dev = stream.to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")
    model.train()
    running = torch.zeros((), device=device)
    last = float("nan")
    t0 = time.perf_counter()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        offsets = torch.randint(0, len(stream) - args.seq_len - 1, (args.batch, 1), generator=gen)
        batch = stream_dev[(offsets + window).to(device)]  # [batch, seq_len + 1]
        with autocast:
            logits = model(input_ids=batch[:, :-1], use_cache=False).logits  # [batch, seq_len, vocab]
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        running += loss.detach()
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            n = (step % args.log_every) + 1
            last = running.item() / n  # the only host synchronisation, once per log line
            running.zero_()
            dt = time.perf_counter() - t0
            tok_s = (step + 1) * args.batch * args.seq_len / dt
            print(f"step {step + 1:>5}/{args.steps}  loss {last:.4f}  lr {lr_at(step, args):.2e}  "
                  f"{dt:6.1f} s  {tok_s / 1e3:,.0f}k tok/s", flush=True)
    return last


def save_weights(model, source_dir: Path, out: Path) -> Path:
    """model.safetensors in bf16 with exactly the tensor names and shapes of the source model's file."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(source_dir / "model.safetensors", framework="pt") as f:
        want = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    state = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in model.state_dict().items()
             if k != "lm_head.weight"}  # tied: the file holds only embed_tokens, as HF saves it
    got = {k: tuple(v.shape) for k, v in state.items()}
    if got != want:
        raise SystemExit(f"error: trained tensors differ from {source_dir}/model.safetensors: "
                         f"{sorted(set(got.items()) ^ set(want.items()))}")
    path = out / "model.safetensors"
    save_file(state, str(path), metadata={"format": "pt"})  # the metadata save_pretrained writes
    path.chmod(0o644)  # safetensors creates it private (0600)
    return path


# ---------------------------------------------------------------------------------------------------------
# Report: reload the stored bf16 weights exactly as make_reference.py does (fp32, eager) on the CPU.


def margins(logits: torch.Tensor) -> torch.Tensor:
    """top1 - top2 logit gap per row of logits [T, vocab]."""
    top2 = logits.float().topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


def greedy(model, tok, ids: list[int], eos_ids: list[int]) -> tuple[str, float, bool]:
    """The new text, the smallest step margin, and whether it stopped at an EOS id."""
    input_ids = torch.tensor([ids])
    out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                         max_new_tokens=SAMPLE_TOKENS, do_sample=False, temperature=None, top_p=None,
                         top_k=None, eos_token_id=eos_ids, pad_token_id=eos_ids[0],
                         return_dict_in_generate=True, output_scores=True)
    new = out.sequences[0, len(ids):].tolist()
    step_margin = float(margins(torch.cat(out.scores)).min())
    stopped = bool(new) and new[-1] in eos_ids
    return tok.decode(new, skip_special_tokens=True), step_margin, stopped


def report(out: Path, stream: torch.Tensor, seq_len: int, plain_text: str) -> None:
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(out)
    model = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    eos = model.generation_config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos)
    with torch.no_grad():
        # The loss and margins over (up to) 16 non-overlapping windows of the training stream.
        n = min(16, (len(stream) - 1) // (seq_len + 1))
        windows = stream[: n * (seq_len + 1)].view(n, seq_len + 1)
        logits = model(input_ids=windows[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()).item()
        m = margins(logits.flatten(0, 1))
        q = torch.quantile(m, torch.tensor([0.1, 0.5, 0.9]))
        print(f"\nstored bf16 weights, fp32 compute (as make_reference.py): corpus loss {loss:.4f} over "
              f"{m.numel()} positions")
        print(f"top1-top2 logit margin: p10 {q[0]:.2f}  median {q[1]:.2f}  p90 {q[2]:.2f}; "
              f"{(m > 0.5).float().mean() * 100:.0f}% > 0.5, {(m > 1.0).float().mean() * 100:.0f}% > 1.0")

        print(f"\ngreedy continuations, {SAMPLE_TOKENS} tokens (min margin over the steps):")
        samples = [("corpus", p) for p in CORPUS_PREFIXES] + [("unseen", p) for p in UNSEEN_PROMPTS]
        for kind, prompt in samples:
            if (prompt in plain_text) != (kind == "corpus"):
                raise SystemExit(f"error: sample prompt {prompt!r} should {'' if kind == 'corpus' else 'not '}"
                                 "occur in the corpus")
            text, step_margin, _ = greedy(model, tok, tok(prompt)["input_ids"], eos_ids)
            print(f"  [{kind}, {step_margin:.2f}] {prompt!r} -> {text!r}")
        chat = tok.apply_chat_template(CHAT_PROMPT, tokenize=False, add_generation_prompt=True)
        text, step_margin, stopped = greedy(model, tok, tok(chat, add_special_tokens=False)["input_ids"], eos_ids)
        print(f"  [chat, {step_margin:.2f}] {CHAT_PROMPT[0]['content']!r} -> {text!r}"
              f"{' <stopped at EOS>' if stopped else ''}")


# ---------------------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=WEIGHTS_DIR / "tiny-llama3",
                    help="model directory whose config and tokenizer are used (default weights/tiny-llama3)")
    ap.add_argument("--corpus", type=Path, default=WEIGHTS_DIR / "corpus", help="training texts")
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", type=Path, help="write a complete model directory here (no reference/)")
    where.add_argument("--in-place", action="store_true", help="overwrite --model's model.safetensors")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=64, help="sequences per step")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    ap.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr = lr * this")
    ap.add_argument("--warmup", type=int, default=100, help="linear warm-up steps")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                    help="fp32, or bf16 autocast (the model is tiny: fp32 costs little)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--no-report", action="store_true", help="skip the reload, margins and samples")
    args = ap.parse_args()
    if args.steps < 1 or args.batch < 1 or args.seq_len < 2 or args.log_every < 1:
        ap.error("--steps, --batch, --log-every must be >= 1 and --seq-len >= 2")
    args.warmup = min(args.warmup, args.steps)
    return args


def main() -> int:
    args = parse_args()
    from transformers import AutoTokenizer

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but torch sees no CUDA device")
    device = torch.device(args.device)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32: reproducible and comparable to CPU

    tok = AutoTokenizer.from_pretrained(args.model)
    docs, counts, plain_text = load_documents(args.corpus, tok)
    stream = token_stream(docs, args.seed)
    if len(stream) < args.seq_len + 2:
        raise SystemExit(f"error: the corpus has {len(stream)} tokens, fewer than --seq-len + 2")
    print(f"corpus {args.corpus}: {counts['text files']} text files ({counts['text tokens']} tokens), "
          f"{counts['conversations']} conversations ({counts['chat tokens']} tokens); "
          f"{args.steps} steps x {args.batch} x {args.seq_len} tokens = "
          f"{args.steps * args.batch * args.seq_len / len(stream):.1f} passes over the corpus")

    model = fresh_model(args.model, args.seed).to(device)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
          + f", {args.precision}")
    t0 = time.perf_counter()
    final = train(model, stream, args, device)
    print(f"trained in {time.perf_counter() - t0:.1f} s; final train loss {final:.4f} "
          f"(mean of the last {min(args.log_every, args.steps)} steps)")

    out = args.model if args.in_place else args.out
    if not args.in_place:
        out.mkdir(parents=True, exist_ok=True)
        if out.resolve() != args.model.resolve():
            for name in MODEL_FILES:
                shutil.copyfile(args.model / name, out / name)
    path = save_weights(model, args.model, out)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB, bf16), sha256 {digest}")
    if not args.no_report:
        report(out, stream, args.seq_len, plain_text)
    print(f"\nnext: python3 weights/tools/make_reference.py {out} --device cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
