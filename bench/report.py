"""Generate bench/RESULTS.md from the JSON lines in bench/results/*.jsonl (``--check``: exit 1 if it is stale).

    python bench/report.py            # rewrite bench/RESULTS.md
    python bench/report.py --check    # exit 1 when bench/RESULTS.md differs from what the rows give

One table per workload and bench script. The CURRENT rows only: for every key (the bench's workload, implementation
and shape fields, ``Spec.keys``, and the GPU model) the rows of its latest run (a run: one ``git_sha`` on one day),
one per setting that run compared (``Spec.variants``), the latest; older rows stay in the jsonl. Every cell is a field
of that row (floats rounded): the measurements (``Spec.metrics``), the baseline ratios the bench computed in the same
run (``Spec.ratios``), the commit (``git_sha``), date, GPU, versions and the command (the row's own
``command``, else the bench's documented default, marked "(default)"). Files without a ``bench`` field (the
per-step logs of bench/learn.py) are not benchmark rows and are skipped. The chronicle is bench/HISTORY.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
RESULTS_MD = BENCH_DIR / "RESULTS.md"

# the tables' order: BENCH.md's workloads first, the rest after them by name
ORDER = ("K1", "K2", "K3", "T1", "T2", "R1", "R2", "R3", "G1", "S1", "V1", "A1")


@dataclass(frozen=True)
class Spec:
    """How one bench's rows become table rows."""

    command: str  # the bench's default command, for rows that do not record theirs
    keys: tuple[str, ...]  # what is measured: implementation and shape (besides the workload)
    metrics: tuple[str, ...]
    ratios: tuple[str, ...] = ()  # baseline ratios computed in the same run, as the row holds them
    workload: str = ""  # the workload of rows without a ``workload`` field ("" = the bench's name)
    skip: tuple[tuple[str, str], ...] = ()  # (field, value): rows not tabled (e.g. per-config sweeps)
    variants: tuple[str, ...] = ()  # settings one run may compare side by side (e.g. graphs off/on)


# fmt: off
SPECS = {  # bench: Spec(default command, keys, metrics, ratios, workload, skip, variants)
    "agentic": Spec("python bench/agentic.py", ("sessions", "turns"),
        ("single_tok_s", "agentic_tok_s", "prefill_tokens_per_turn", "forks"), ratios=("ratio",), workload="A1",
        variants=("repeat",)),
    "attention": Spec("python bench/attention.py",
        ("impl", "seq", "batch", "heads_q", "heads_kv", "head_dim", "ctx", "block_size", "kv_cache_dtype", "config"),
        ("fwd_ms", "bwd_ms", "fwdbwd_ms", "fwdbwd_tflops", "fwdbwd_frac_peak", "ms", "GB/s", "frac_copy_bw"),
        ratios=("speedup_vs_flash", "speedup_vs_cudnn", "bwd_speedup_vs_cudnn"),
        skip=(("workload", "paged_decode_rollout_sweep"),)),
    "attention_gluon": Spec("python bench/attention_gluon.py", ("kernel", "impl"),
        ("ms", "tflops", "max_diff_vs_tma", "max_diff_vs_first"), workload="K1 Gluon"),
    "batch_invariance": Spec("python bench/batch_invariance.py", ("projection", "impl", "K", "N"),
        ("same_rows", "worst_diff", "us_m1", "us_m3"), workload="batch invariance (9B decode GEMMs)"),
    "decode_profile": Spec("python bench/decode_profile.py", ("seqs", "new_tokens"),
        ("tok_s", "step_ms", "host_ms", "gpu_ms", "post_ms", "tokens_per_step"), workload="R1 decode profile",
        variants=("graph", "decode_steps")),
    "delta_rule": Spec("python bench/delta_rule.py", ("impl", "gate", "seq", "heads", "K", "V", "chunk"),
        ("fwd_ms", "fwdbwd_ms", "tokens_per_s", "fwdbwd_tflops", "peak_gib"),
        ratios=("speedup_vs_native", "max_abs_diff_vs_native")),
    "gdn_decode": Spec("python bench/gdn_decode.py", ("impl", "state_dtype", "BV", "num_warps", "rows"),
        ("ms", "gb_s", "hbm_frac", "error"), workload="Qwen3.5 decode step"),
    "kernel_resources": Spec("python bench/kernel_resources.py", ("kernel", "state_dtype", "BV", "rows", "num_warps",
        "arch"), ("registers", "stack_bytes", "spill_store_bytes", "spill_load_bytes", "resident_warps"),
        workload="kernel registers and spills (ptxas, no GPU)"),
    "families": Spec("python bench/families.py", ("impl", "shape", "layers", "sequences", "batch", "seqlen"),
        ("tok_s", "wall_s", "step_s_single", "step_s_chained", "decode_ms", "decode_floor_ms", "step_ms", "mfu",
         "peak_gib", "loop_ms", "logprob_diff_mean", "error"),
        ratios=("speedup_vs_hf", "memory_vs_hf", "loop_speedup_vs_hf", "decode_frac_floor"),
        variants=("call", "optimizer_states", "adamw8bit_tile", "mamba_ssm_cache_dtype")),
    "fp8_gemm": Spec("python bench/fp8_gemm.py", ("shape", "path", "M", "K", "N"),
        ("ms", "graph_ms", "tflops", "weight_gb_s", "max_abs_err", "weight_mb"), workload="FP8 block GEMM"),
    "nf4_gemm": Spec("python bench/nf4_gemm.py", ("shape", "op", "path", "M", "K", "N"),
        ("ms", "graph_ms", "tflops", "max_abs_err", "weight_mb"), workload="NF4 GEMM"),
    "gemm": Spec("python bench/gemm.py", ("shape", "impl", "M", "K", "N"),
        ("us", "GB/s", "TFLOP/s", "frac_floor", "tiny_kernel_us"), skip=(("impl", "sweep"),)),
    "grpo_step": Spec("python bench/grpo_step.py", ("impl", "shape"),
        ("step_s", "rollout_s", "reward_s", "pack_s", "logprob_s", "train_s", "other_s", "peak_gib", "logprob_diff"),
        ratios=("speedup_vs_trl", "speedup_vs_bf16"), workload="G1",
        variants=("checkpointing", "train_cuda_graphs", "rollout_dtype", "kv_cache_dtype")),
    "k1_timing": Spec("python bench/k1_timing.py", ("impl", "batch", "seq"),
        ("eager_ms", "graph_ms", "kernel_ms", "host_ms", "paired_eager_ms", "paired_graph_ms"),
        ratios=("eager_x_cudnn", "graph_x_cudnn", "paired_graph_x_cudnn", "paired_graph_x_cudnn_range")),
    "learn": Spec("python bench/learn.py", ("stage",),
        ("accuracy_before", "accuracy_after", "gain_points", "wall_s"), ratios=("gap_vs_bf16_points",),
        workload="learning check",
        variants=("task",)),
    "lora_step": Spec("python bench/lora_step.py", ("impl", "shape", "quantize_base"),
        ("step_s", "rollout_s", "logprob_s", "train_s", "reward_s", "pack_s", "other_s", "peak_gib", "reserved_gib",
         "build_s", "load_peak_gib", "error"), ratios=("areno_speedup",), workload="LoRA GRPO step",
        variants=("checkpointing",)),
    "logprob": Spec("python bench/logprob.py", ("impl", "N", "H", "V"),
        ("ms", "peak_extra_GiB", "TFLOPs", "floor_frac"), ratios=("speedup_vs_torch", "mem_frac_of_torch")),
    "model_step": Spec("python bench/model_step.py", ("impl", "batch", "seqlen"),
        ("step_ms", "tokens_per_s", "mfu", "peak_gib"), ratios=("speedup_vs_hf", "memory_vs_hf"),
        variants=("checkpointing",)),
    "moe": Spec("python bench/moe.py", ("impl", "phase", "tokens", "experts", "top_k"),
        ("ms", "tflops", "pct_peak", "rel_err"), ratios=("x_loop", "x_grouped_mm")),
    "optimizer_step": Spec("python bench/optimizer_step.py", ("impl", "mode", "tensors", "elements"),
        ("ms", "update_tb_s", "norm_tb_s"), ratios=("speedup_vs_per_tensor",), workload="AdamW step"),
    "optimizer_8bit": Spec("python bench/optimizer_8bit.py", ("part", "states", "path", "tile", "seed", "elements"),
        ("state_gib", "moments_gib", "alloc_gib", "ms", "gb_s", "hbm_frac", "final_loss", "max_step_diff_vs_fp32",
         "noise"),
        ratios=("vs_fp32", "state_vs_fp32"), workload="8-bit AdamW"),
    "policy_sync": Spec("python bench/policy_sync.py", ("mode", "shape", "bucket_mib"),
        ("buckets", "gbytes", "seconds", "gbps", "exact"), workload="S1"),
    "qkv_prologue": Spec("python bench/qkv_prologue.py", ("impl", "mode", "tokens", "shape"),
        ("ms_per_layer", "gb_s", "frac_copy_bw"), ratios=("speedup_vs_unfused",), workload="QKV prologue"),
    "rollout": Spec("python bench/rollout.py", ("impl", "shape", "sequences"),
        ("tok_s", "wall_s", "frac_limit", "ms_per_token", "logprob_diff_mean", "spec_accept_len", "spec_gated_steps",
         "accept_needed"), ratios=("speedup_vs_hf", "speedup_vs_plain", "fp8_speedup", "kv_fp8_speedup"),
        variants=("rollout_dtype", "kv_cache_dtype", "call", "decode_steps", "lookahead", "speculative_tokens",
                  "spec_gate", "plain_pass", "batch")),
    "rollout_vl": Spec("python bench/rollout_vl.py", ("impl", "shape", "sequences"),
        ("tok_s", "wall_s", "tower_s", "logprob_diff_mean"), ratios=("speedup_vs_hf", "vs_text"),
        variants=("call",)),
    "sampler": Spec("python bench/sampler.py", ("impl", "mode", "B", "V"), ("ms", "GB/s"),
        ratios=("speedup_vs_torch_eager",)),
    # serve: load "startup" is the record of a server that failed to start, not a measurement; one row per GPU model
    # (an H100 run does not stand for the H200's figure)
    "serve": Spec("python bench/serve.py", ("load", "gpu"),
        ("requests", "failed", "tok_s", "engine_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "error"),
        ratios=("vs_engine",), workload="V1", variants=("server_args", "clients"), skip=(("load", "startup"),)),
    "serve_lora": Spec("python bench/serve_lora.py", ("server", "shape"),
        ("requests", "failed", "tok_s", "ttft_p50_ms", "tpot_p50_ms", "tpot_p99_ms", "error"), ratios=("vs_base",),
        workload="LoRA serving (4 adapters)"),
    "spec_host": Spec("python bench/spec_host.py", ("impl", "model", "batch", "k"),
        ("steps", "wall_ms", "host_ms", "host_per_row_us"), ratios=("host_vs_plain",),
        workload="speculative step host time"),
    "spec_verify": Spec("python bench/spec_verify.py", ("B", "K", "V"),
        ("verify_ms", "plain_sample_ms", "overhead_ms")),
    "tp": Spec("python bench/tp.py --gpus 2", ("part", "label", "gpus"),
        ("tok_s", "ttft_p50_ms", "tpot_p50_ms", "greedy_identical", "max_abs_weight_diff", "max_abs_loss_diff",
         "error"), ratios=("speedup_vs_tp1",), workload="TP"),
    "train_step": Spec("python bench/train_step.py", ("impl", "batch", "seqlen"),
        ("step_ms", "tok_s", "mfu", "peak_gib", "reserved_gib", "loop_ms"),
        ratios=("speedup_vs_hf", "memory_vs_hf", "loop_speedup_vs_hf"), variants=("checkpointing", "graphs")),
}
# fmt: on
GENERIC = Spec("", ("impl",), (), ())  # a bench not listed above: its workload and impl only


def load_rows(results_dir: Path = RESULTS_DIR) -> list[dict]:
    """Every benchmark row of ``results_dir/*.jsonl``, in file order (rows without ``bench`` are skipped)."""
    rows = []
    for path in sorted(results_dir.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                if "bench" in row:
                    rows.append(row)
    return rows


def table_of(row: dict) -> str:
    """The table a row goes to: its BENCH.md workload (K1, T1, R1, ...), else the bench's own table."""
    spec = SPECS.get(row["bench"], GENERIC)
    workload = str(row.get("workload") or "")
    if workload.split(" ")[0] in ORDER:
        return workload
    return spec.workload or row["bench"]


def _order(value):
    """Numbers sort as numbers, the rest as text, missing values first."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (1, value, "")
    if value is None:
        return (0, 0, "")
    return (2, 0, value if isinstance(value, str) else json.dumps(value, sort_keys=True))


def run_of(row: dict) -> tuple[str, str]:
    """The run a row belongs to: its commit and day (one device session measures one commit)."""
    return str(row.get("git_sha", "")), str(row.get("time", ""))[:10]


def key_fields(spec: Spec) -> tuple[str, ...]:
    """A row's key: its workload, the bench's ``Spec.keys`` and the GPU model (an H100 run stands beside an H200's)."""
    return ("workload", *spec.keys, *(() if "gpu" in spec.keys else ("gpu",)))


def current_rows(rows: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """{(table, bench): rows}. Per key (table, workload, ``Spec.keys`` and GPU) the rows of its latest run (the run
    holding the key's latest ``time``); within that run one row per ``Spec.variants`` setting, the latest (a tie goes
    to the later line)."""
    by_key: dict[tuple, list[dict]] = {}
    for row in rows:
        spec = SPECS.get(row["bench"], GENERIC)
        if any(str(row.get(field)) == value for field, value in spec.skip):
            continue
        key = (table_of(row), row["bench"], *(_id(row.get(k)) for k in key_fields(spec)))
        by_key.setdefault(key, []).append(row)
    tables: dict[tuple[str, str], list[dict]] = {}
    for key, group in by_key.items():
        run = run_of(max(group, key=lambda r: str(r.get("time", ""))))
        latest: dict[tuple, dict] = {}
        for row in group:
            if run_of(row) == run:
                variant = tuple(_id(row.get(v)) for v in SPECS.get(key[1], GENERIC).variants)
                if variant not in latest or str(row.get("time", "")) >= str(latest[variant].get("time", "")):
                    latest[variant] = row
        tables.setdefault(key[:2], []).extend(latest.values())
    for (_, bench), table in tables.items():
        spec = SPECS.get(bench, GENERIC)
        table.sort(key=lambda r: [_order(r.get(f)) for f in (*key_fields(spec), *spec.variants)])
    return tables


def _id(value) -> str:
    return json.dumps(value, sort_keys=True)


def fmt(value) -> str:
    """A cell: floats to 4 significant digits (thousands separated), lists and dicts as compact JSON."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.4g}"
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 10000 else str(value)
    if isinstance(value, (list, dict)):
        return json.dumps(value, separators=(",", ":"))
    return str(value).replace("|", "/").replace("\n", " ")


def provenance(row: dict, spec: Spec) -> list[str]:
    """commit, date, GPU, versions and command of one row."""
    gpu = str(row.get("gpu", ""))
    if row.get("gpu_count", 1) not in (1, None):
        gpu += f" x{row['gpu_count']}"
    versions = " ".join(f"{k} {row[k]}" for k in ("torch", "triton", "transformers") if row.get(k))
    command = row.get("command") or (f"{spec.command} (default)" if spec.command else "")
    return [str(row.get("git_sha", "")), str(row.get("time", ""))[:10], gpu, versions, f"`{command}`"]


def render_table(workload: str, bench: str, rows: list[dict]) -> list[str]:
    spec = SPECS.get(bench, GENERIC)
    shown = ("workload",) if any(r.get("workload", workload) != workload for r in rows) else ()
    cols = [
        c
        for c in dict.fromkeys((*shown, *spec.keys, *spec.variants, *spec.metrics, *spec.ratios, "note", "error"))
        if any(c in r for r in rows)
    ]
    head = [*cols, "commit", "date", "GPU", "versions", "command"]
    lines = [f"## {workload}: `bench/{bench}.py`", "", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for row in rows:
        lines.append("| " + " | ".join([*(fmt(row.get(c)) for c in cols), *provenance(row, spec)]) + " |")
    return [*lines, ""]


HEADER = """# Benchmark results (generated)

Generated by `python bench/report.py` from `bench/results/*.jsonl`: do not edit by hand (`python bench/report.py
--check` fails when this file is stale). One table per workload and bench script, the current rows only: for every
key (workload, implementation, shape, GPU) the rows of its latest run (a run: one commit on one day), one per
setting the run compared (e.g. CUDA graphs off/on), the latest; older rows stay in the jsonl. Every cell is a field
of that row; the ratio columns (`speedup_vs_*`, `*_x_*`, `x_*`, `vs_*`, `ratio`) are the bench's own comparison with its
baseline measured in the same run. A command marked "(default)" is the bench's default: that row did not record the
command it ran. A commit "unknown" or "-dirty" is what the GPU machine's copy of the tree reported. How to run the
benches: `bench/README.md`; the dated chronicle of every session, with figures whose rows were not kept:
`bench/HISTORY.md`.
"""


def sort_key(item):
    (workload, bench), _ = item
    base = workload.split()[0]
    return (ORDER.index(base) if base in ORDER else len(ORDER), workload, bench)


def render(rows: list[dict]) -> str:
    lines = [HEADER]
    for (workload, bench), table in sorted(current_rows(rows).items(), key=sort_key):
        lines += render_table(workload, bench, table)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the output file is not what the rows give")
    ap.add_argument("--results", type=Path, default=RESULTS_DIR, help="folder of the *.jsonl rows")
    ap.add_argument("--out", type=Path, default=RESULTS_MD, help="the markdown file written (or checked)")
    args = ap.parse_args(argv)
    text = render(load_rows(args.results))
    if args.check:
        if not args.out.exists() or args.out.read_text() != text:
            print(f"{args.out} is stale: run python bench/report.py", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
