"""The SDK surface: backend selection, config/backend mismatch rules, runtime keys, Trainer checks, SamplingParams."""

import platform
import subprocess
import sys
import types

import pytest

from areno.api import (
    CUDA,
    MLX,
    RUNTIME_KEYS,
    BackendType,
    CudaConfig,
    MlxConfig,
    SamplingParams,
    Trainer,
    resolve_backend,
)
from areno.config import ConfigError, TrainConfig


def host(monkeypatch, system, machine, *, with_platform_module=True):
    monkeypatch.setattr(platform, "system", lambda: system)
    monkeypatch.setattr(platform, "machine", lambda: machine)
    if not with_platform_module:  # the fallback used when areno.platform is absent
        monkeypatch.setitem(sys.modules, "areno.platform", None)


@pytest.mark.parametrize("with_platform_module", [True, False])
def test_linux_selects_cuda_with_a_default_config(monkeypatch, with_platform_module):
    host(monkeypatch, "Linux", "x86_64", with_platform_module=with_platform_module)
    backend, config = resolve_backend()
    assert backend is CUDA and backend is BackendType.CUDA
    assert config == CudaConfig()
    assert resolve_backend("cuda")[0] is CUDA
    cfg = CudaConfig(tp_size=2)
    assert resolve_backend(CUDA, cfg) == (CUDA, cfg)


@pytest.mark.parametrize("with_platform_module", [True, False])
def test_macos_arm64_selects_mlx_which_is_not_built(monkeypatch, with_platform_module):
    host(monkeypatch, "Darwin", "arm64", with_platform_module=with_platform_module)
    with pytest.raises(RuntimeError, match="MLX backend is not part of this build"):
        resolve_backend()


@pytest.mark.parametrize("system,machine", [("Windows", "AMD64"), ("Darwin", "x86_64"), ("FreeBSD", "amd64")])
@pytest.mark.parametrize("with_platform_module", [True, False])
def test_other_platforms_fail_explicitly(monkeypatch, system, machine, with_platform_module):
    host(monkeypatch, system, machine, with_platform_module=with_platform_module)
    with pytest.raises(RuntimeError) as info:
        resolve_backend()
    assert "CUDA" in str(info.value) and machine in str(info.value)


def test_platform_module_choice_is_used(monkeypatch):
    monkeypatch.setitem(sys.modules, "areno.platform", types.SimpleNamespace(select_backend=lambda: "mlx"))
    with pytest.raises(RuntimeError, match="MLX backend is not part of this build"):
        resolve_backend()  # even on this Linux box: areno.platform decides


def test_typed_config_mismatches_fail_at_construction(monkeypatch):
    host(monkeypatch, "Linux", "x86_64")
    with pytest.raises(TypeError, match="CudaConfig configures the CUDA backend but backend_type=MLX"):
        Trainer(model_path="/m", backend_type=MLX, custom_config=CudaConfig())
    with pytest.raises(TypeError, match="MlxConfig configures the MLX backend but backend_type=CUDA"):
        Trainer(model_path="/m", backend_type=CUDA, custom_config=MlxConfig())
    with pytest.raises(TypeError, match="this host selects CUDA"):
        Trainer(model_path="/m", custom_config=MlxConfig())  # automatic selection on Linux is CUDA
    with pytest.raises(TypeError, match="custom_config must be"):
        resolve_backend(CUDA, {"tp_size": 1})
    with pytest.raises(TypeError, match="backend_type must be"):
        resolve_backend("rocm")
    with pytest.raises(RuntimeError, match="MLX backend is not part of this build"):
        resolve_backend(MLX)  # asking for MLX on Linux: no fallback, and not built


def test_unknown_runtime_keys_list_the_valid_ones():
    with pytest.raises(ValueError) as info:
        CudaConfig(runtime={"attn_backend": "flash", "flash_attn": True})
    message = str(info.value)
    assert "'flash_attn'" in message
    assert all(key in message for key in RUNTIME_KEYS)
    assert set(RUNTIME_KEYS) == {
        "attn_backend", "eager_decode", "drop_rollout_state", "activation_checkpointing", "optimizer_states",
        "optimizer_state_offload", "optimizer_state_offload_dir", "optimizer_state_offload_batch_size",
        "decode_progress_interval_s", "kv_cache_memory", "dtype"}


def test_runtime_values_are_checked(tmp_path):
    full = CudaConfig(tp_size=2, devices="0,1", max_running_prompts=8, runtime={
        "attn_backend": "native", "eager_decode": True, "drop_rollout_state": False,
        "activation_checkpointing": False, "optimizer_states": "fp32", "optimizer_state_offload": "disk",
        "optimizer_state_offload_dir": str(tmp_path), "optimizer_state_offload_batch_size": 4,
        "decode_progress_interval_s": 5.0, "kv_cache_memory": 0.5, "dtype": "float32"})
    assert full.devices == [0, 1]
    bad = [({"attn_backend": "xformers"}, "attn_backend"), ({"eager_decode": "yes"}, "eager_decode"),
           ({"optimizer_state_offload": "gpu"}, "optimizer_state_offload"),
           ({"optimizer_state_offload": "disk"}, "optimizer_state_offload_dir"),
           ({"optimizer_state_offload_batch_size": 0}, "optimizer_state_offload_batch_size"),
           ({"kv_cache_memory": "lots"}, "kv_cache_memory"), ({"kv_cache_memory": 0}, "kv_cache_memory"),
           ({"dtype": "fp8"}, "dtype"), ({"decode_progress_interval_s": -1}, "decode_progress_interval_s"),
           ({"optimizer_states": "4bit"}, "optimizer_states")]
    for runtime, key in bad:
        with pytest.raises(ConfigError) as info:
            CudaConfig(runtime=runtime)
        assert info.value.flag == f"runtime[{key!r}]", runtime
    for kwargs, name in [({"tp_size": 0}, "tp_size"), ({"devices": [0, 0]}, "devices"),
                         ({"devices": "0,x"}, "devices"), ({"max_running_prompts": 0}, "max_running_prompts")]:
        with pytest.raises(ConfigError) as info:
            CudaConfig(**kwargs)
        assert info.value.flag == name
    with pytest.raises(ConfigError, match="quantize_bits"):
        MlxConfig(quantize_bits=3)


def test_trainer_constructor_validates_topology(monkeypatch):
    host(monkeypatch, "Linux", "x86_64")
    trainer = Trainer(world_size=4, model_path="/path/to/model", backend_type=CUDA, custom_config=CudaConfig(
        tp_size=4, devices=[0, 1, 2, 3], max_running_prompts=32, runtime={"attn_backend": "flash"}))
    assert (trainer.world_size, trainer.backend_type, trainer.config.tp_size) == (4, CUDA, 4)
    assert Trainer(model_path="m", lr=1e-5).options == {"lr": 1e-5}
    cases = [(dict(world_size=3, custom_config=CudaConfig(tp_size=2)), "world_size"),
             (dict(world_size=0), "world_size"),
             (dict(world_size=2, custom_config=CudaConfig(devices=[0, 1, 2])), "devices"),
             (dict(model_path=None), "model_path")]
    for kwargs, name in cases:
        with pytest.raises(ConfigError) as info:
            Trainer(**{"model_path": "m", **kwargs})
        assert info.value.flag == name
    with pytest.raises(RuntimeError, match="torchrun"):  # 4 ranks need 4 processes, not one SDK process
        trainer.init()
    import areno

    assert areno.Trainer is Trainer


def test_sampling_params_defaults_and_validation():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.max_new_tokens, p.min_new_tokens) == (1.0, 1.0, 0, 256, 0)
    assert (p.stop, p.stop_token_ids, p.seed, p.n, p.logprobs) == ([], [], None, 1, True)
    assert SamplingParams(stop="\n\n", stop_token_ids=(2, 7)).stop == ["\n\n"]
    assert SamplingParams(stop_token_ids=(2, 7)).stop_token_ids == [2, 7]
    assert SamplingParams(temperature=0, seed=0).temperature == 0
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    grammar = {"type": "json_schema", "schema": schema}
    assert SamplingParams(grammar=grammar).grammar == grammar
    assert SamplingParams(json_schema=schema).grammar == grammar  # the SDK's shorthand
    assert SamplingParams(seed=-1).seed == -1  # any integer (the OpenAI server passes a request's seed as it is)
    bad = [("temperature", -0.1), ("temperature", "hot"), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1),
           ("top_k", 2.5), ("max_new_tokens", 0), ("min_new_tokens", 300), ("min_new_tokens", -1), ("n", 0),
           ("seed", 1.5), ("logprobs", 1), ("stop", ["ok", ""]), ("stop", [3]),
           ("stop_token_ids", [-1]), ("stop_token_ids", ["eos"]), ("grammar", {"type": "nonsense"}),
           ("grammar", {"type": "json_schema", "schema": [1]}), ("grammar", [1]), ("top_logprobs", -1)]
    for name, value in bad:
        with pytest.raises(ValueError) as info:
            SamplingParams(**{name: value})
        assert info.value.flag == name, (name, value)


def test_sampling_params_from_train_config(tmp_path):
    reward = tmp_path / "r.py"
    reward.write_text("def reward_fn(record):\n    return 1.0\n")
    cfg = TrainConfig(ckpt="m", dataset_path="d", reward_fn_path=str(reward), temperature=0.7, top_k=20,
                      max_new_tokens=64, stop=["</answer>"], n_samples=4, seed=3)
    p = SamplingParams.from_train_config(cfg)
    assert (p.temperature, p.top_k, p.max_new_tokens, p.stop, p.n, p.seed) == (0.7, 20, 64, ["</answer>"], 4, None)
    greedy = SamplingParams.from_train_config(cfg, n=1, greedy=True)  # the evaluation's settings
    assert (greedy.temperature, greedy.n, greedy.top_k) == (0.0, 1, 20)


def test_api_import_stays_light():
    code = "import sys, areno.api, areno.cli; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.strip() == "[]"
