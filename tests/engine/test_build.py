"""engine/build.py: the one build path of train's and serve's engines (device/dtype, EOS ids, EngineConfig)."""

import json

import pytest
import torch

from areno.engine.build import build_engine, device_and_dtype, engine_config, eos_token_ids
from areno.models import load_model, load_tokenizer
from areno.testing import make_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("build")
    return {f: make_tiny_checkpoint(root / f, f) for f in ("qwen3", "qwen3_moe")}


def test_device_and_dtype_rules():
    cpu = torch.device("cpu")
    assert device_and_dtype(None, "cpu") == (cpu, torch.float32)  # train: fp32 on the CPU
    assert device_and_dtype("bfloat16", "cpu") == (cpu, torch.bfloat16)
    assert device_and_dtype(torch.float16, "cpu") == (cpu, torch.float16)
    assert device_and_dtype(None, "cpu", checkpoint_dtype=True) == (cpu, None)  # serve: the checkpoint's dtype
    assert device_and_dtype("float16", "cpu", checkpoint_dtype=True) == (cpu, torch.float16)
    if not torch.cuda.is_available():
        assert device_and_dtype() == (cpu, torch.float32)


def test_eos_ids_join_checkpoint_and_tokenizer(ckpts, tmp_path):
    path = ckpts["qwen3"]
    tok = load_tokenizer(path)
    gen = json.loads((path / "generation_config.json").read_text())["eos_token_id"]
    assert eos_token_ids(path, tok) == sorted(set(gen) | {tok.eos_token_id})
    assert eos_token_ids(None, tok) is None and eos_token_ids("org/not-a-folder", tok) is None


def test_engine_config_records_routing_only_for_moe(ckpts):
    dense, moe = (load_model(ckpts[f], device="cpu") for f in ("qwen3", "qwen3_moe"))
    assert not engine_config(dense, record_routing=True).record_routing
    conf = engine_config(moe, record_routing=True, max_running=3, max_model_len=64, decode_steps=2, seed=5,
                         kv_cache_memory=0.3)
    assert conf.record_routing and (conf.max_running, conf.max_model_len, conf.decode_steps, conf.seed) == (3, 64, 2, 5)
    assert conf.kv_cache_memory == 0.3 and conf.block_size == 16


def test_build_engine_uses_the_same_path(ckpts):
    engine, tok = build_engine(ckpts["qwen3"], max_running=2, max_model_len=64, eager_decode=True, device="cpu")
    assert engine.stopper.eos == set(eos_token_ids(ckpts["qwen3"], tok))
    assert engine.config.max_running == 2 and engine.max_model_len == 64
    assert next(engine.model.parameters()).dtype == torch.float32  # the checkpoint's dtype
