"""Per-algorithm flag applicability (issue 37, point 2): each `areno train` flag declares the algorithms and the
condition (split mode, agentic rollout, a reference model, ...) where it applies. For every algorithm x flag: given
where it applies, it is accepted and reaches the run; given where it does not, it is refused with exit 2 naming it;
and a real (tiny, CPU) run of each algorithm reads every flag declared as applying to it there."""

import json
import sys
import types

import pytest

from areno.cli import main
from areno.config import ConfigError, TrainConfig, flag_name
from areno.config.applies import CONDITIONS, declared
from areno.config.constants import ALGOS, RL_ALGOS
from areno.presets import PRESETS
from tests.helpers.flag_context import Files, base_argv, condition_argv, flag_argv, merged, train_fields

# conditions that hold for an algorithm with nothing added (its base command line)
# (--off-policy-correction's own value, seq-tis, is the one gspo takes)
HOLDS_BY_ITSELF = ({("rollout", a) for a in RL_ALGOS} | {("correction", a) for a in RL_ALGOS} | {("reference", "dpo")}
                   | {("tis", "grpo"), ("tis", "ppo"), ("surrogate", "ppo")})
# what breaks a condition that the base command line meets
BREAKS = {"epochs": ["--max-steps", "3"]}


@pytest.fixture
def files(tmp_path):
    return Files(tmp_path)


@pytest.fixture
def cli(monkeypatch, tmp_path, capsys):
    """`areno train` with the model check and the runtime stubbed: (exit code, stderr, the config the run got)."""
    monkeypatch.setattr("areno.models.loader.check_model_source", lambda flag, value: None)
    monkeypatch.setattr("areno.models.loader.check_engine_support", lambda flag, value: None)
    seen = []
    monkeypatch.setitem(sys.modules, "areno.rl.runner", types.SimpleNamespace(run_train=lambda c: seen.append(c) or 0))
    monkeypatch.chdir(tmp_path)

    def call(argv):
        seen.clear()
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
        return code, capsys.readouterr().err, (seen[0] if seen else None)

    return call


def test_declarations_name_known_algorithms_and_conditions():
    used = set()
    for f in train_fields():
        algos, needs = declared(f)
        assert algos and set(algos) <= set(ALGOS), f.name
        assert needs is None or needs in CONDITIONS, f.name
        used.add(needs)
    assert used - {None} == set(CONDITIONS)


@pytest.mark.parametrize("algo", ALGOS)
def test_every_flag_is_accepted_where_it_applies_and_refused_where_not(algo, files, cli):
    applying = 0
    for f in train_fields():
        algos, needs = declared(f)
        flag, given = flag_name(f.name), flag_argv(f, files)
        if algo not in algos:
            code, err, _ = cli(merged(base_argv(algo, files), given))
            assert code == 2 and f"error: {flag} does not apply to --algo {algo} (it is used by: " in err, (flag, err)
            continue
        applying += 1
        code, err, config = cli(merged(base_argv(algo, files) + condition_argv(needs, algo, files), given))
        assert code == 0, (flag, err)
        assert getattr(config, f.name) != f.default, flag  # it reached the run
        if needs is None or (needs, algo) in HOLDS_BY_ITSELF:
            continue
        code, err, _ = cli(merged(base_argv(algo, files, reward=False) + BREAKS.get(needs, []), given))
        assert code == 2 and f"error: {flag} " in err, (flag, needs, err)
    assert applying >= 40  # the flags every algorithm shares at least


@pytest.mark.parametrize("argv,flag", [
    (["--algo", "sft", "--n-samples", "4"], "--n-samples"),
    (["--algo", "sft", "--temperature", "0.5"], "--temperature"),
    (["--algo", "sft", "--max-new-tokens", "8"], "--max-new-tokens"),  # no --reward-fn-path: no evaluation either
    (["--algo", "dpo", "--ppo-epochs", "2"], "--ppo-epochs"),
    (["--algo", "grpo", "--dpo-beta", "0.2"], "--dpo-beta"),
    (["--algo", "grpo", "--critic-lr", "1e-5"], "--critic-lr"),
    (["--algo", "grpo", "--gae-lambda", "0.9"], "--gae-lambda"),
    (["--algo", "gspo", "--clip-eps-high", "0.3"], "--clip-eps-high"),
    (["--algo", "ppo", "--filter-zero-variance-groups"], "--filter-zero-variance-groups"),
    (["--algo", "grpo", "--kl-estimator", "k1"], "--kl-estimator"),  # no --kl-coef: no KL term
    (["--algo", "grpo", "--train-devices", "0", "--max-staleness", "1"], "--max-staleness"),  # colocated
    (["--algo", "grpo", "--max-steps", "3", "--epochs", "2"], "--epochs"),
    (["--algo", "sft", "--off-policy-correction", "icepop"], "--off-policy-correction"),
    (["--algo", "dpo", "--off-policy-correction", "cispo"], "--off-policy-correction"),
    (["--algo", "gspo", "--off-policy-correction", "icepop"], "--off-policy-correction"),  # not built for gspo
    (["--algo", "grpo", "--is-mask-low", "0.3"], "--is-mask-low"),  # tis: no mask
    (["--algo", "grpo", "--off-policy-correction", "cispo", "--tis-cap", "3"], "--tis-cap"),
    (["--algo", "ppo", "--off-policy-correction", "cispo", "--dual-clip", "2"], "--dual-clip"),
])
def test_the_issue_s_silent_flags_exit_2_naming_the_flag(argv, flag, files, cli):
    command = ["train", "--ckpt", "m", "--dataset-path", "d.jsonl", *argv]
    if argv[1] in RL_ALGOS:
        command += ["--reward-fn-path", files["reward"]]
    code, err, config = cli(command)
    assert code == 2 and f"areno train: error: {flag} " in err and config is None
    assert len(err.strip().splitlines()) == 2  # usage + one line


def test_a_preset_switched_to_another_algorithm_keeps_only_what_applies(files, cli, monkeypatch):
    """A preset's own settings are not flags the user gave: those that do not apply to the algorithm the user
    switched to go back to their defaults, named in one line; the same flag given explicitly is refused."""

    def rl_preset():
        return TrainConfig(preset="rl", ckpt="m", dataset_path="d.jsonl", reward_fn_path=files["reward"], algo="grpo",
                           n_samples=4, temperature=0.7, kl_coef=0.1, kl_estimator="k1", sft_warmup_steps=3,
                           sft_warmup_lr=1e-3, max_new_tokens=16, lr=1e-5)

    monkeypatch.setitem(PRESETS, "rl", rl_preset)
    code, err, config = cli(["train", "--preset", "rl", "--algo", "sft"])
    assert code == 0, err
    dropped = ("n_samples", "temperature", "kl_coef", "kl_estimator", "sft_warmup_steps", "sft_warmup_lr")
    for name in dropped:
        assert getattr(config, name) == TrainConfig.__dataclass_fields__[name].default, name
        assert flag_name(name) in err
    assert (config.algo, config.lr, config.max_new_tokens) == ("sft", 1e-5, 16)  # these apply to SFT (evaluation)
    code, err, _ = cli(["train", "--preset", "rl", "--algo", "sft", "--temperature", "0.7"])
    assert code == 2 and "--temperature does not apply to --algo sft" in err
    code, err, config = cli(["train", "--preset", "rl", "--algo", "ppo"])  # all of it applies to PPO
    assert code == 0 and err == "" and (config.n_samples, config.kl_estimator) == (4, "k1")

    def agentic_preset():  # a dropped --agent-fn takes the agentic settings with it
        return TrainConfig(preset="agentic", ckpt="m", dataset_path="d.jsonl", agent_fn=files["agent"],
                           agent_timeout_s=30.0, max_context_len=512, n_samples=4)

    monkeypatch.setitem(PRESETS, "agentic", agentic_preset)
    code, err, config = cli(["train", "--preset", "agentic", "--algo", "sft"])
    assert code == 0, err
    assert (config.agent_fn, config.agent_timeout_s, config.max_context_len) == (None, 300.0, None)
    assert all(flag in err for flag in ("--agent-fn", "--agent-timeout-s", "--max-context-len", "--n-samples"))


def test_the_sdk_refuses_a_keyword_that_does_not_apply(monkeypatch):
    from areno.api import Trainer

    with pytest.raises(ConfigError, match="--n-samples does not apply to --algo sft"):
        Trainer(model_path="m", algo="sft", dataset_path="d.jsonl", n_samples=4).init()
    with pytest.raises(ConfigError, match="--dpo-beta does not apply to --algo grpo"):
        Trainer(model_path="m", dpo_beta=0.2).init()


# ---- the declarations against what each algorithm's code path reads ----------------------------------------------

READS = set()
FIELDS = set(TrainConfig.__dataclass_fields__)


class RecordingConfig(TrainConfig):
    """A TrainConfig that records the fields the run reads (not dataclasses' copies: asdict for config.json)."""

    def __getattribute__(self, name):
        if name in FIELDS and not sys._getframe(1).f_code.co_filename.endswith("dataclasses.py"):
            READS.add(name)
        return object.__getattribute__(self, name)


# fields a tiny CPU run of the default mode cannot read although they apply there, and why
NOT_READ_HERE = {
    "preset": "the CLI's base config", "verbose": "printed by the CLI",
    "resume": "read only by a resumed run (tests/rl/test_loop.py resumes)",
    "overwrite": "a new run reads it when it claims --save-path (tests/training/test_run_dir.py)",
    "nnodes": "read where the ranks are launched (areno.rl.runner; tests/distributed/test_cluster.py)",
    "master_port": "read where the ranks are launched (tests/distributed/test_cluster.py)",
    "max_restarts": "read where the ranks are launched (tests/distributed/test_restart.py)",
}


def _rows():
    row = {"prompt": "a b", "response": "c", "chosen": "c", "rejected": "d", "answer": "c"}
    return [dict(row, prompt=f"{i} a b") for i in range(2)] + [dict(row, split="eval")]


@pytest.fixture(scope="module")
def tiny_run_inputs(tmp_path_factory):
    from areno.testing import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("applies")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    return make_tiny_checkpoint(root / "model", family="qwen3", seed=0), data


@pytest.mark.slow  # a real one-step run per algorithm: 5-10 s each on 2 cores (the first pays the warm-up)
@pytest.mark.parametrize("algo", ALGOS)
def test_a_run_of_each_algorithm_reads_every_flag_that_applies_to_it(algo, tmp_path, files, tiny_run_inputs):
    """One step with held-out evaluation before and after, a save, KL for RL: every flag that applies to ``algo`` in
    this run's mode is read by it (the conditions it does not meet, split mode, an agent, ..., are other runs')."""
    from areno.rl.loop import TrainLoop

    ckpt, data = tiny_run_inputs
    rl = algo in RL_ALGOS
    config = RecordingConfig(
        ckpt=str(ckpt), dataset_path=str(data), reward_fn_path=files["reward"], algo=algo, batch_size=2,
        n_samples=2 if rl else 8, mini_bs=2, max_new_tokens=2, dtype="float32", lr=1e-3, tensorboard=False,
        save_path=str(tmp_path / "out"), save_interval=1, kl_coef=0.1 if rl else 0.0, stop=["zz"],
        rollout_dump_dir=str(tmp_path / "dump") if rl else None)
    READS.clear()
    loop = TrainLoop(config)
    try:
        loop.setup()
        loop.fit()
    finally:
        loop.close()
    read = set(READS)
    values = {name: getattr(config, name) for name in FIELDS}
    missing = []
    for f in train_fields():
        algos, needs = declared(f)
        if algo not in algos or f.name in NOT_READ_HERE or f.name in read:
            continue
        holds = needs is None or CONDITIONS[needs].holds(values)
        if holds:
            missing.append(f.name)
    assert not missing, f"declared as applying to {algo} but not read by its run: {missing}"
