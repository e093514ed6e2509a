"""The `areno` command surface: every spec flag in --help, validation exits 2 naming the flag, resolved config,
bool flags, presets, runtime hand-off and dispatch."""

import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from areno import __version__, presets
from areno.cli import main, make_parser
from areno.config import ServeConfig, TrainConfig

ROOT = Path(__file__).resolve().parents[1]

TRAIN_FLAGS = """
--ckpt --dataset-path --dataset-loader-fn --reward-fn-path --algo --world-size --tp-size --batch-size --n-samples
--mini-bs --gradient-accumulation-steps --train-devices --rollout-devices --rollout-tp-size --max-running-prompts
--drop-rollout-state --activation-checkpointing --no-activation-checkpointing --optimizer-state-offload
--optimizer-state-offload-dir --optimizer-state-offload-batch-size --attn-backend --eager-decode --unfreeze-mm-tower
--unfreeze-mm-projector --mm-tower-lr --mm-projector-lr --mm-tower-min-lr --mm-tower-lr-steps --mm-tower-lr-style
--mm-projector-min-lr --mm-projector-lr-steps --mm-projector-lr-style --lr --min-lr --lr-decay-style --warmup-steps
--max-prompt-tokens --max-new-tokens --temperature --top-p --top-k --seed --save-path --save-interval --resume
--max-steps --epochs --ref-ckpt --metrics-dir
--preset --dpo-beta --dpo-label-smoothing --ppo-epochs --clip-eps-low --clip-eps-high --gspo-clip-eps --kl-coef
--kl-estimator --entropy-coef --advantage-std-norm --no-advantage-std-norm --tis-cap --loss-agg
--filter-zero-variance-groups --critic-ckpt --critic-lr --gamma --gae-lambda --value-clip --dual-clip
--critic-warmup-steps --weight-decay --grad-clip --min-new-tokens --stop --eval-interval --log-interval
--tensorboard --no-tensorboard --decode-progress-interval-s --dtype --kv-cache-memory --decode-steps
--overwrite --reward-timeout-s --max-reward-failure-steps --verbose
""".split()

SERVE_FLAGS = """
--model-path --world-size --tp-size --max-running-prompts --host --port --decode-progress-interval-s --eager-decode
--attn-backend --api-key --served-model-name --max-model-len --dtype --seed
""".split()

TRAIN_CHOICES = ["--algo {sft,dpo,grpo,gspo,ppo}", "--optimizer-state-offload {none,cpu,disk}",
                 "--attn-backend {flash,native}", "--lr-decay-style {constant,linear,cosine}",
                 "--kl-estimator {k1,k2,k3}", "--loss-agg {token-mean,seq-mean-token-sum,seq-mean-token-mean}",
                 "--dtype {bfloat16,float16,float32}"]
GROUPS = ["basic", "rollout", "train", "memory", "checkpoint", "multimodal", "observability"]


def help_flags(text: str) -> set[str]:
    """Option strings of the entries in a --help text (the invocation column, not the prose or usage)."""
    flags = set()
    for line in text.splitlines():
        entry = line.strip()
        if entry.startswith("-"):
            flags.update(re.findall(r"--[\w-]+", re.split(r"\s{2,}", entry)[0]))
    return flags


def run(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(autouse=True)
def any_model_name(monkeypatch):
    """The tests here name models that do not exist ("tiny-model"): the model-folder check is tested on its own in
    tests/test_run_safety.py."""
    monkeypatch.setattr("areno.models.loader.check_model_source", lambda flag, value: None)


@pytest.fixture
def plugin_files(tmp_path):
    loader = tmp_path / "loader.py"
    loader.write_text("def load_training_dataset(path, *, default_loader, **kwargs):\n    return []\n")
    reward = tmp_path / "reward.py"
    reward.write_text("def reward_fn(record):\n    return 0.0\n")
    return str(loader), str(reward)


@pytest.fixture
def base(plugin_files):
    return ["--ckpt", "tiny-model", "--dataset-path", "data.jsonl", "--reward-fn-path", plugin_files[1]]


@pytest.fixture
def runners(monkeypatch):
    """Stand-in runtimes that record the config they receive and say they started."""
    seen = {}

    def fake(key):
        def runner(config):
            print(f"{key} runner started")
            seen[key] = config
            return 0

        return runner

    monkeypatch.setitem(sys.modules, "areno.rl.runner", types.SimpleNamespace(run_train=fake("train")))
    monkeypatch.setitem(sys.modules, "areno.serve.server", types.SimpleNamespace(run_server=fake("serve")))
    return seen


def test_train_help_lists_every_spec_flag_in_groups(capsys):
    code, out, _ = run(capsys, "train", "--help")
    assert code == 0
    missing = sorted(set(TRAIN_FLAGS) - help_flags(out))
    assert not missing, f"areno train --help lacks {missing}"
    for choices in TRAIN_CHOICES:
        assert choices in out
    headings = [line.split(" (")[0] for line in out.splitlines() if re.match(r"^[a-z]+ \(", line)]
    assert headings == GROUPS
    assert "--optimizer-state-offload-batch-size N" in out and "(default: 1)" in out


def test_serve_help_lists_every_spec_flag(capsys):
    code, out, _ = run(capsys, "serve", "--help")
    assert code == 0
    missing = sorted(set(SERVE_FLAGS) - help_flags(out))
    assert not missing, f"areno serve --help lacks {missing}"
    assert "(default: 127.0.0.1)" in out and "(default: 8000)" in out


@pytest.mark.parametrize("module", ["areno", "areno.train"])
def test_help_from_a_real_process(module):
    argv = [sys.executable, "-m", module] + (["train"] if module == "areno" else []) + ["--help"]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: areno train")
    assert not set(TRAIN_FLAGS) - help_flags(proc.stdout)


def test_spec_defaults_and_the_resolved_config_is_printed_before_the_run(capsys, base, runners):
    code, out, _ = run(capsys, "train", *base)
    assert code == 0
    cfg = runners["train"]
    assert isinstance(cfg, TrainConfig)
    expected = dict(activation_checkpointing=True, optimizer_state_offload="none", optimizer_state_offload_batch_size=1,
                    dpo_beta=0.1, dpo_label_smoothing=0.0, ppo_epochs=1, clip_eps_low=0.2, clip_eps_high=0.28,
                    gspo_clip_eps=3e-4, kl_coef=0.0, kl_estimator="k3", entropy_coef=0.0, advantage_std_norm=True,
                    tis_cap=2.0, loss_agg="token-mean", gamma=1.0, gae_lambda=0.95, value_clip=0.2, dual_clip=3.0,
                    critic_warmup_steps=0, weight_decay=0.0, grad_clip=1.0, drop_rollout_state=False,
                    eager_decode=False, tensorboard=True, world_size=1, tp_size=1, ckpt="tiny-model")
    assert {k: getattr(cfg, k) for k in expected} == expected
    assert out.index("areno train: grpo on tiny-model") < out.index("train runner started")
    assert "resolved configuration\n" not in out  # the dump goes to the run folder; stdout only with --verbose
    code, out, _ = run(capsys, "train", *base, "--verbose")
    assert code == 0
    assert out.index("areno train: resolved configuration\n") < out.index("train runner started")
    assert "  reward_timeout_s" in out
    printed = dict(re.findall(r"^  (\w+)\s+: (.*)$", out, flags=re.M))
    assert set(printed) == set(TrainConfig.__dataclass_fields__)
    assert printed["ckpt"] == "'tiny-model'" and printed["world_size"] == "1"


def test_flag_values_reach_the_config(capsys, base, runners):
    code, _, _ = run(capsys, "train", *base, "--no-activation-checkpointing", "--no-advantage-std-norm",
                     "--no-tensorboard", "--drop-rollout-state", "--stop", "</answer>", "--stop", "\n\n",
                     "--train-devices", "1,0", "--world-size", "2", "--tp-size", "2", "--kv-cache-memory", "40GiB",
                     "--save-path", "out",
                     "--resume", "--algo", "gspo", "--optimizer-state-offload", "disk",
                     "--optimizer-state-offload-dir", "/tmp/offload")
    assert code == 0
    cfg = runners["train"]
    assert (cfg.activation_checkpointing, cfg.advantage_std_norm, cfg.tensorboard) == (False, False, False)
    assert cfg.drop_rollout_state is True
    assert cfg.stop == ["</answer>", "\n\n"]
    assert cfg.train_devices == [1, 0]
    assert cfg.kv_cache_memory == 40 * 2**30
    assert cfg.resume == "latest" and cfg.algo == "gspo"
    run(capsys, "train", *base, "--no-activation-checkpointing", "--activation-checkpointing")
    assert runners["train"].activation_checkpointing is True  # the last form given wins
    run(capsys, "train", *base, "--train-devices", "0..2,5", "--tp-size", "2", "--rollout-devices", "6..7",
        "--max-staleness", "1", "--policy-sync-bucket-mb", "16")
    cfg = runners["train"]
    assert (cfg.train_devices, cfg.world_size, cfg.rollout_devices) == ([0, 1, 2, 5], 4, [6, 7])
    assert (cfg.rollout_tp, cfg.max_staleness, cfg.policy_sync_bucket_mb, cfg.split) == (2, 1, 16.0, True)
    run(capsys, "train", *base, "--train-devices", "0", "--rollout-devices", "1", "--max-staleness", "3",
        "--partial-rollout", "--partial-rollout-kv", "recompute", "--max-tail-steps", "4")
    cfg = runners["train"]
    assert (cfg.max_staleness, cfg.partial_rollout, cfg.partial_rollout_kv, cfg.max_tail_steps) == (3, True,
                                                                                                    "recompute", 4)


def test_argparse_dataclass_parse_args_still_builds_the_config(base):
    cfg = make_parser("train", TrainConfig).parse_args([*base, "--lr", "3e-6"])
    assert isinstance(cfg, TrainConfig) and cfg.lr == 3e-6 and cfg.batch_size == 8
    assert make_parser("serve", ServeConfig).parse_args(["--model-path", "m"]).port == 8000


BAD_TRAIN = [
    (["--world-size", "3", "--tp-size", "2"], "--world-size"),
    (["--world-size", "0"], "--world-size"),
    (["--tp-size", "-1"], "--tp-size"),
    (["--lr", "-1e-4"], "--lr"),  # a negative number in exponent form is the flag's value, not another flag
    (["--batch-size", "0"], "--batch-size"),
    (["--n-samples", "0"], "--n-samples"),
    (["--n-samples", "1"], "--n-samples"),  # grpo needs a group
    (["--mini-bs", "0"], "--mini-bs"),
    (["--gradient-accumulation-steps", "0"], "--gradient-accumulation-steps"),
    (["--max-running-prompts", "0"], "--max-running-prompts"),
    (["--decode-steps", "0"], "--decode-steps"),
    (["--optimizer-state-offload-batch-size", "0"], "--optimizer-state-offload-batch-size"),
    (["--optimizer-state-offload", "disk"], "--optimizer-state-offload-dir"),
    (["--dataset-loader-fn", "/no/such/loader.py"], "--dataset-loader-fn"),
    (["--reward-fn-path", "/no/such/reward.py"], "--reward-fn-path"),
    (["--train-devices", "0,1", "--world-size", "3"], "--world-size"),  # the world size is the list's length
    (["--train-devices", "1,1", "--world-size", "2"], "--train-devices"),
    (["--train-devices", "0", "--rollout-devices", "0"], "--rollout-devices"),  # overlapping partitions
    (["--train-devices", "0", "--rollout-devices", "1..3", "--rollout-tp-size", "2"], "--rollout-devices"),
    (["--train-devices", "0", "--rollout-devices", "1", "--algo", "sft"], "--rollout-devices"),
    (["--train-devices", "0", "--rollout-devices", "1", "--algo", "dpo"], "--rollout-devices"),
    (["--train-devices", "0", "--rollout-devices", "1", "--policy-sync-bucket-mb", "0"], "--policy-sync-bucket-mb"),
    (["--rollout-devices", "1"], "--rollout-devices"),
    (["--rollout-tp-size", "2"], "--rollout-tp-size"),  # split mode only
    (["--max-staleness", "1"], "--max-staleness"),
    (["--policy-sync-bucket-mb", "16"], "--policy-sync-bucket-mb"),
    (["--max-context-len", "512"], "--max-context-len"),  # agentic rollout only
    (["--train-tool-results"], "--train-tool-results"),
    (["--agent-timeout-s", "5"], "--agent-timeout-s"),
    (["--agent-fn", "{reward}", "--algo", "sft"], "--agent-fn"),
    (["--agent-fn", "{reward}", "--algo", "ppo"], "--agent-fn"),
    (["--agent-fn", "{reward}", "--train-devices", "0", "--rollout-devices", "1", "--max-staleness", "1",
      "--partial-rollout"], "--partial-rollout"),  # agents sent ahead, but no turn swapped mid-generation yet
    (["--agent-fn", "/no/such/agent.py"], "--agent-fn"),
    # partial rollout: split mode and --max-staleness >= 1 only; its settings only with it
    (["--partial-rollout"], "--partial-rollout"),
    (["--train-devices", "0", "--rollout-devices", "1", "--partial-rollout"], "--partial-rollout"),
    (["--train-devices", "0", "--rollout-devices", "1", "--max-staleness", "1", "--partial-rollout",
      "--drop-rollout-state"], "--partial-rollout"),
    (["--train-devices", "0", "--rollout-devices", "1", "--max-staleness", "-1"], "--max-staleness"),
    (["--train-devices", "0", "--rollout-devices", "1", "--partial-rollout-kv", "recompute"], "--partial-rollout-kv"),
    (["--max-tail-steps", "4"], "--max-tail-steps"),
    (["--train-devices", "0", "--rollout-devices", "1", "--max-staleness", "1", "--partial-rollout",
      "--max-tail-steps", "-1"], "--max-tail-steps"),
    # a frozen part has no schedule; a final rate above its peak; the image caps (a model without a tower refuses
    # the multimodal flags once it is loaded: tests/rl/test_multimodal_train.py)
    (["--mm-projector-lr-style", "cosine"], "--mm-projector-lr-style"),
    (["--unfreeze-mm-tower", "--mm-tower-lr", "0.1", "--mm-tower-min-lr", "0.2"], "--mm-tower-min-lr"),
    (["--max-image-bytes", "0"], "--max-image-bytes"),
    (["--top-p", "0"], "--top-p"),
    (["--min-new-tokens", "9", "--max-new-tokens", "4"], "--min-new-tokens"),
    (["--resume"], "--resume"),
    (["--preset", "no-such-preset"], "--preset"),
]


@pytest.mark.parametrize("extra,flag", BAD_TRAIN, ids=[" ".join(a) for a, _ in BAD_TRAIN])
def test_invalid_train_flags_exit_2_naming_the_flag(capsys, base, runners, extra, flag):
    extra = [x.format(reward=base[-1]) for x in extra]
    code, _, err = run(capsys, "train", *base, *extra)
    assert code == 2
    assert f"areno train: error: {flag} " in err, err
    assert "train" not in runners


@pytest.mark.parametrize("argv,flag", [
    (["--dataset-path", "d", "--reward-fn-path", "{reward}"], "--ckpt"),
    (["--ckpt", "m", "--reward-fn-path", "{reward}"], "--dataset-path"),
    (["--ckpt", "m", "--dataset-path", "d"], "--reward-fn-path"),  # grpo needs a reward
])
def test_required_train_flags(capsys, plugin_files, runners, argv, flag):
    argv = [a.format(reward=plugin_files[1]) for a in argv]
    code, _, err = run(capsys, "train", *argv)
    assert code == 2 and f"areno train: error: {flag} is required" in err
    assert run(capsys, "train", "--ckpt", "m", "--algo", "sft", "--dataset-loader-fn", plugin_files[0])[0] == 0


@pytest.mark.parametrize("extra,flag", [
    (["--algo", "reinforce"], "--algo"),
    (["--world-size", "two"], "--world-size"),
    (["--train-devices", "a,b"], "--train-devices"),
    (["--train-devices", "3..1"], "--train-devices"),
    (["--max-staleness", "two"], "--max-staleness"),
    (["--kv-cache-memory", "lots"], "--kv-cache-memory"),
    (["--attn-backend", "sdpa"], "--attn-backend"),
])
def test_unparseable_values_exit_2_naming_the_flag(capsys, base, extra, flag):
    code, _, err = run(capsys, "train", *base, *extra)
    assert code == 2 and f"areno train: error: argument {flag}" in err


@pytest.mark.parametrize("argv,flag", [
    ([], "--model-path"),
    (["--model-path", "m", "--world-size", "4", "--tp-size", "3"], "--world-size"),
    (["--model-path", "m", "--max-running-prompts", "0"], "--max-running-prompts"),
    (["--model-path", "m", "--port", "70000"], "--port"),
])
def test_invalid_serve_flags_exit_2(capsys, runners, argv, flag):
    code, _, err = run(capsys, "serve", *argv)
    assert code == 2 and f"areno serve: error: {flag} " in err


def test_serve_hands_the_config_to_the_server_and_masks_the_key(capsys, runners):
    code, out, _ = run(capsys, "serve", "--model-path", "m", "--world-size", "4", "--tp-size", "4",
                       "--max-running-prompts", "32", "--port", "8001", "--api-key", "sk-secret")
    assert code == 0
    cfg = runners["serve"]
    assert (cfg.world_size, cfg.tp_size, cfg.max_running_prompts, cfg.port, cfg.host) == (4, 4, 32, 8001, "127.0.0.1")
    assert cfg.api_key == "sk-secret" and "sk-secret" not in out


def test_the_runtime_is_imported_only_after_the_config_is_checked(capsys, base, monkeypatch):
    monkeypatch.setitem(sys.modules, "areno.rl.runner", None)  # importing the runtime fails from here on
    monkeypatch.setitem(sys.modules, "areno.serve.server", None)
    code, _, err = run(capsys, "train", *base, "--max-new-tokens", "0")
    assert code == 2 and "areno train: error: --max-new-tokens " in err
    with pytest.raises(ImportError):
        run(capsys, "train", *base)
    assert "areno train: grpo on tiny-model" in capsys.readouterr().out
    code, _, err = run(capsys, "serve", "--model-path", "m", "--port", "70000")
    assert code == 2 and "areno serve: error: --port " in err


def test_preset_is_the_base_and_explicit_flags_override_it(capsys, plugin_files, runners, monkeypatch):
    def unit_preset():
        return TrainConfig(ckpt="preset-model", dataset_path="preset.jsonl", reward_fn_path=plugin_files[1],
                           lr=5e-6, n_samples=4, activation_checkpointing=False, max_steps=20)

    monkeypatch.setitem(presets.PRESETS, "unit", unit_preset)
    code, out, _ = run(capsys, "train", "--preset", "unit", "--lr", "1e-5", "--max-steps", "3")
    assert code == 0
    cfg = runners["train"]
    assert (cfg.preset, cfg.ckpt, cfg.n_samples, cfg.activation_checkpointing) == ("unit", "preset-model", 4, False)
    assert (cfg.lr, cfg.max_steps) == (1e-5, 3)
    assert "grpo on preset-model, 3 steps" in out
    assert "grpo on preset-model, 1 step," in run(capsys, "train", "--preset", "unit", "--max-steps", "1")[1]
    run(capsys, "train", "--preset", "unit", "--activation-checkpointing")
    assert runners["train"].activation_checkpointing is True and runners["train"].lr == 5e-6
    code, _, err = run(capsys, "train", "--preset", "unit", "--world-size", "3", "--tp-size", "2")
    assert code == 2 and "--world-size" in err
    code, _, err = run(capsys, "train", "--preset", "nope")
    known = err.split("known presets: ")[1].strip().split(", ")
    assert code == 2 and {"quickstart", "unit"} <= set(known) and known == sorted(known)


def test_a_preset_that_overwrites_gives_way_to_resume(capsys, plugin_files, runners, monkeypatch, tmp_path):
    """The documented way to continue a quickstart run: the preset's overwrite meets an explicit --resume."""
    def demo():
        return TrainConfig(ckpt="preset-model", dataset_path="preset.jsonl", reward_fn_path=plugin_files[1],
                           save_path=str(tmp_path / "run"), overwrite=True)

    monkeypatch.setitem(presets.PRESETS, "demo", demo)
    code, _, err = run(capsys, "train", "--preset", "demo", "--resume")
    assert code == 0, err
    assert runners["train"].resume and not runners["train"].overwrite
    assert run(capsys, "train", "--preset", "demo")[0] == 0 and runners["train"].overwrite
    code, _, err = run(capsys, "train", "--preset", "demo", "--resume", "--overwrite")
    assert code == 2 and "--overwrite" in err  # both given explicitly still contradict


def test_abbreviated_flags_are_unknown_not_guessed(capsys, base):
    code, _, err = run(capsys, "train", *base, "--max-step", "2")
    assert code == 2 and "unrecognized arguments: --max-step" in err
    code, _, err = run(capsys, "serve", "--model-path", "m", "--po", "8001")
    assert code == 2 and "unrecognized arguments: --po" in err


def test_top_level_version_help_and_platform_dispatch(capsys, monkeypatch):
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.strip() == f"areno {__version__}"
    code, out, _ = run(capsys, "--help")
    assert code == 0 and all(c in out for c in ("train", "serve", "check", "env"))
    assert run(capsys)[0] == 2
    assert run(capsys, "bogus")[0] == 2
    calls = []
    fake = types.SimpleNamespace(run_check=lambda argv: calls.append(("check", argv)) or 1,
                                 run_env=lambda argv: calls.append(("env", argv)) or 0)
    monkeypatch.setitem(sys.modules, "areno.platform.checks", fake)
    assert run(capsys, "check")[0] == 1
    assert run(capsys, "env", "--json")[0] == 0
    assert calls == [("check", []), ("env", ["--json"])]


def test_a_gpu_index_the_machine_lacks_exits_2_naming_the_flag(capsys, base, runners, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    code, _, err = run(capsys, "train", *base, "--train-devices", "0", "--rollout-devices", "1..2")
    assert code == 2 and "--rollout-devices names GPU 2, but this machine has 2" in err
    code, _, err = run(capsys, "train", *base, "--train-devices", "5")
    assert code == 2 and "--train-devices names GPU 5" in err
    assert run(capsys, "train", *base, "--train-devices", "0", "--rollout-devices", "1")[0] == 0


def test_serve_api_key_from_the_environment(capsys, monkeypatch, runners):
    """--api-key on the command line shows in `ps`; ARENO_API_KEY (vLLM's VLLM_API_KEY) does not. The flag wins."""
    monkeypatch.setenv("ARENO_API_KEY", "from-env")
    assert ServeConfig(model_path="m").api_key == "from-env"
    assert ServeConfig(model_path="m", api_key="from-flag").api_key == "from-flag"
    code, out, _ = run(capsys, "serve", "--model-path", "m", "--verbose")
    assert code == 0 and runners["serve"].api_key == "from-env" and "from-env" not in out and "'***'" in out
    monkeypatch.delenv("ARENO_API_KEY")
    assert ServeConfig(model_path="m").api_key is None
