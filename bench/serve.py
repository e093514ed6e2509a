"""Serving: the real ``areno serve`` process under 500 streamed completions, at unlimited load and at 16 requests/s.

    python bench/serve.py               # H200: Qwen3-0.6B shape, random bf16 weights (about 2 minutes)
    python bench/serve.py --smoke       # CPU: a tiny shape, 20 short requests (times meaningless)

The server runs in a subprocess exactly as a user starts it: ``python -m areno serve --model-path <ckpt> --port P
--max-running-prompts 256`` (CUDA graphs on). Each request is ``POST /v1/completions`` with a prompt of 512 random
token ids, ``max_tokens 128``, ``temperature 1``, ``ignore_eos: true`` (so every request makes 128 tokens),
``stream: true`` with ``stream_options.include_usage``; the client is httpx async (no connection limit) in this
process. The checkpoint's word-level tokenizer decodes every id to a word, so the server sends one chunk per token.

- TTFT: request sent -> first chunk carrying text. TPOT: (last text chunk - first) / (completion tokens - 1).
- Output tokens/s: completion tokens of all requests / (last response end - first request sent).
- Loads: all 500 requests at once ("unlimited"), then Poisson arrivals at 16 requests/s (seed 0; 500 requests take
  about 31 s, so output is capped near 16 x 128 = 2k tok/s there and latency is the number to read).
Before measuring, a warm-up round of each load pattern (fewer requests) lets the server capture its CUDA graphs and
compile its kernels. No baseline server runs beside it (the machine has no vLLM/SGLang).
One JSON line per load goes to bench/results/serve.jsonl.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import models  # noqa: E402
from common import append_jsonl, env_info, print_table  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(path, port, args, log_file):
    cmd = [
        sys.executable,
        "-m",
        "areno",
        "serve",
        "--model-path",
        str(path),
        "--port",
        str(port),
        "--max-running-prompts",
        str(args.max_running_prompts),
    ]
    if args.eager:
        cmd.append("--eager-decode")
    cmd += args.server_args.split()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    print("server:", " ".join(cmd), flush=True)
    return subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, cwd=ROOT, env=env)


def wait_ready(proc, base, timeout_s) -> str:
    """Poll /health until the server answers; returns the served model name."""
    import httpx

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before it was ready")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return httpx.get(base + "/v1/models", timeout=5).json()["data"][0]["id"]
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"server not ready after {timeout_s}s")


def stop_server(proc):
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def one_request(client, url, body, start_at, t_origin) -> dict:
    delay = t_origin + start_at - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    sent = time.perf_counter()
    times, usage, err = [], None, None
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                err = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        break
                    now = time.perf_counter()
                    obj = json.loads(data)
                    if "error" in obj:
                        err = str(obj["error"])[:200]
                    elif obj.get("choices") and obj["choices"][0].get("text"):
                        times.append(now)
                    if obj.get("usage"):
                        usage = obj["usage"]["completion_tokens"]
    except Exception as e:  # a failed request is counted, not fatal
        err = f"{type(e).__name__}: {e}"[:200]
    end = time.perf_counter()
    tokens = usage if usage is not None else len(times)
    out = {"sent": sent, "end": end, "tokens": tokens, "error": err}
    if times:
        out["ttft"] = times[0] - sent
        if tokens > 1:
            out["tpot"] = (times[-1] - times[0]) / (tokens - 1)
    return out


async def run_load(base, model, prompts, max_tokens, rate, seed=0) -> tuple[list[dict], float]:
    """Send every prompt (all at once when ``rate`` is None, else Poisson at ``rate``/s); returns results, origin."""
    import httpx

    rng = random.Random(seed)
    t, starts = 0.0, []
    for _ in prompts:
        starts.append(t if rate else 0.0)
        if rate:
            t += rng.expovariate(rate)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(600.0, connect=60.0)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=timeout) as client:
        origin = time.perf_counter()
        tasks = []
        for p, s in zip(prompts, starts):
            body = {
                "model": model,
                "prompt": p,
                "max_tokens": max_tokens,
                "temperature": 1.0,
                "stream": True,
                "ignore_eos": True,
                "stream_options": {"include_usage": True},
            }
            tasks.append(one_request(client, "/v1/completions", body, s, origin))
        return await asyncio.gather(*tasks), origin


def pct(values, q):
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def summarize(load, results, origin, max_tokens) -> dict:
    ok = [r for r in results if r["error"] is None]
    tokens = sum(r["tokens"] for r in ok)
    span = max((r["end"] for r in results), default=origin) - min((r["sent"] for r in results), default=origin)
    rec = dict(
        load=load,
        requests=len(results),
        failed=len(results) - len(ok),
        output_tokens=tokens,
        short=sum(r["tokens"] < max_tokens for r in ok),
        wall_s=span,
        tok_s=tokens / span if span else None,
        req_s=len(ok) / span if span else None,
    )
    for key in ("ttft", "tpot"):
        vals = sorted(r[key] * 1e3 for r in ok if key in r)
        for q in (50, 90, 99):
            rec[f"{key}_p{q}_ms"] = pct(vals, q)
        rec[f"{key}_mean_ms"] = sum(vals) / len(vals) if vals else None
    errors = [r["error"] for r in results if r["error"]]
    if errors:
        rec["error"] = f"{len(errors)} failed, e.g. {errors[0]}"
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shape, few short requests (checks the script)")
    ap.add_argument("--requests", type=int, default=None, help="500 (20 with --smoke)")
    ap.add_argument("--prompt-tokens", type=int, default=None, help="512 (32 with --smoke)")
    ap.add_argument("--max-tokens", type=int, default=None, help="128 (8 with --smoke)")
    ap.add_argument("--rates", default="inf,16", help="comma list of requests/s; inf = all at once")
    ap.add_argument("--max-running-prompts", type=int, default=256)
    ap.add_argument("--eager", action="store_true", help="server with --eager-decode")
    ap.add_argument("--startup-timeout-s", type=float, default=300)
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--no-save", action="store_true", help="do not append to bench/results/serve.jsonl")
    ap.add_argument("--server-args", default="", help="more areno serve flags, e.g. '--world-size 2 --tp-size 2'")
    ap.add_argument("--greedy-out", default=None,
                    help="after the loads, write the greedy completions of 32 fixed prompts (64 tokens) here (JSON)")
    args = ap.parse_args()
    for name, full, smoke in (("requests", 500, 20), ("prompt_tokens", 512, 32), ("max_tokens", 128, 8)):
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else full)
    shape = models.shape_of(args.smoke)
    t_start = time.perf_counter()
    path = models.checkpoint(args.smoke)
    print(f"checkpoint {path} ({time.perf_counter() - t_start:.1f}s)", flush=True)
    rates = [None if r in ("inf", "unlimited") else float(r) for r in args.rates.split(",")]

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    records = []
    log = tempfile.NamedTemporaryFile("w+", prefix="areno-serve-", suffix=".log", delete=False)
    proc = start_server(path, port, args, log)
    try:
        model = wait_ready(proc, base, args.startup_timeout_s)
        print(f"server ready in {time.perf_counter() - t_start:.1f}s, model {model!r}", flush=True)
        vocab = shape["vocab_size"]
        for rate in rates:
            load = "unlimited" if rate is None else f"{rate:g} req/s"
            try:
                if not args.no_warmup:  # same pattern, fewer requests: graph capture and kernel compilation
                    t0 = time.perf_counter()
                    n_warm = args.requests if rate is None else max(4, int(3 * rate))
                    warm = models.random_prompts(min(n_warm, args.requests), args.prompt_tokens, vocab, seed=99)
                    res, origin = asyncio.run(run_load(base, model, warm, args.max_tokens, rate, seed=99))
                    w = summarize(load, res, origin, args.max_tokens)
                    print(
                        f"warm-up {load}: {len(warm)} requests in {time.perf_counter() - t0:.1f}s"
                        f"{', ' + w['error'] if 'error' in w else ''}",
                        flush=True,
                    )
                prompts = models.random_prompts(args.requests, args.prompt_tokens, vocab, seed=0)
                res, origin = asyncio.run(run_load(base, model, prompts, args.max_tokens, rate))
                rec = summarize(load, res, origin, args.max_tokens)
            except Exception as e:
                traceback.print_exc()
                rec = dict(load=load, error=f"{type(e).__name__}: {e}"[:300])
            rec.update(
                server_args=args.server_args,
                prompt_tokens=args.prompt_tokens,
                max_tokens=args.max_tokens,
                max_running_prompts=args.max_running_prompts,
            )
            print({k: round(v, 4) if isinstance(v, float) else v for k, v in rec.items()}, flush=True)
            records.append(rec)
            if proc.poll() is not None:
                print(f"server died (code {proc.returncode})", flush=True)
                break
        if args.greedy_out and proc.poll() is None:
            import httpx

            prompts = models.random_prompts(32, args.prompt_tokens, vocab, seed=7)
            texts = [httpx.post(base + "/v1/completions", timeout=300, json={
                "model": model, "prompt": p, "max_tokens": 64, "temperature": 0.0, "ignore_eos": True,
            }).json()["choices"][0]["text"] for p in prompts]
            with open(args.greedy_out, "w") as f:
                json.dump(texts, f)
    except Exception as e:
        traceback.print_exc()
        records.append(dict(load="startup", error=f"{type(e).__name__}: {e}"[:300]))
    finally:
        stop_server(proc)
        log.flush()
        log.seek(0)
        tail = log.read()[-3000:]
        log.close()
        if any("error" in r for r in records):
            print(f"--- server log tail ({log.name}) ---\n{tail}\n---", flush=True)
        print(f"server exited with code {proc.returncode}", flush=True)

    cols = ["load", "requests", "failed", "output_tokens", "wall_s", "tok_s", "req_s", "ttft_p50_ms", "ttft_p90_ms",
            "ttft_p99_ms", "tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms", "error"]  # fmt: skip
    print_table(records, cols)
    print(f"total {time.perf_counter() - t_start:.0f}s", flush=True)
    if not args.no_save and not args.smoke:
        env = env_info()
        env["shape"] = "qwen3-0.6b"
        print("results:", append_jsonl("serve", records, env))


if __name__ == "__main__":
    main()
