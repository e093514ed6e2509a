"""The training loop end to end on a tiny checkpoint: every algorithm through `areno train`, the on-policy
invariants, gradient accumulation, checkpoint + resume, and clear errors for bad plugins."""

import json
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from areno.cli import main
from areno.config import TrainConfig
from areno.models import load_model
from areno.rl.algorithms import grpo
from areno.rl.loop import TrainLoop
from tests.helpers.families import tiny_rl_files


@pytest.fixture(scope="module")
def setup_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("loop")
    return (*tiny_rl_files(root), root)


def base_args(ckpt, data, reward, out):
    return ["--ckpt", str(ckpt), "--dataset-path", str(data), "--reward-fn-path", str(reward), "--batch-size", "4",
            "--n-samples", "2", "--mini-bs", "2", "--max-steps", "2", "--max-new-tokens", "6", "--save-path",
            str(out), "--lr", "1e-3", "--no-tensorboard", "--dtype", "float32"]


@pytest.mark.parametrize("algo", ["sft", "dpo", "grpo", "gspo", "ppo"])
def test_every_algorithm_runs_and_saves_a_reloadable_checkpoint(setup_files, algo, capsys):
    ckpt, data, reward, root = setup_files
    out = root / f"out-{algo}"
    extra = ["--kl-coef", "0.05"] if algo == "grpo" else []
    args = base_args(ckpt, data, reward, out)
    if algo in ("sft", "dpo"):  # nothing is sampled: --n-samples does not apply there (refused with exit 2)
        del args[args.index("--n-samples"):args.index("--n-samples") + 2]
    assert main(["train", "--algo", algo, *args, *extra]) == 0
    saved = out / "step-2"
    assert (saved / "COMPLETE").exists() and (saved / "config.json").exists()
    lines = [json.loads(x) for x in (out / "metrics" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2] and all(x["loss"] is not None for x in lines)
    mine = load_model(saved, dtype=torch.float32, device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    assert torch.allclose(mine.logits(ids), hf(ids).logits, atol=1e-4)
    start = load_model(ckpt, dtype=torch.float32, device="cpu")
    moved = any(not torch.equal(a, b) for a, b in zip(mine.parameters(), start.parameters()))
    assert moved or algo in ("grpo", "gspo", "ppo")  # RL may see all-equal rewards on a random model


def loop_config(setup_files, **kw):
    ckpt, data, reward, root = setup_files
    cfg = TrainConfig(ckpt=str(ckpt), dataset_path=str(data), reward_fn_path=str(reward), algo="grpo",
                      batch_size=4, n_samples=2, mini_bs=2, max_new_tokens=6, dtype="float32", lr=1e-3,
                      tensorboard=False, metrics_dir=str(root / "m"), seed=0)
    return replace(cfg, **kw)


def test_first_on_policy_step_has_ratio_one_and_zero_kl(setup_files):
    loop = TrainLoop(loop_config(setup_files, kl_coef=0.1, max_steps=1))
    loop.setup()
    m = loop.step(next(iter(loop.data)))
    loop.close()
    assert m["logprob_diff_max"] < 1e-4  # trainer log-probs == rollout log-probs (fp32 native kernels)
    if "ratio" in m:  # absent only when every group had equal rewards and was skipped
        assert m["ratio"] == pytest.approx(1.0, abs=1e-4)
        assert m["kl"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("algo", ["grpo", "gspo"])
def test_single_update_step_skips_the_logprob_pass_with_the_same_result(setup_files, monkeypatch, algo):
    """One update per rollout batch: the update's own forward replaces the no-grad log-prob pass; the weights,
    the TIS-weighted loss and the reported rollout-vs-trainer difference are those of the separate pass."""

    def one_step(inline):
        loop = TrainLoop(loop_config(setup_files, algo=algo, gradient_accumulation_steps=4, max_steps=1,
                                     temperature=0.7, tis_cap=2.0))
        loop.setup()
        monkeypatch.setattr(grpo, "makes_one_update", lambda ctx, rows: inline)
        calls = []
        orig = loop.trainer.compute_logprobs
        monkeypatch.setattr(loop.trainer, "compute_logprobs", lambda *a, **k: calls.append(1) or orig(*a, **k))
        m = loop.step(next(iter(loop.data)))
        loop.close()
        return m, [p.detach().clone() for p in loop.model.parameters()], calls

    m1, w1, calls1 = one_step(True)
    m0, w0, calls0 = one_step(False)
    assert calls1 == [] and calls0 == [1]
    assert m1["num_updates"] == m0["num_updates"] == 1
    for k in ("loss", "logprob_diff", "logprob_diff_max"):
        assert m1[k] == pytest.approx(m0[k], rel=1e-4, abs=1e-6), k
    assert all(torch.allclose(a, b, atol=1e-6, rtol=1e-5) for a, b in zip(w1, w0))


def _weights_after_one_update(setup_files, mini_bs, accum):
    cfg = loop_config(setup_files, algo="sft", batch_size=8, mini_bs=mini_bs, gradient_accumulation_steps=accum,
                      max_steps=1)
    loop = TrainLoop(cfg)
    loop.setup()
    m = loop.step(next(iter(loop.data)))
    loop.close()
    assert m["num_updates"] == 1
    return [p.detach().clone() for p in loop.model.parameters()]


def test_gradient_accumulation_equals_one_big_microbatch(setup_files):
    a = _weights_after_one_update(setup_files, 1, 8)
    b = _weights_after_one_update(setup_files, 8, 1)
    assert all(torch.allclose(x, y, atol=1e-6, rtol=1e-5) for x, y in zip(a, b))


def test_resume_reproduces_the_next_step(setup_files):
    ckpt, data, reward, root = setup_files
    full, part = root / "full", root / "part"
    args = lambda out, steps: ["train", "--algo", "sft", "--ckpt", str(ckpt), "--dataset-path", str(data),  # noqa
                               "--batch-size", "4", "--mini-bs", "2", "--lr", "1e-3", "--no-tensorboard",
                               "--dtype", "float32", "--save-path", str(out), "--save-interval", "2",
                               "--max-steps", str(steps)]
    assert main(args(full, 3)) == 0
    assert main(args(part, 2)) == 0
    assert main(args(part, 3) + ["--resume", str(part / "step-2")]) == 0
    loss = lambda out: [json.loads(x)["loss"] for x in (out / "metrics" / "metrics.jsonl").read_text().splitlines()]  # noqa
    assert loss(part)[-1] == pytest.approx(loss(full)[-1], rel=1e-5)


def test_bad_plugins_exit_2_naming_the_flag(setup_files, tmp_path, capsys):
    ckpt, data, reward, root = setup_files
    bad = tmp_path / "bad_reward.py"
    bad.write_text("def not_the_reward(x):\n    return 0\n")
    rc = main(["train", "--algo", "grpo", *base_args(ckpt, data, bad, tmp_path / "o")])
    assert rc == 2 and "--reward-fn-path" in capsys.readouterr().err
    broken = tmp_path / "broken_loader.py"
    broken.write_text("def load_training_dataset(:\n")
    rc = main(["train", "--algo", "grpo", *base_args(ckpt, data, reward, tmp_path / "o"),
               "--dataset-loader-fn", str(broken)])
    assert rc == 2 and "--dataset-loader-fn" in capsys.readouterr().err


def test_sft_warmup_has_its_own_lr_then_rl_starts_fresh_and_fit_reports_held_out_accuracy(setup_files, tmp_path,
                                                                                           capsys):
    ckpt, data, reward, root = setup_files
    rows = [json.loads(x) for x in data.read_text().splitlines()]
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({**r, "split": "eval"} if i < 8 else r) + "\n" for i, r in enumerate(rows)))
    metrics = tmp_path / "m"
    cfg = loop_config(setup_files, dataset_path=str(held), metrics_dir=str(metrics), sft_warmup_steps=3,
                      sft_warmup_lr=5e-3, lr=1e-3, lr_decay_style="linear", max_steps=2, temperature=0.7,
                      mini_bs=8, save_path=str(tmp_path / "out"))  # one optimizer update per step
    loop = TrainLoop(cfg)
    loop.setup()
    rl_schedule = loop.trainer.schedule
    try:
        results = loop.fit()
    finally:
        loop.close()
    lines = [json.loads(x) for x in (metrics / "metrics.jsonl").read_text().splitlines()]
    warm = [x for x in lines if "warmup_lr" in x]
    assert [x["step"] for x in warm] == [-2, -1, 0]
    assert [x["warmup_lr"] for x in warm] == pytest.approx([5e-3, 5e-3 * 2 / 3, 5e-3 / 3])  # linear over 3 updates
    rl = [x for x in lines if x["step"] > 0 and "reward_mean" in x]
    assert [x["step"] for x in rl] == [1, 2]
    assert loop.trainer.schedule is rl_schedule and loop.trainer.temperature == 0.7
    lrs = [x["lr"] for x in rl if "lr" in x]  # absent from a step skipped for all-equal rewards
    assert lrs == pytest.approx([1e-3, 5e-4][: len(lrs)])  # the RL schedule from its first update
    out = capsys.readouterr().out
    assert "held-out accuracy: before RL" in out and "-> after RL" in out
    assert results["accuracy_before"] is not None and results["accuracy_after"] is not None
    assert lines[-1]["eval_accuracy_before"] == results["accuracy_before"]
    assert results["checkpoint"] == str(tmp_path / "out" / "step-2")
    if results["reward_curve"] is not None:  # None only without matplotlib
        assert (metrics / "reward_curve.png").exists()


def test_fit_without_matplotlib_warns_and_still_finishes(setup_files, tmp_path, monkeypatch, caplog):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    ckpt, data, reward, root = setup_files
    rows = [json.loads(x) for x in data.read_text().splitlines()]
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({**r, "split": "eval"} if i < 4 else r) + "\n" for i, r in enumerate(rows)))
    loop = TrainLoop(loop_config(setup_files, dataset_path=str(held), metrics_dir=str(tmp_path / "m"), max_steps=1))
    loop.setup()
    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    try:
        results = loop.fit()
    finally:
        monkeypatch.undo()
        loop.close()
    assert results["reward_curve"] is None and not (tmp_path / "m" / "reward_curve.png").exists()
    assert "no reward-curve plot" in caplog.text


def test_prefixes_cached_under_an_older_policy_are_not_reused_after_an_update(setup_files, tmp_path, monkeypatch):
    """Prompts sharing a long system prompt: step 2's rollout must not read K/V that step 1's policy computed (the
    prefix cache is dropped when the weights change), so the rollout and the trainer agree on every log-prob."""
    from areno.rl.rollout.colocated import ColocatedRollout

    system = {"role": "system", "content": "You are a careful calculator. " * 12}
    data = tmp_path / "system.jsonl"
    data.write_text("".join(json.dumps({"prompt": [system, {"role": "user", "content": f"{a}+{a}="}],
                                        "answer": str(2 * a)}) + "\n" for a in range(8)))

    def second_step(stale: bool) -> float:
        if stale:  # what happened before the fix: the cache outlives the update
            monkeypatch.setattr(ColocatedRollout, "refresh", lambda self: None)
        loop = TrainLoop(loop_config(setup_files, dataset_path=str(data), max_steps=2, lr=1e-2))
        loop.setup()
        try:
            batches = iter(loop.data)
            loop.step(next(batches))
            assert loop.engine.engine.blocks.cached  # the shared prefix was registered for reuse
            return loop.step(next(batches))["logprob_diff_max"]
        finally:
            loop.close()

    assert second_step(stale=False) < 1e-4
    assert second_step(stale=True) > 1e-3  # the check sees the bug it guards against
