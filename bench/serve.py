"""Serving: the real ``areno serve`` process under 500 streamed completions, at unlimited load and at 16 requests/s,
against the engine alone on the same batch in the same run.

    python bench/serve.py               # H200: Qwen3-0.6B shape, random bf16 weights (about 3 minutes)
    python bench/serve.py --smoke       # CPU: a tiny shape, 20 short requests (times meaningless)

The server runs in a subprocess exactly as a user starts it: ``python -m areno serve --model-path <ckpt> --port P
--max-running-prompts 256`` (CUDA graphs on). Each request is ``POST /v1/completions`` with a prompt of 512 random
token ids, ``max_tokens 128``, ``temperature 1``, ``ignore_eos: true`` (so every request makes 128 tokens),
``stream: true`` with ``stream_options.include_usage``. The checkpoint's word-level tokenizer decodes every id to a
word, so every token carries text.

The load generator is ``--clients`` processes (default 4; 1 with --smoke), each a plain asyncio HTTP/1.1 client (one
connection per request, chunked SSE parsed by hand): one Python client process parsing every chunk of 500 streams
would measure the client, not the server.

- TTFT: request sent -> first chunk carrying text. TPOT: (last text chunk - first) / (completion tokens - 1).
- Output tokens/s: completion tokens of all requests / (last response end - first request sent).
- Loads: all 500 requests at once ("unlimited", prompts of seed 0), then Poisson arrivals at 16 requests/s (arrival
  seed 0, prompts of seed 1: no prefix-cache hits; 500 requests take about 31 s, so output is capped near
  16 x 128 = 2k tok/s there and latency is the number to read).
- Engine only (``--engine-only``, on by default): before the server starts, a separate process builds the engine as
  the server does (``build_engine``, same --max-running-prompts, --eager-decode) and runs ``Engine.generate`` on the
  same warm-up prompts, then on the same measured prompts with the same sampling options, all at once; its output
  tokens/s is written as ``engine_tok_s`` on the unlimited record with ``vs_engine`` = HTTP tok/s / engine tok/s.
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


async def one_request(host, port, body: bytes, start_at, t_origin) -> dict:
    """One streamed completion over its own connection: plain HTTP/1.1, chunked SSE parsed by hand."""
    delay = t_origin + start_at - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    sent = time.perf_counter()
    times, usage, err, writer = [], None, None, None
    try:
        reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (host.encode(), port, len(body), body))
        status = await reader.readline()
        headers = (await reader.readuntil(b"\r\n\r\n")).lower()
        chunked = b"transfer-encoding: chunked" in headers
        if b" 200 " not in status:
            err = f"HTTP {status.decode().strip()}: {(await reader.read(300))!r}"
        buf, done = b"", err is not None
        while not done:
            if chunked:
                size = int((await reader.readline()).split(b";")[0], 16)
                if size == 0:
                    break
                data = (await reader.readexactly(size + 2))[:-2]
            else:
                data = await reader.read(1 << 16)
                if not data:
                    break
            now = time.perf_counter()
            buf += data
            *events, buf = buf.split(b"\n\n")
            for event in events:
                if not event.startswith(b"data: "):
                    continue
                payload = event[6:]
                if payload == b"[DONE]":
                    done = True
                    break
                obj = json.loads(payload)
                if "error" in obj:
                    err = str(obj["error"])[:200]
                elif obj.get("choices") and obj["choices"][0].get("text"):
                    times.append(now)
                if obj.get("usage"):
                    usage = obj["usage"]["completion_tokens"]
    except Exception as e:  # a failed request is counted, not fatal
        err = f"{type(e).__name__}: {e}"[:200]
    finally:
        if writer is not None:
            writer.close()
    end = time.perf_counter()
    tokens = usage if usage is not None else len(times)
    out = {"sent": sent, "end": end, "tokens": tokens, "error": err}
    if times:
        out["ttft"] = times[0] - sent
        if tokens > 1:
            out["tpot"] = (times[-1] - times[0]) / (tokens - 1)
    return out


def client_main(host, port, bodies, starts, origin, results) -> None:
    """One client process: its share of the requests, on its own event loop; results by request index."""

    async def run():
        return await asyncio.gather(*(one_request(host, port, b, s, origin) for b, s in zip(bodies, starts)))

    results.put(asyncio.run(run()))


def run_load(base, model, prompts, max_tokens, rate, clients, seed=0) -> tuple[list[dict], float]:
    """``model``: the served name, or a list of names taken in turn (LoRA adapters, ``bench/serve_lora.py``). Send every
    prompt (all at once when ``rate`` is None, else Poisson at ``rate``/s) from ``clients`` processes
    (round robin); returns the results and the origin time (perf_counter: one clock for every process on Linux)."""
    import multiprocessing as mp

    rng = random.Random(seed)
    t, starts = 0.0, []
    for _ in prompts:
        starts.append(t if rate else 0.0)
        if rate:
            t += rng.expovariate(rate)
    names = [model] if isinstance(model, str) else list(model)  # several: request i asks for names[i % len(names)]
    bodies = [json.dumps({"model": names[i % len(names)], "prompt": p, "max_tokens": max_tokens, "temperature": 1.0,
                          "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}).encode()
              for i, p in enumerate(prompts)]
    host, port = base.split("//")[1].rsplit(":", 1)
    ctx = mp.get_context("fork")  # nothing here has touched CUDA; the children only speak HTTP
    results = ctx.Queue()
    origin = time.perf_counter() + 1.0  # every client process is up and waiting by then
    procs = [ctx.Process(target=client_main, args=(host, int(port), bodies[c::clients], starts[c::clients], origin,
                                                   results), daemon=True) for c in range(clients)]
    for proc in procs:
        proc.start()
    shares = [results.get() for _ in procs]
    for proc in procs:
        proc.join()
    return [r for share in shares for r in share], origin


def engine_only_main(path, prompts_warm, prompts, max_tokens, args_dict, results) -> None:
    """The engine alone (a process of its own, so its GPU memory is gone before the server starts): built as the
    server builds it, ``generate`` on the warm-up batch, then on the measured batch; puts (tokens, seconds)."""
    try:
        import torch

        from areno.config import SamplingParams
        from areno.engine.build import build_engine

        engine, _ = build_engine(path, max_running=args_dict["max_running_prompts"],
                                 eager_decode=args_dict["eager"], seed=0)
        opts = SamplingParams(temperature=1.0, max_new_tokens=max_tokens, ignore_eos=True)
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        engine.generate(prompts_warm, opts)
        sync()
        t0 = time.perf_counter()
        out = engine.generate(prompts, opts)
        sync()
        dt = time.perf_counter() - t0
        results.put((sum(len(c.token_ids) for group in out for c in group), dt, None))
    except Exception as e:
        traceback.print_exc()
        results.put((0, 0.0, f"{type(e).__name__}: {e}"[:300]))


def engine_only(path, prompts_warm, prompts, max_tokens, args) -> dict:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=engine_only_main, args=(str(path), prompts_warm, prompts, max_tokens,
                                                      {"max_running_prompts": args.max_running_prompts,
                                                       "eager": args.eager}, results))
    proc.start()
    tokens, dt, err = results.get()
    proc.join()
    rec = {"engine_output_tokens": tokens, "engine_wall_s": dt, "engine_tok_s": tokens / dt if dt else None}
    if err:
        rec["engine_error"] = err
    return rec


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
    worst = sorted((r for r in ok if "ttft" in r), key=lambda r: -r["ttft"])[:8]
    rec["ttft_worst"] = [[round(r["sent"] - origin, 3), round(r["ttft"] * 1e3, 1)] for r in worst]  # [sent at s, ms]
    errors = [r["error"] for r in results if r["error"]]
    if errors:
        rec["error"] = f"{len(errors)} failed, e.g. {errors[0]}"
    return rec


def add_load_args(ap) -> None:
    """The load's flags (bench/serve.py and bench/serve_lora.py); ``fill_load_defaults`` after parsing."""
    ap.add_argument("--smoke", action="store_true", help="tiny shape, few short requests (checks the script)")
    ap.add_argument("--requests", type=int, default=None, help="500 (20 with --smoke)")
    ap.add_argument("--prompt-tokens", type=int, default=None, help="512 (32 with --smoke)")
    ap.add_argument("--max-tokens", type=int, default=None, help="128 (8 with --smoke)")
    ap.add_argument("--max-running-prompts", type=int, default=256)
    ap.add_argument("--eager", action="store_true", help="server with --eager-decode")
    ap.add_argument("--startup-timeout-s", type=float, default=300)
    ap.add_argument("--clients", type=int, default=None, help="client processes (4; 1 with --smoke)")


def fill_load_defaults(args) -> None:
    for name, full, smoke in (("requests", 500, 20), ("prompt_tokens", 512, 32), ("max_tokens", 128, 8),
                              ("clients", 4, 1)):
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else full)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_load_args(ap)
    ap.add_argument("--rates", default="inf,16", help="comma list of requests/s; inf = all at once")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--no-save", action="store_true", help="do not append to bench/results/serve.jsonl")
    ap.add_argument("--server-args", default="", help="more areno serve flags, e.g. '--world-size 2 --tp-size 2'")
    ap.add_argument("--no-engine-only", action="store_true",
                    help="skip the engine-only run of the same batch (engine_tok_s, vs_engine)")
    ap.add_argument("--greedy-out", default=None,
                    help="after the loads, write the greedy completions of 32 fixed prompts (64 tokens) here (JSON)")
    args = ap.parse_args()
    fill_load_defaults(args)
    shape = models.shape_of(args.smoke)
    t_start = time.perf_counter()
    path = models.checkpoint(args.smoke)
    print(f"checkpoint {path} ({time.perf_counter() - t_start:.1f}s)", flush=True)
    rates = [None if r in ("inf", "unlimited") else float(r) for r in args.rates.split(",")]
    vocab = shape["vocab_size"]
    warm_all = models.random_prompts(args.requests, args.prompt_tokens, vocab, seed=99)
    prompts = models.random_prompts(args.requests, args.prompt_tokens, vocab, seed=0)
    engine = None
    if not args.no_engine_only and None in rates:  # before the server: the GPU is all the engine's
        t0 = time.perf_counter()
        engine = engine_only(path, warm_all, prompts, args.max_tokens, args)
        print(f"engine only ({time.perf_counter() - t0:.1f}s): {engine}", flush=True)

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    records = []
    log = tempfile.NamedTemporaryFile("w+", prefix="areno-serve-", suffix=".log", delete=False)
    proc = start_server(path, port, args, log)
    try:
        model = wait_ready(proc, base, args.startup_timeout_s)
        print(f"server ready in {time.perf_counter() - t_start:.1f}s, model {model!r}", flush=True)
        for rate in rates:
            load = "unlimited" if rate is None else f"{rate:g} req/s"
            try:
                if not args.no_warmup:  # same pattern, fewer requests: graph capture and kernel compilation
                    t0 = time.perf_counter()
                    n_warm = args.requests if rate is None else max(4, int(3 * rate))
                    warm = warm_all[:n_warm]
                    res, origin = run_load(base, model, warm, args.max_tokens, rate, args.clients, seed=99)
                    w = summarize(load, res, origin, args.max_tokens)
                    print(
                        f"warm-up {load}: {len(warm)} requests in {time.perf_counter() - t0:.1f}s"
                        f"{', ' + w['error'] if 'error' in w else ''}",
                        flush=True,
                    )
                # the engine-only batch at unlimited load; fresh prompts at a rate (no prefix-cache hits)
                batch = prompts if rate is None else models.random_prompts(args.requests, args.prompt_tokens, vocab,
                                                                            seed=1)
                res, origin = run_load(base, model, batch, args.max_tokens, rate, args.clients)
                rec = summarize(load, res, origin, args.max_tokens)
                if rate is None and engine is not None:  # the same batch through the engine alone, this run
                    rec.update(engine)
                    if rec.get("tok_s") and engine.get("engine_tok_s"):
                        rec["vs_engine"] = rec["tok_s"] / engine["engine_tok_s"]
            except Exception as e:
                traceback.print_exc()
                rec = dict(load=load, error=f"{type(e).__name__}: {e}"[:300])
            rec.update(
                server_args=args.server_args,
                prompt_tokens=args.prompt_tokens,
                max_tokens=args.max_tokens,
                max_running_prompts=args.max_running_prompts,
                clients=args.clients,
            )
            print({k: round(v, 4) if isinstance(v, float) else v for k, v in rec.items()}, flush=True)
            records.append(rec)
            if proc.poll() is not None:
                print(f"server died (code {proc.returncode})", flush=True)
                break
        if args.greedy_out and proc.poll() is None:
            import httpx

            greedy = models.random_prompts(32, args.prompt_tokens, vocab, seed=7)
            texts = [httpx.post(base + "/v1/completions", timeout=300, json={
                "model": model, "prompt": p, "max_tokens": 64, "temperature": 0.0, "ignore_eos": True,
            }).json()["choices"][0]["text"] for p in greedy]
            with open(args.greedy_out, "w") as f:
                json.dump(texts, f)
    except Exception as e:
        traceback.print_exc()
        records.append(dict(load="startup", error=f"{type(e).__name__}: {e}"[:300]))
    finally:
        stop_server(proc)
        log.flush()
        log.seek(0)
        full = log.read()
        tail = full[-3000:]
        if os.environ.get("ARENO_TRACE_STEPS_MS"):  # the server's stall trace (areno/serve/replica_worker.py)
            print("--- server stall trace ---", *[ln for ln in full.splitlines() if "slow step" in ln
                                                  or "triton compiled" in ln][:200], sep="\n", flush=True)
        log.close()
        if any("error" in r for r in records):
            print(f"--- server log tail ({log.name}) ---\n{tail}\n---", flush=True)
        print(f"server exited with code {proc.returncode}", flush=True)

    cols = ["load", "requests", "failed", "output_tokens", "wall_s", "tok_s", "engine_tok_s", "vs_engine", "req_s",
            "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms", "error"]
    print_table(records, cols)
    for r in records:
        print(f"{r['load']}: slowest TTFTs [sent at s, ms]: {r.get('ttft_worst')}", flush=True)
    print(f"total {time.perf_counter() - t_start:.0f}s", flush=True)
    if not args.no_save and not args.smoke:
        env = env_info()
        env["shape"] = "qwen3-0.6b"
        print("results:", append_jsonl("serve", records, env))


if __name__ == "__main__":
    main()
