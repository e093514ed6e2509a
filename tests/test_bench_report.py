"""bench/RESULTS.md is what bench/report.py makes of bench/results/*.jsonl; the generator keeps only current rows and
says nothing that a row does not."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _report():
    spec = importlib.util.spec_from_file_location("bench_report", ROOT / "bench" / "report.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


ENV = {"gpu": "NVIDIA H200", "gpu_count": 1, "torch": "2.11.0+cu130", "triton": "3.6.0"}


def _row(**fields):
    return {"bench": "train_step", "shape": "qwen3-0.6b", "workload": "T1", "batch": 8, "seqlen": 1024, **ENV, **fields}


def _write(folder: Path, name: str, rows: list[dict]):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_committed_results_md_is_up_to_date():
    out = subprocess.run([sys.executable, "bench/report.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr + "\nrun: python bench/report.py"


def test_latest_run_per_key_with_its_settings_and_provenance(tmp_path):
    report = _report()
    old = dict(git_sha="aaa", time="2026-11-30T10:00:00+00:00", command="python bench/train_step.py")
    new = dict(git_sha="bbb", time="2026-12-02T10:00:00+00:00", command="python bench/train_step.py --graphs on")
    rows = [
        _row(impl="areno", graphs="off", step_ms=111.0, speedup_vs_hf=1.5, **old),
        _row(impl="transformers", step_ms=180.0, **old),
        _row(impl="areno", graphs="off", step_ms=80.0, speedup_vs_hf=2.25, **new),
        _row(impl="areno", graphs="on", step_ms=70.0, speedup_vs_hf=2.5, **new),  # a setting of the same run
        _row(impl="areno", graphs="on", step_ms=69.0, speedup_vs_hf=2.6, **{**new, "time": "2026-12-02T11:00:00"}),
    ]
    _write(tmp_path / "results", "train_step", rows)
    _write(tmp_path / "results", "learn_grpo", [{"step": 1, "loss": 0.5}])  # a per-step log: not a bench row
    tables = report.current_rows(report.load_rows(tmp_path / "results"))
    assert list(tables) == [("T1", "train_step")]
    got = [(r["impl"], r.get("graphs"), r["step_ms"]) for r in tables[("T1", "train_step")]]
    # areno: the latest run (bbb) only, one row per graphs setting, the later one; transformers: its own latest run
    assert got == [("areno", "off", 80.0), ("areno", "on", 69.0), ("transformers", None, 180.0)]

    text = report.render(report.load_rows(tmp_path / "results"))
    table = text[text.index("## T1: `bench/train_step.py`") :]
    assert "| areno | 8 | 1024 | on | 69 |" in table and "2.6 | bbb | 2026-12-02 | NVIDIA H200 |" in table
    assert "`python bench/train_step.py --graphs on`" in table and "111" not in table and "aaa" in table
    for figure in ("111", "1.5 |"):  # the superseded run's figures are not quoted
        assert figure not in table


def test_default_command_marked_and_check_detects_staleness(tmp_path):
    report = _report()
    _write(
        tmp_path / "results",
        "moe",
        [
            {
                "bench": "moe",
                "workload": "K3",
                "impl": "areno",
                "phase": "fwd+bwd",
                "tokens": 8192,
                "ms": 6.01,
                "x_loop": 34.5,
                "git_sha": "ccc",
                "time": "2026-12-01T00:00:00",
                **ENV,
            }
        ],
    )
    out = tmp_path / "RESULTS.md"
    args = ["--results", str(tmp_path / "results"), "--out", str(out)]
    assert report.main([*args, "--check"]) == 1  # missing
    assert report.main(args) == 0
    assert report.main([*args, "--check"]) == 0
    text = out.read_text()
    assert "`python bench/moe.py (default)`" in text and "| 6.01 |" in text and "| 34.5 |" in text
    out.write_text(text.replace("6.01", "5.01"))
    assert report.main([*args, "--check"]) == 1  # edited by hand
    assert report.fmt(117466.04) == "117,466" and report.fmt(0.0063591) == "0.006359" and report.fmt(True) == "yes"


def test_a_run_on_another_gpu_stands_beside_the_earlier_one(tmp_path):
    report = _report()
    h200 = dict(git_sha="aaa", time="2026-12-01T10:00:00+00:00", step_ms=80.0)
    h100 = dict(git_sha="bbb", time="2026-12-03T10:00:00+00:00", step_ms=95.0, gpu="NVIDIA H100 80GB HBM3")
    later = dict(git_sha="ccc", time="2026-12-04T10:00:00+00:00", step_ms=78.0)
    _write(tmp_path / "results", "train_step", [_row(impl="areno", **h200), _row(impl="areno", **h100)])
    tables = report.current_rows(report.load_rows(tmp_path / "results"))
    got = [(r["gpu"], r["step_ms"]) for r in tables[("T1", "train_step")]]
    assert got == [("NVIDIA H100 80GB HBM3", 95.0), ("NVIDIA H200", 80.0)]  # the H100 run does not hide the H200's
    _write(tmp_path / "results", "train_step", [_row(impl="areno", **h200), _row(impl="areno", **h100),
                                                 _row(impl="areno", **later)])
    tables = report.current_rows(report.load_rows(tmp_path / "results"))
    got = [(r["gpu"], r["step_ms"]) for r in tables[("T1", "train_step")]]
    assert got == [("NVIDIA H100 80GB HBM3", 95.0), ("NVIDIA H200", 78.0)]  # a later H200 run replaces the H200 row
