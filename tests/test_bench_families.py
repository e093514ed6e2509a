"""bench/families.py --smoke on the CPU: R1 and T1 rows of both Qwen3.5 shapes with their transformers baselines,
transformers' copy of the GPU-drawn weights computing areno's logits, and bench/report.py rendering the rows."""

import importlib
import sys
from pathlib import Path

import pytest
import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
HAS_QWEN3_5 = hasattr(transformers, "Qwen3_5TextConfig")


def _module(name: str):
    """A bench script as a module (it puts bench/ on sys.path for its own imports)."""
    if str(ROOT / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "bench"))
    return importlib.import_module(name)


@pytest.mark.skipif(not HAS_QWEN3_5, reason=f"transformers {transformers.__version__} has no qwen3_5")
@pytest.mark.parametrize("shape", ["qwen3_5-9b", "qwen3_5-35b-a3b"])
def test_transformers_copy_computes_the_same_logits(shape):
    families = _module("families")
    raw = families.config_of(shape, 4, smoke=True)
    model = families.models.random_model(raw, torch.float32, torch.device("cpu"), unit_norms=True, std=0.1)
    hf = families.hf_model(raw, model, torch.float32, torch.device("cpu")).eval()
    ids = torch.randint(3, raw["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(ids).logits
        got = model.logits(ids)
    assert want.abs().max() > 0.1  # the weights matter
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


@pytest.mark.slow
def test_smoke_rows_and_report():
    records = _module("families").main(["--smoke", "--no-save"])
    for r in records:
        assert "error" not in r, r
    hf = HAS_QWEN3_5
    part = {"R1": [("areno", "first"), ("areno", "warm")] + [("transformers", "warm")] * hf,
            "T1": [("areno", "fp32"), ("areno", "8bit")] + [("transformers", None)] * hf}  # fmt: skip
    want = [(s, w, *i) for s in ("qwen3_5-9b", "qwen3_5-35b-a3b") for w in ("R1", "T1") for i in part[w]]
    got = [(r["shape"], r["workload"], r["impl"], r.get("call") or r.get("optimizer_states")) for r in records]
    assert got == want
    for r in records:
        if r["workload"] == "R1":
            assert r["sequences"] == 8 and r["output_tokens"] == 8 * 16 and r["complete"] and r["tok_s"] > 0
            if r["impl"] == "areno":  # the call's time split: prefill steps, decode chains
                assert r["step_s_single"] > 0 and r["step_s_chained"] > 0 and r["steps_chained"] > 0
                assert r["step_s_single"] + r["step_s_chained"] <= r["wall_s"]
        else:
            assert (r["batch"], r["seqlen"]) == (2, 64) and r["step_ms"] > 0
            assert 0 < r["active_parameters"] <= r["parameters"]
        if r["impl"] == "areno" and r.get("call") != "first" and HAS_QWEN3_5:
            assert r["speedup_vs_hf"] > 0, r
        if r.get("call") == "warm" and r["impl"] == "areno":
            assert r["logprob_diff_mean"] < 1e-3  # fp32: the engine's log-probs are the training forward's
    moe = [r for r in records if r["shape"] == "qwen3_5-35b-a3b" and r["workload"] == "T1"][0]
    assert moe["active_parameters"] < moe["parameters"] * 0.75  # routed experts counted at top-k / experts

    report = _module("report")
    env = dict(bench="families", git_sha="abc", time="2026-12-05T06:00:00+00:00", gpu="cpu")
    text = report.render([{**env, **r} for r in records])
    r1 = text[text.index("## R1: `bench/families.py`"):]
    t1 = text[text.index("## T1: `bench/families.py`"):]
    assert "| areno | qwen3_5-35b-a3b | 4 | 8 |" in r1 and "| areno | qwen3_5-9b | 4 |" in t1


def test_an_8bit_row_per_adamw8bit_tile_each_run_with_its_tile(monkeypatch):
    """``--adamw8bit-tiles``: T1 runs areno's 8-bit step once per tile of the 8-bit kernel (``adamw8bit.TILE`` set
    for that row, put back after), each row naming it; fp32 rows run once; a tile that is not ROWSxWARPS in powers
    of two, or tiles without 8-bit moments, exit 2 naming the flag."""
    families = _module("families")
    from areno.kernels import adamw8bit

    seen = []

    def fake_train(model, args, device, base, n_active, states):
        seen.append((states, dict(adamw8bit.TILE)))
        return {**base, "impl": "areno", "optimizer_states": states, "step_ms": 1.0}

    monkeypatch.setattr(families, "train_areno", fake_train)
    default = dict(adamw8bit.TILE)
    args = families.parse(["--smoke", "--impls", "areno", "--attn-backend", "flash", "--optimizer-states", "fp32,8bit",
                           "--adamw8bit-tiles", "2x8,1x4"])
    rows = families.run_train("qwen3_5-9b", args, torch.device("cpu"), torch.float32)
    assert seen == [("fp32", default), ("8bit", {"rows": 2, "num_warps": 8}), ("8bit", {"rows": 1, "num_warps": 4})]
    assert [r.get("adamw8bit_tile") for r in rows] == [None, "2x8", "1x4"]
    assert adamw8bit.TILE == default
    for argv in (["--adamw8bit-tiles", "3x8"], ["--adamw8bit-tiles", "8by8"],
                 ["--optimizer-states", "fp32", "--adamw8bit-tiles", "2x8"],
                 ["--parts", "rollout", "--adamw8bit-tiles", "2x8"]):
        with pytest.raises(SystemExit) as e:
            families.parse(argv)
        assert e.value.code == 2


def test_decode_floor_counts_weights_states_and_kv(monkeypatch):
    """``decode_floor_ms``: one decode step's bytes at the card's bandwidth: the weights but the untied input
    embedding, then per row its recurrent states read and written and its K/V at the given context."""
    families = _module("families")
    from areno.engine.engine import Engine, EngineConfig
    from areno.platform import roofline

    raw = families.config_of("qwen3_5-9b", 4, smoke=True)
    model = families.models.random_model(raw, torch.float32, torch.device("cpu"), unit_norms=True)
    engine = Engine(model, None, EngineConfig(block_size=16, max_running=4, max_batched_tokens=256, max_model_len=128),
                    eos_token_ids=[])  # fmt: skip
    cpu = torch.device("cpu")
    assert families.decode_floor_ms(engine, 4, 64, cpu) is None  # no known card: no floor
    monkeypatch.setattr(roofline, "device_roofline", lambda device: roofline.H200)
    bw = roofline.H200.bytes_per_s / 1e3  # bytes a ms
    embed = model.embed_tokens.weight
    weights = sum(p.numel() * 4 for p in model.parameters()) - (embed.numel() * 4 if model.lm_head is not None else 0)
    assert families.decode_floor_ms(engine, 0, 64, cpu) == pytest.approx(weights / bw)
    pools = engine.runner.states
    state = (pools.conv[:, 0].numel() * pools.conv.element_size()
             + pools.recurrent[:, 0].numel() * pools.recurrent.element_size())  # one slot, every recurrent layer
    kv = engine.runner.kv_cache[:, :, 0, 0].numel() * 4  # one token, every attention layer, K and V
    want = (weights + 3 * (2 * state + 10 * kv)) / bw
    assert families.decode_floor_ms(engine, 3, 10, cpu) == pytest.approx(want)
