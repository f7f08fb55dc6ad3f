#!/usr/bin/env python3
"""Lesson 13 with real clients: the official `openai` Python package and curl against `tiny-vllm serve`.

    python3 tests/server/test_openai_client.py --tiny-vllm build/bin/tiny-vllm --model weights/tiny-llama3

Starts the server on an ephemeral loopback port (CPU, an API key), then checks, as a user of those clients would:
models, completions and chat completions (plain and streamed, streamed == plain), stop strings, usage, errors
(unknown model -> NotFoundError, a bad temperature -> BadRequestError, a wrong key -> AuthenticationError), and
with curl the raw wire: /health, a completion, an SSE stream ending in `data: [DONE]`, /metrics, a 404 body.
Finally SIGTERM: the server must exit 0.

Exit status: 0 all passed, 1 a check failed, 77 skipped (python3 without the `openai` package: CTest reports the
test as skipped, never as passed; install it with `python3 -m pip install openai`).
"""
import argparse
import json
import os
import re
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time

SKIP = 77
API_KEY = "sk-tiny-vllm-test"


class Failure(Exception):
    pass


def check(cond, what):
    if not cond:
        raise Failure(what)
    print(f"  ok  {what}")


def start_server(tiny_vllm, model):
    return launch([tiny_vllm, "serve", "--model", model, "--device", "cpu", "--port", "0", "--max-model-len", "512",
                   "--max-num-seqs", "16", "--api-key", API_KEY, "--quiet", "--shutdown-timeout", "5"])


def launch(cmd, timeout=30, stderr=subprocess.DEVNULL):
    """Starts a `tiny-vllm serve ... --port 0` command; (process, port) once it prints "listening on" (also
    used by serve_smoke.py)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True)
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    deadline = time.time() + timeout
    seen = ""
    while time.time() < deadline and proc.poll() is None:
        try:
            line = lines.get(timeout=0.2)
        except queue.Empty:
            continue
        seen += line
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        if m:
            return proc, int(m.group(1))
    why = f"exited with status {proc.returncode}" if proc.poll() is not None else f"did not start within {timeout} s"
    proc.kill()
    raise Failure(f"the server {why}: {' '.join(cmd)}\nstdout: {seen}")


def openai_checks(openai, port):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    model = "tiny-llama3"

    models = client.models.list()
    check([m.id for m in models.data] == [model], "models.list() lists the served model")

    c = client.completions.create(model=model, prompt="The capital of Portugal is", max_tokens=16, temperature=0)
    text = c.choices[0].text
    check(c.object == "text_completion" and c.id.startswith("cmpl-"), "completions.create: object and id")
    check(c.choices[0].finish_reason in ("stop", "length"), f"completions.create: finish_reason {c.choices[0].finish_reason}")
    check(c.usage.prompt_tokens > 0 and c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens,
          f"completions.create: usage {c.usage.prompt_tokens} + {c.usage.completion_tokens}")
    pieces = list(client.completions.create(model=model, prompt="The capital of Portugal is", max_tokens=16,
                                            temperature=0, stream=True))
    check("".join(p.choices[0].text for p in pieces if p.choices) == text,
          f"completions stream: {len(pieces)} chunks join to the same text {text!r}")

    long = client.completions.create(model=model, prompt="Once upon a time", max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True})
    full = long.choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    cut = client.completions.create(model=model, prompt="Once upon a time", max_tokens=40, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True})
    check(cut.choices[0].text == full[:full.find(stop)] and cut.choices[0].finish_reason == "stop",
          f"stop={stop!r}: the text before it, finish_reason stop")

    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Give me one tip for baking bread."}]
    m = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0)
    answer = m.choices[0].message.content
    check(m.object == "chat.completion" and m.choices[0].message.role == "assistant" and isinstance(answer, str),
          "chat.completions.create: an assistant message")
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    check(streamed == answer, f"chat stream: {len(chunks)} chunks join to the same answer")
    check(chunks[0].choices[0].delta.role == "assistant", "chat stream: the role comes first")
    check(chunks[-1].choices == [] and chunks[-1].usage is not None and
          chunks[-1].usage.completion_tokens == m.usage.completion_tokens,
          "chat stream: include_usage gives a last chunk with the usage")
    sampled = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0.8,
                                             top_p=0.9, seed=7)
    again = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0.8,
                                           top_p=0.9, seed=7)
    check(sampled.choices[0].message.content == again.choices[0].message.content,
          "sampling with a seed is reproducible")

    try:
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=2)
        raise Failure("an unknown model was accepted")
    except openai.NotFoundError as e:
        check(e.status_code == 404 and e.code == "model_not_found", "unknown model -> openai.NotFoundError")
    try:
        client.chat.completions.create(model=model, messages=messages, temperature=5)
        raise Failure("temperature 5 was accepted")
    except openai.BadRequestError as e:
        check(e.status_code == 400 and e.param == "temperature", "temperature 5 -> openai.BadRequestError")
    bad = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-wrong", max_retries=0)
    try:
        bad.models.list()
        raise Failure("a wrong API key was accepted")
    except openai.AuthenticationError as e:
        check(e.status_code == 401, "a wrong API key -> openai.AuthenticationError")
    client.close()
    bad.close()


def curl(*args):
    r = subprocess.run(["curl", "-sS", "--max-time", "60", *args], capture_output=True, text=True)
    return r.stdout


def curl_checks(port):
    base = f"http://127.0.0.1:{port}"
    auth = ["-H", f"Authorization: Bearer {API_KEY}", "-H", "Content-Type: application/json"]
    check(json.loads(curl(f"{base}/health")) == {"status": "ok"}, "curl /health")
    body = json.dumps({"model": "tiny-llama3", "prompt": "The capital of Portugal is", "max_tokens": 8,
                       "temperature": 0})
    j = json.loads(curl(*auth, "-d", body, f"{base}/v1/completions"))
    check(j["object"] == "text_completion" and "usage" in j, "curl POST /v1/completions")
    sse = curl("-N", *auth, "-d", json.dumps({**json.loads(body), "stream": True}), f"{base}/v1/completions")
    events = [e for e in sse.split("\n\n") if e]
    check(events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events),
          f"curl -N streaming: {len(events)} SSE events ending with data: [DONE]")
    check("".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]) == j["choices"][0]["text"],
          "curl: streamed text == plain text")
    metrics = curl(f"{base}/metrics")
    check("tvllm_time_to_first_token_seconds_bucket" in metrics and "tvllm_kv_blocks_free" in metrics,
          "curl /metrics: Prometheus text with the TTFT histogram and KV blocks")
    err = json.loads(curl(*auth, f"{base}/v1/nothing-here"))
    check(set(err["error"]) == {"message", "type", "param", "code"}, "curl: an unknown path answers an OpenAI error")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny-vllm", required=True)
    ap.add_argument("--model", required=True)
    args = ap.parse_args()
    try:
        import openai  # noqa: F401
    except ImportError:
        print("SKIPPED: the openai package is not installed (python3 -m pip install openai)")
        return SKIP
    if not os.path.exists(args.tiny_vllm):
        print(f"FAIL: {args.tiny_vllm} does not exist (build the tiny-vllm target)")
        return 1
    print(f"openai {openai.__version__}, curl: {shutil.which('curl') or 'missing'}")
    proc, port = None, 0
    try:
        proc, port = start_server(args.tiny_vllm, args.model)
        print(f"server on port {port}")
        openai_checks(openai, port)
        if shutil.which("curl"):
            curl_checks(port)
        else:
            print("  (curl is not installed: its checks did not run)")
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
        check(rc == 0, f"SIGTERM: the server exits 0 (got {rc})")
    except Failure as e:
        print(f"FAIL: {e}")
        if proc and proc.poll() is None:
            proc.kill()
        return 1
    finally:
        if proc and proc.poll() is None:
            proc.kill()
            proc.wait()
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
