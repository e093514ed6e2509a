"""--mtp-loss-weight (areno.training.mtp): the MTP draft trains on the policy's own samples beside the RL loss. Its
cross-entropy falls while the policy stays exactly the W = 0 run's (losses, grad norms and every non-MTP tensor,
float32); a resumed run continues exactly (the draft's optimizer state is in the checkpoint); the colocated engine
drafts with the trained weights after each update (its draft's tensors equal the trainer's); split mode streams them
(the verified sync compares the engine's draft with the trainer's); combinations not built exit 2 naming the flag."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from areno.cli import main
from areno.config import TrainConfig
from areno.rl.loop import TrainLoop
from areno.testing import make_tiny_checkpoint
from tests.helpers.families import write_arith_data

REWARD = ("def reward_fn(record):\n"
          "    return float(len(record.completion) % 3 == 0) + 0.1 * record.completion.count('1')\n")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    ckpt = make_tiny_checkpoint(root / "ckpt", family="qwen3_5", seed=0)
    data, reward = write_arith_data(root, 16)
    reward.write_text(REWARD)  # varies within a group: the policy moves
    return ckpt, data, reward


def train_args(files, out, *extra, steps=3):
    ckpt, data, reward = files
    return ["train", "--ckpt", str(ckpt), "--dataset-path", str(data), "--reward-fn-path", str(reward),
            "--batch-size", "2", "--n-samples", "2", "--mini-bs", "1", "--max-steps", str(steps), "--max-new-tokens",
            "6", "--save-path", str(out), "--lr", "1e-2", "--temperature", "0.7", "--no-tensorboard", "--dtype",
            "float32", "--save-interval", "1", *extra]


def metrics(out):
    return [json.loads(x) for x in (out / "metrics" / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(files, tmp_path_factory):
    """The same 3-step GRPO run with --mtp-loss-weight 1 and without (4 optimizer updates a step)."""
    root = tmp_path_factory.mktemp("runs")
    assert main(train_args(files, root / "mtp", "--mtp-loss-weight", "1")) == 0
    assert main(train_args(files, root / "plain")) == 0
    return root / "mtp", root / "plain"


def test_the_mtp_loss_falls_and_the_policy_is_the_w0_runs(runs):
    a, b = runs
    ma, mb = metrics(a), metrics(b)
    assert [m["step"] for m in ma] == [m["step"] for m in mb] == [1, 2, 3]
    for x, y in zip(ma, mb):
        for key in ("loss", "grad_norm", "reward_mean", "logprob_diff"):
            assert x[key] == y[key], key  # bit for bit: the MTP loss never reaches the policy's gradient
        assert "mtp_loss" not in y and 0.0 <= x["mtp_accuracy"] <= 1.0 and x["mtp_grad_norm"] > 0
    assert ma[-1]["mtp_loss"] < ma[0]["mtp_loss"] - 0.3
    for step in (1, 3):
        wa = load_file(str(a / f"step-{step}" / "model.safetensors"))
        wb = load_file(str(b / f"step-{step}" / "model.safetensors"))
        assert wa.keys() == wb.keys()
        mtp = {k for k in wa if k.startswith("mtp.")}
        assert mtp and all(torch.equal(wa[k], wb[k]) for k in wa if k not in mtp)
        moved = [k for k in mtp if not torch.equal(wa[k], wb[k])]
        assert len(moved) > len(mtp) // 2  # trained and saved under their Hub names (W = 0: --ckpt's tensors)


def test_a_resumed_run_continues_exactly(files, runs, tmp_path):
    full = runs[0]
    part = tmp_path / "part"
    shutil.copytree(full, part)
    shutil.rmtree(part / "step-3")
    assert (part / "step-2" / "training_state" / "optimizer-mtp-rank0.pt").is_file()
    assert main(train_args(files, part, "--mtp-loss-weight", "1", "--resume", "latest")) == 0
    assert metrics(part)[-1]["mtp_loss"] == metrics(full)[-1]["mtp_loss"]
    wa = load_file(str(full / "step-3" / "model.safetensors"))
    wb = load_file(str(part / "step-3" / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def engine_drafts_with_the_trainers_weights(loop) -> bool:
    mine, theirs = (dict(d.named_parameters()) for d in (loop.trainer.mtp.draft, loop.engine.engine.spec.draft))
    return mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


@pytest.mark.parametrize("family, dtype", [("deepseek_v3", "float32"), ("deepseek_v3", "bfloat16")])
def test_the_colocated_engine_drafts_with_the_trained_weights(family, dtype, files, tmp_path):
    _, data, reward = files
    # a bf16 checkpoint trained in float32 or bf16: the MTP tensors are held in the run's dtype, as the rest of the
    # policy, and the router's in float32 (a bf16 kept copy would round the fp32 router the engine reloads)
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", family=family, seed=0, dtype=torch.bfloat16)
    cfg = TrainConfig(ckpt=str(ckpt), dataset_path=str(data), reward_fn_path=str(reward), batch_size=2, n_samples=2,
                      mini_bs=2, max_steps=2, max_new_tokens=6, dtype=dtype, lr=1e-2, tensorboard=False,
                      metrics_dir=str(tmp_path / "m"), speculative_tokens=2, eager_decode=True, decode_steps=1,
                      mtp_loss_weight=1.0)
    loop = TrainLoop(cfg)
    try:
        loop.setup()
        engine = loop.engine.engine
        first = {k: v.clone() for k, v in engine.spec.draft.named_parameters()}
        steps = [loop.step(batch) for batch, _ in zip(loop.data, range(2))]
        loop.engine.refresh()  # before the next rollout: the engine's draft reloads the last update's weights
        assert engine_drafts_with_the_trainers_weights(loop)
        assert any(not torch.equal(first[k], v) for k, v in engine.spec.draft.named_parameters())
        kept = engine.spec.draft.hub_tensors(engine.model)  # and the kept tensors a checkpoint saves hold them
        assert all(torch.equal(v, getattr(engine.model.mtp, f"t{j}"))
                   for j, (k, v) in enumerate(kept.items()))
        assert all(1.0 <= m["spec_accept_len"] <= 3.0 and m["mtp_loss"] > 0 for m in steps)
    finally:
        loop.close()


def test_split_mode_streams_the_trained_draft(files, tmp_path):
    """One on-policy split run with speculation: every sync is verified (the engine's kept MTP tensors and its
    draft's parameters equal the trainer's), and the accept length is logged every step."""
    from tests.helpers.split_runs import areno

    out = tmp_path / "split"
    areno(files, out, "--train-devices", "0", "--rollout-devices", "1", "--mtp-loss-weight", "1",
          "--speculative-tokens", "2", "--eager-decode", "--decode-steps", "1", steps=2, ARENO_VERIFY_POLICY_SYNC="1")
    steps = metrics(out)
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["mtp_loss"] > 0 and 1.0 <= m["spec_accept_len"] <= 3.0 for m in steps)
    assert steps[1]["policy_sync_verified"] == 1.0  # step 1's update synced before step 2's rollout


def exit_code(argv) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # refused while parsing
        return e.code


REFUSED = [
    (["--algo", "sft"], "--mtp-loss-weight does not apply to --algo sft"),
    (["--lora-rank", "4"], "--mtp-loss-weight with --lora-rank > 0 is not built yet"),
    (["--world-size", "2", "--tp-size", "2"], "--mtp-loss-weight with --tp-size > 1 is not built yet"),
    (["--rollout-dtype", "fp8"], "--mtp-loss-weight with --rollout-dtype fp8 is not built yet"),
    (["--train-cuda-graphs", "on", "--no-activation-checkpointing"],
     "--mtp-loss-weight with --train-cuda-graphs on is not built yet"),
]


@pytest.mark.parametrize("extra,message", REFUSED, ids=["sft", "lora", "tp", "fp8", "graphs"])
def test_combinations_not_built_exit_2_naming_both_flags(files, tmp_path, capsys, extra, message):
    argv = train_args(files, tmp_path / "o", "--mtp-loss-weight", "0.5", *extra)
    if "sft" in extra:
        for flag in ("--n-samples", "--temperature"):
            i = argv.index(flag)
            del argv[i : i + 2]
    assert exit_code(argv) == 2
    assert message in capsys.readouterr().err


def test_a_model_without_mtp_layers_or_a_negative_weight_exits_2(files, tmp_path, capsys):
    plain = make_tiny_checkpoint(tmp_path / "qwen3", family="qwen3", seed=0)
    argv = train_args(files, tmp_path / "o", "--mtp-loss-weight", "1")
    argv[argv.index("--ckpt") + 1] = str(plain)
    assert exit_code(argv) == 2
    assert "--mtp-loss-weight needs a model with MTP" in capsys.readouterr().err
    assert exit_code(train_args(files, tmp_path / "o", "--mtp-loss-weight", "-1")) == 2
    assert "--mtp-loss-weight must be" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_5", "bailing_hybrid"])
def test_bf16_gpu_run_trains_the_draft_the_engine_drafts_with(family, files, tmp_path):
    """On the GPU in bf16 (Triton kernels, the hybrids' recurrent states, speculation on): the MTP loss falls, the
    accept length is logged every step and the engine's draft equals the trainer's after the last update."""
    _, data, reward = files
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", family=family, seed=0, dtype=torch.bfloat16)
    cfg = TrainConfig(ckpt=str(ckpt), dataset_path=str(data), reward_fn_path=str(reward), batch_size=2, n_samples=2,
                      mini_bs=1, max_steps=4, max_new_tokens=8, dtype="bfloat16", lr=1e-2, temperature=0.7,
                      tensorboard=False, metrics_dir=str(tmp_path / "m"), speculative_tokens=2, eager_decode=True,
                      decode_steps=1, mtp_loss_weight=1.0)
    loop = TrainLoop(cfg)
    try:
        loop.setup()
        steps = [loop.step(batch) for batch, _ in zip(loop.data, range(4))]
        loop.engine.refresh()
        assert engine_drafts_with_the_trainers_weights(loop) and loop.trainer.mtp.draft.proj[0].weight.is_cuda
    finally:
        loop.close()
    assert steps[-1]["mtp_loss"] < steps[0]["mtp_loss"]
    assert all(1.0 <= m["spec_accept_len"] <= 3.0 for m in steps)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fit_draft_learns_in_half_precision_as_in_fp32(files, dtype):
    """``fit_draft`` (the speculation bench's and tests' stand-in for released MTP layers) keeps fp32 master weights
    and moments: on an fp16 model plain Adam's loss went NaN in a few steps; here both half dtypes fall as fp32's."""
    from areno.models import load_model
    from areno.training.mtp import fit_draft

    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 500, (40,), generator=g).tolist() for _ in range(4)]
    ref = fit_draft(load_model(files[0], dtype=torch.float32, device="cpu"), seqs, 40)
    out = fit_draft(load_model(files[0], dtype=dtype, device="cpu"), seqs, 40)
    assert out["mtp_loss_last"] < out["mtp_loss_first"] - 1.0
    assert abs(out["mtp_loss_last"] - ref["mtp_loss_last"]) < 0.1, (out, ref)
