"""Shared bench helpers: environment record, GPU timing, a plain text table and JSON-line results.

Every bench script appends one JSON line per measurement to ``bench/results/<name>.jsonl``, each carrying
``env_info()`` (git sha, GPU, versions) so that numbers from different runs can be told apart.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def git_sha() -> str:
    """The commit measured: ``ARENO_GIT_SHA`` when set (a copy of the tree whose own .git is stale, e.g. the GPU
    machine's), else ``git rev-parse`` here, "-dirty" with uncommitted changes to tracked files."""
    if os.environ.get("ARENO_GIT_SHA", "").strip():
        return os.environ["ARENO_GIT_SHA"].strip()
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
        sha = out.stdout.strip() or "unknown"
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except Exception:
        return "unknown"


def env_info() -> dict:
    """Where and with what a measurement was taken."""
    try:
        import triton

        triton_version = triton.__version__
    except Exception:
        triton_version = None
    cuda = torch.cuda.is_available()
    return {
        "git_sha": git_sha(),
        "gpu": torch.cuda.get_device_name(0) if cuda else "cpu",
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "python": platform.python_version(),
        "host": platform.node(),
        "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def gpu_time_ms(fn, *, warmup: int = 5, iters: int = 20, min_time_s: float = 0.0) -> float:
    """Median wall time of ``fn()`` in ms, timed with CUDA events (falls back to perf_counter on CPU)."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    # Flush L2 between iterations so bandwidth-bound ops are not timed out of cache.
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    times = []
    start_all = time.perf_counter()
    while len(times) < iters or time.perf_counter() - start_all < min_time_s:
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_replay(fn):
    """Capture one ``fn()`` call as a CUDA graph (after a warm-up call on a side stream: autotuning and allocations
    stay outside the capture); returns the graph's ``replay``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def print_table(rows: list[dict], columns: list[str]) -> None:
    """Left-aligned text table of ``rows`` over ``columns`` (floats shown with 3 significant decimals)."""

    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 1e4 else f"{v:.0f}"
        return "" if v is None else str(v)

    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def command_line() -> str:
    """How this process was started, as a user would retype it: ``python bench/x.py --flag ...``."""
    script = Path(sys.argv[0])
    try:
        script = script.resolve().relative_to(Path.cwd())
    except ValueError:
        pass
    return " ".join(["python", str(script), *sys.argv[1:]])


def append_jsonl(name: str, records: list[dict], env: dict | None = None) -> Path:
    """Append ``records`` (each merged with ``env`` and, unless a record names its own, the ``command`` that ran) as
    JSON lines to ``bench/results/<name>.jsonl``."""
    env = {"command": command_line(), **(env_info() if env is None else env)}
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.jsonl"
    with open(path, "a") as f:
        for rec in records:
            f.write(json.dumps({"bench": name, **env, **rec}) + "\n")
    return path


def weight_gemm_bench(name: str, doc: str, shapes, ms, smoke_shapes, smoke_ms, prepare, measure,
                      columns: list[str]) -> None:  # fmt: skip
    """The driver of the quantised-weight GEMM benches (nf4_gemm, fp8_gemm): ``--smoke`` (tiny shapes, CPU, fp32)
    or the GPU (bf16); for each ``(shape name, K, N)`` a weight ``W [N, K] ~ N(0, 1/K)``, ``q = prepare(W)``, then
    ``measure(shape name, W, q, M, cuda)`` rows for every M; a table, and the rows to ``bench/results/<name>.jsonl``."""
    import argparse

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on any device (checks the script)")
    ap.add_argument("--shapes", default=None, help="comma-separated shape names to run (default: all)")
    ap.add_argument("--ms", default=None, help="comma-separated row counts M (default: the bench's)")
    args = ap.parse_args()
    if args.shapes and args.smoke:
        sys.exit("--shapes picks among the GPU shapes; --smoke runs its own tiny one")
    if args.shapes:
        known = {s[0] for s in shapes}
        unknown = sorted(set(args.shapes.split(",")) - known)
        if unknown:
            sys.exit(f"--shapes: unknown {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        shapes = [s for s in shapes if s[0] in args.shapes.split(",")]
    if args.ms:
        ms = smoke_ms = [int(v) for v in args.ms.split(",")]
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        sys.exit(f"bench/{name}.py needs a CUDA device (or --smoke with TRITON_INTERPRET=1)")
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    rows = []
    for shape, k, n in smoke_shapes if args.smoke else shapes:
        w = (torch.randn(n, k, device=device) * k**-0.5).to(dtype)
        q = prepare(w)
        for m in smoke_ms if args.smoke else ms:
            rows += measure(shape, w, q, m, cuda)
        if cuda:
            torch.cuda.empty_cache()
    print_table(rows, columns)
    if not args.smoke:
        print(append_jsonl(name, rows, env_info()))


def time_ms(fn, cuda: bool) -> float:
    """``gpu_time_ms(fn)`` on a GPU; one call without warm-up on the CPU (smoke runs: the time means nothing)."""
    return gpu_time_ms(fn) if cuda else gpu_time_ms(fn, warmup=0, iters=1)


def gemm_row(fn, ref: torch.Tensor, cuda: bool, m: int, n: int, k: int, graph: bool = True, **fields) -> dict:
    """One GEMM bench row: ``fields``, then ``fn``'s time, its TFLOP/s (2 M N K) and its max abs error against
    ``ref``. On a GPU also ``graph_ms``: the same call replayed from a CUDA graph, as decode runs it (the eager time
    of a call of a few microseconds can be the host's launches: Triton's launcher, several kernels a call); None
    where the call cannot be captured (``graph=False``: not taken)."""
    err = (fn().float() - ref.float()).abs().max().item()
    ms = time_ms(fn, cuda)
    row = {**fields, "M": m, "N": n, "K": k, "ms": round(ms, 4), "tflops": round(2 * m * n * k / ms / 1e9, 2),
           "max_abs_err": err}
    if cuda and graph:
        row["graph_ms"] = graph_time_ms(fn, fields)
    return row


def graph_time_ms(fn, what) -> float | None:
    """``gpu_time_ms`` of ``fn()`` replayed from a CUDA graph (rounded); None, said on stdout, where the call
    cannot be captured (``what``: names it)."""
    try:
        replay = graph_replay(fn)
    except RuntimeError as e:  # e.g. a host sync inside the call
        print(f"graph capture failed for {what}: {e}", flush=True)
        torch.cuda.synchronize()
        return None
    return round(gpu_time_ms(replay), 4)


@contextlib.contextmanager
def step_times(engine):
    """Host wall time of the call's ``Engine.step`` calls by kind, into the yielded dict: ``step_s_chained`` (steps
    that ran chained decode groups, speculation's gated chains among them), ``step_s_verify`` (steps that verified
    drafts), ``step_s_single`` (the others: prefill and mixed steps, single plain decode steps). A step returns once
    its tokens are read, so the sums split the call's time (a queued lookahead group's time falls to the step that
    reads it)."""
    spent, step = {"step_s_chained": 0.0, "step_s_verify": 0.0, "step_s_single": 0.0}, engine.step

    def timed(*a, **kw):
        chained, rows = engine.step_counts.get("chained", 0), engine.spec.counts["verify_rows"] if engine.spec else 0
        t = time.perf_counter()
        try:
            return step(*a, **kw)
        finally:
            dt = time.perf_counter() - t
            if engine.step_counts.get("chained", 0) > chained:
                spent["step_s_chained"] += dt
            elif engine.spec is not None and engine.spec.counts["verify_rows"] > rows:
                spent["step_s_verify"] += dt
            else:
                spent["step_s_single"] += dt

    engine.step = timed
    try:
        yield spent
    finally:
        del engine.step


def tiles(text: str) -> list[tuple[int, int]]:
    """``AxW,...`` (e.g. ``8x8,2x8``: a kernel's tile size, rows or value columns, and its warps) -> [(a, w)], an
    argparse type: each a power of two (a ``tl.arange`` length), the warps at most 32."""
    out = []
    for item in filter(None, text.split(",")):
        a, _, w = item.partition("x")
        ok = a.isdigit() and w.isdigit() and int(a) > 0 and int(w) <= 32 and all(
            int(x) > 0 and int(x) & (int(x) - 1) == 0 for x in (a, w))
        if not ok:
            raise argparse.ArgumentTypeError(f"expected SIZExWARPS, each a power of two (warps up to 32), got {item!r}")
        out.append((int(a), int(w)))
    return out
