"""Host time of a steady speculative step (MTP, ``--speculative-tokens K``) by batch, against a plain decode step's.

    python bench/spec_host.py                         # CPU: a tiny Qwen3.5 (hidden 16), batches 1, 16, 64, 128
    python bench/spec_host.py --batches 1,64 --k 3
    python bench/spec_host.py --smoke                 # CPU: checks the script (batches 1 and 4, few steps)

Where speculation's step waits on the host. A steady step (every row verifying K drafts) plans, builds its inputs,
replays the verify, sampling, replay and chain graphs and reads their outputs back; every host moment between those
is time the GPU idles (nothing is queued ahead of a speculative step), so it adds to each step as it is. On the CPU
the device work runs eagerly inside the bodies that CUDA graphs replay on a GPU (``verify_body``, ``sample_body``,
``replay_body``, ``chain_body``, every module call, the samplers): ``host_ms`` is a step's wall time less the time
spent in them, what the same Python costs beside graph replays (the GPU adds its copies and launches). The plain
engine's step (one decode step a round, eager; ``decode_steps`` 1) is the baseline, measured alike
(``host_vs_plain``). ``phases``: the speculative step's host time by the function it is spent in (each less the
functions it calls that are listed too). A tiny model keeps the device bodies short, so the split is clean; on a GPU
the bodies are graph replays and ``host_ms`` also holds the waits inside the reads back (the phase that reads).
One JSON line per (engine, batch) to bench/results/spec_host.jsonl (not with ``--smoke``).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import append_jsonl, env_info, print_table  # noqa: E402

TINY = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            head_dim=8, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
            linear_value_head_dim=8, full_attention_interval=2, mtp_num_hidden_layers=1)  # fmt: skip


class Spent:
    """Time per label of wrapped functions, each less the wrapped functions it calls (``BODY``: device work)."""

    def __init__(self):
        self.acc, self.stack, self.undo = collections.Counter(), [], []

    def wrap(self, owner, name: str, label: str | None = None) -> None:
        fn, label = getattr(owner, name), label or name

        def timed(*a, **kw):
            t = time.perf_counter()
            self.stack.append(0.0)
            try:
                return fn(*a, **kw)
            finally:
                dt, inner = time.perf_counter() - t, self.stack.pop()
                self.acc[label] += dt - inner
                if self.stack:
                    self.stack[-1] += dt

        setattr(owner, name, timed)
        self.undo.append((owner, name, fn))

    def restore(self) -> None:
        for owner, name, fn in reversed(self.undo):
            setattr(owner, name, fn)


def instrument() -> Spent:
    """Wrap the device bodies (``BODY``) and the speculative step's host functions."""
    import areno.engine.model_runner as mr
    import areno.engine.spec_chain as sc
    import areno.engine.spec_decode as sd
    import areno.engine.spec_exec as se
    import areno.engine.spec_graphs as sg
    import areno.engine.spec_sample as ss
    from areno.engine.scheduler import Scheduler

    s = Spent()
    for owner, name in [(sg, "verify_body"), (sg, "replay_body"), (ss, "sample_body"), (sc, "chain_body"),
                        (torch.nn.Module, "__call__"), (sd, "verify_draft"), (mr, "sample"),
                        (mr.ModelRunner, "logits")]:  # fmt: skip
        s.wrap(owner, name, "BODY")
    for name in ("_plan", "_prepare", "_verify", "_redo", "_append", "_catch_up", "_run"):
        s.wrap(sd.SpecDecoder, name)
    for owner, name in [(se.SpecExec, "target"), (se.SpecExec, "finish"), (sg.VerifyGraphs, "run"),
                        (sg.VerifyGraphs, "roll_back"), (sg, "verify_host"), (sc, "chain_host"), (se, "run_chain"),
                        (Scheduler, "schedule"), (Scheduler, "after_step")]:  # fmt: skip
        s.wrap(owner, name)
    return s


def measure(engine, prompts, opts, spent: Spent, repeats: int) -> dict:
    """The warm call's steps (best of ``repeats``): wall and host ms a step, host by phase."""
    engine.generate(prompts, opts)  # warm: first-call work (allocation, kernels) out of the timing
    best = None
    for _ in range(repeats):
        spent.acc.clear()
        steps0 = sum(engine.step_counts.values())
        spent.wrap(engine, "step", "step")  # the step's own lines (an instance attribute: undone below)
        t = time.perf_counter()
        try:
            engine.generate(prompts, opts)
        finally:
            del engine.step
            spent.undo.pop()
        wall = time.perf_counter() - t
        steps = sum(engine.step_counts.values()) - steps0
        host = wall - spent.acc["BODY"]
        if best is None or host < best[1]:
            best = (wall, host, steps, {k: v for k, v in spent.acc.items() if k != "BODY"})
    wall, host, steps, phases = best
    return {"steps": steps, "wall_ms": 1e3 * wall / steps, "host_ms": 1e3 * host / steps,
            "phases": {k: round(1e3 * v / steps, 4) for k, v in sorted(phases.items(), key=lambda kv: -kv[1])}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default=None, help="sequences decoding together, comma-separated (default "
                    "1,16,64,128; --smoke: 1,4)")
    ap.add_argument("--k", type=int, default=2, help="draft tokens a step (--speculative-tokens)")
    ap.add_argument("--new", type=int, default=None, help="tokens each sequence generates (greedy, no early stop; "
                    "default 100, --smoke 12)")
    ap.add_argument("--repeats", type=int, default=None, help="timed calls per engine and batch, the best kept "
                    "(default 3, --smoke 1)")
    ap.add_argument("--smoke", action="store_true", help="the defaults above made small, nothing saved: checks the "
                    "script")
    args = ap.parse_args(argv)
    small = args.smoke  # --smoke changes the defaults only: a size given is used as given
    args.batches = args.batches if args.batches is not None else ("1,4" if small else "1,16,64,128")
    args.new = args.new if args.new is not None else (12 if small else 100)
    args.repeats = args.repeats if args.repeats is not None else (1 if small else 3)
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        ap.error(f"--batches takes comma-separated sizes, got {args.batches!r}")
    if min(batches) < 1 or args.k < 1 or args.new < 2 or args.repeats < 1:
        ap.error("--batches sizes, --k and --repeats take 1 or more, --new 2 or more")

    from areno.config import SamplingParams
    from areno.engine.engine import Engine, EngineConfig
    from areno.models import load_model
    from areno.testing import make_tiny_checkpoint

    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(make_tiny_checkpoint(tmp, "qwen3_5", seed=0, **TINY), device=device)
    spent, records = instrument(), []
    try:
        for b in batches:
            prompts = [[5 + i % 50, 6, 7, 8, 9, 10, 11, 12] for i in range(b)]
            opts = [SamplingParams(temperature=0.0, max_new_tokens=args.new, ignore_eos=True) for _ in range(b)]
            rows = {}
            for impl, k in (("plain", 0), ("speculative", args.k)):
                engine = Engine(model, None, EngineConfig(speculative_tokens=k, speculative_disable_by_batch_size="off",
                                                          decode_steps=1, block_size=16, max_running=max(4, b)),
                                eos_token_ids=[])  # fmt: skip
                rec = measure(engine, prompts, opts, spent, args.repeats)
                rows[impl] = dict(impl=impl, model="qwen3_5-tiny", batch=b, k=k, **rec,
                                  host_per_row_us=1e3 * rec["host_ms"] / b)
                engine.drop_rollout_state()
            rows["speculative"]["host_vs_plain"] = rows["speculative"]["host_ms"] / rows["plain"]["host_ms"]
            records += list(rows.values())
    finally:
        spent.restore()
    print_table(records, ["impl", "batch", "k", "steps", "wall_ms", "host_ms", "host_per_row_us", "host_vs_plain"])
    for r in records:
        if r["impl"] == "speculative":
            top = list(r["phases"].items())[:6]
            print(f"batch {r['batch']}: " + ", ".join(f"{k} {v:.3f}" for k, v in top) + " (ms a step)")
    if not args.smoke:
        print("results:", append_jsonl("spec_host", records, env_info()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
