"""Training on image rows: dataset prompts with images (local files relative to the dataset, data URLs) through the
shared processor, packed with [3, T] M-RoPE positions, the tower and projector frozen by default (bit-identical,
no optimizer state, eval mode), unfrozen as their own optimizer groups with their own schedules, and every refusal
as exit 2 naming the flag or the row."""

import json

import numpy as np
import pytest
import torch

from areno.cli import main
from areno.config import TrainConfig
from areno.models import load_model
from areno.models.multimodal import MultimodalProcessor, data_url
from areno.rl.loop import TrainLoop
from areno.testing import make_tiny_checkpoint
from areno.training.batch import Row, pack
from areno.training.multimodal import media_inputs
from areno.training.optimizer import MasterAdamW


def _png(path, h, w, seed):
    from PIL import Image

    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)


def _prompt(url, text="what is it?"):
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]  # fmt: skip


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("mm_train")
    vl = make_tiny_checkpoint(root / "vl", "qwen3_vl")
    text = make_tiny_checkpoint(root / "text", "qwen3")
    (root / "data" / "img").mkdir(parents=True)
    rows = []
    for i in range(6):
        _png(root / "data" / "img" / f"{i}.png", 16 + 8 * (i % 3), 24, seed=i)
        # odd rows name the file relative to the dataset, even rows inline it as a data URL
        url = f"img/{i}.png" if i % 2 else data_url((root / "data" / "img" / f"{i}.png").read_bytes())
        rows.append({"prompt": _prompt(url), "response": str(i), "chosen": str(i), "rejected": str(i + 1)})
    rows.append({"prompt": [{"role": "user", "content": "no image"}], "response": "7", "chosen": "7",
                 "rejected": "8"})  # fmt: skip
    data = root / "data" / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root, vl, text, data


def _args(ckpt, data, out, *extra):
    return ["train", "--ckpt", str(ckpt), "--dataset-path", str(data), "--batch-size", "4", "--mini-bs", "4",
            "--max-steps", "2", "--lr", "1e-2", "--no-tensorboard", "--dtype", "float32", "--save-path", str(out),
            *extra]  # fmt: skip


def _visual(model) -> dict:
    return {n: p.detach().clone() for n, p in model.visual.named_parameters()}


@pytest.mark.parametrize("algo", ["sft", "dpo"])
def test_frozen_tower_and_projector_stay_bit_identical(files, algo):
    root, vl, _, data = files
    out = root / f"frozen-{algo}"
    assert main(_args(vl, data, out, "--algo", algo)) == 0
    start, saved = load_model(vl, device="cpu"), load_model(out / "step-2", device="cpu")
    before, after = _visual(start), _visual(saved)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert any(not torch.equal(a, b) for a, b in zip(start.layers.parameters(), saved.layers.parameters()))
    lines = [json.loads(x) for x in (out / "metrics" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2] and all(np.isfinite(x["loss"]) for x in lines)
    assert not any(k.startswith("lr_mm") for x in lines for k in x)


@pytest.mark.parametrize("algo", ["grpo", "gspo", "ppo"])
def test_online_algorithms_roll_out_and_train_on_image_rows(files, algo):
    root, vl, _, data = files
    reward = root / "reward.py"
    reward.write_text("def reward_fn(record):\n    return float(len(record.completion) % 2)\n")
    out = root / f"rl-{algo}"
    assert main(_args(vl, data, out, "--algo", algo, "--reward-fn-path", str(reward), "--batch-size", "2",
                      "--n-samples", "2", "--mini-bs", "4", "--max-steps", "1", "--max-new-tokens", "4",
                      "--temperature", "1.0")) == 0  # fmt: skip
    (line,) = [json.loads(x) for x in (out / "metrics" / "metrics.jsonl").read_text().splitlines()]
    assert line["samples"] == 4 and np.isfinite(line["loss"])
    # on-policy: the trainer's log-probs of the sampled tokens (images, [3, T] positions) are the engine's
    assert line["logprob_diff_max"] < 1e-4
    start, saved = load_model(vl, device="cpu"), load_model(out / "step-1", device="cpu")
    assert all(torch.equal(a, b) for a, b in zip(start.visual.parameters(), saved.visual.parameters()))


def test_split_mode_streams_only_the_trainable_tensors(files):
    from areno.rl.rollout.policy_sync import hf_specs

    _, vl, _, _ = files
    model = load_model(vl, device="cpu")
    every = {name for name, _, _ in hf_specs(model)}
    model.freeze_media(projector=False)
    streamed = {name for name, _, _ in hf_specs(model, trainable_only=True)}
    tower = {n for n in every if n.startswith("model.visual.") and "merger" not in n}
    assert tower and streamed == every - tower


def test_unfrozen_projector_trains_as_its_own_group_on_its_own_schedule(files):
    root, vl, _, data = files
    cfg = TrainConfig(ckpt=str(vl), dataset_path=str(data), algo="sft", batch_size=4, mini_bs=4, max_steps=3,
                      lr=1e-3, tensorboard=False, dtype="float32", metrics_dir=str(root / "m-proj"),
                      unfreeze_mm_projector=True, mm_projector_lr=8e-3, mm_projector_lr_style="linear",
                      mm_projector_lr_steps=4)  # fmt: skip
    loop = TrainLoop(cfg)
    loop.setup()
    model = loop.model
    tower, projector = model.tower_parameters(), model.projector_parameters()
    opt = loop.trainer.optimizer
    assert opt.groups == ["mm_projector"]
    assert {id(p) for p in opt.params} == {id(p) for p in model.parameters() if p.requires_grad}
    assert not any(id(p) in {id(q) for q in opt.params} for p in tower)  # no optimizer state for the frozen tower
    assert all(p.requires_grad for p in projector) and not any(p.requires_grad for p in tower)
    assert not model.visual.blocks.training and model.visual.merger.training  # train() keeps the frozen part in eval
    before = _visual(model)
    lrs = []
    for batch in iter(loop.data):
        if len(lrs) == 3:
            break
        m = loop.step(batch)
        lrs.append((m["lr"], m["lr_mm_projector"]))
    loop.close()
    # one update per step: the projector decays linearly from 8e-3 over 4 updates, the decoder stays at --lr
    assert lrs == [(1e-3, 8e-3), (1e-3, 6e-3), (1e-3, 4e-3)]
    after = _visual(model)
    names = {id(p): n for n, p in model.visual.named_parameters()}
    assert all(torch.equal(before[names[id(p)]], after[names[id(p)]]) for p in tower)
    assert all(not torch.equal(before[names[id(p)]], after[names[id(p)]]) for p in projector)


def test_packed_image_rows_give_each_row_its_own_forward(files):
    root, vl, _, data = files
    model = load_model(vl, device="cpu")
    model.freeze_media()
    proc = MultimodalProcessor.from_pretrained(vl)
    first = proc.encode(_prompt(data_url((root / "data" / "img" / "1.png").read_bytes())))
    second = proc.encode(_prompt(data_url((root / "data" / "img" / "2.png").read_bytes()), "two"))
    img = model.config.image_token_id
    # a response may hold the placeholder id as a sampled text token: it stays text
    rows = [Row(first.input_ids, [5, 6, img, 7], media=first), Row([3, 4, 5], [8, 9]),
            Row(second.input_ids, [10, 11], media=second), Row(first.input_ids, [12, img], media=first)]
    packed = pack(rows)
    assert packed.positions.shape == (3, packed.input_ids.numel())
    assert packed.image_hashes == [first.image_hashes[0], second.image_hashes[0], first.image_hashes[0]]
    with torch.no_grad():
        shared = media_inputs(model, packed)  # frozen: each distinct image encoded once
        assert "image_embeds" in shared
        got = model.token_logprobs(model(packed.input_ids, packed.positions, packed.cu_seqlens, **shared),
                                   packed.targets)  # fmt: skip
        full = model.token_logprobs(model(packed.input_ids, packed.positions, packed.cu_seqlens,
                                          pixel_values=packed.pixel_values, image_grid_thw=packed.image_grid_thw,
                                          image_rows=packed.image_rows), packed.targets)  # fmt: skip
        cu = packed.cu_seqlens.tolist()
        for b, r in enumerate(rows):
            ids = torch.tensor(r.prompt_ids + r.response_ids)
            want_t = packed.targets[cu[b] : cu[b + 1]]
            if r.media is None:
                want = model.token_logprobs(model(ids, torch.arange(len(ids))), want_t)
            else:  # the oracle: M-RoPE over the whole row, the image rows given explicitly
                grid, n = r.media.image_grid_thw, len(r.prompt_ids)
                positions = model.mrope_positions(torch.tensor(r.prompt_ids + [0] * len(r.response_ids)), grid)[0]
                rows_ = (torch.tensor(r.prompt_ids) == img).nonzero().squeeze(1)
                want = model.token_logprobs(model(ids, positions, pixel_values=r.media.pixel_values,
                                                  image_grid_thw=grid, image_rows=rows_), want_t)  # fmt: skip
                assert torch.equal(positions[:, n:], torch.arange(n, len(ids)).expand(3, -1) + r.media.rope_delta)
            torch.testing.assert_close(got[cu[b] : cu[b + 1]], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)


def test_optimizer_groups_update_like_torch_adamw_param_groups():
    torch.manual_seed(0)
    main_p, tower_p = [torch.randn(5, 3), torch.randn(4)], [torch.randn(3, 3)]
    ours = [torch.nn.Parameter(p.clone()) for p in main_p + tower_p]
    ref = [torch.nn.Parameter(p.clone()) for p in main_p + tower_p]
    opt = MasterAdamW([*ours[:2], {"name": "mm_tower", "params": ours[2:]}], weight_decay=0.1)
    torch_opt = torch.optim.AdamW([{"params": ref[:2], "lr": 1e-2}, {"params": ref[2:], "lr": 3e-2}],
                                  weight_decay=0.1, foreach=False)  # fmt: skip
    with pytest.raises(ValueError, match="mm_tower"):
        opt.step(lr=1e-2)
    for step in range(3):
        grads = [torch.randn_like(p) * (step + 1) for p in ours]
        for p, q, g in zip(ours, ref, grads):
            p.grad, q.grad = g.clone(), g.clone()
        norm = opt.step(lr=1e-2, grad_clip=0.5, group_lrs={"mm_tower": 3e-2})
        assert abs(norm - float(torch.nn.utils.clip_grad_norm_(ref, 0.5))) < 1e-5
        torch_opt.step()
        for p, q in zip(ours, ref):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert [b.group for b in opt.buckets] == [None, "mm_tower"]


def test_refusals_exit_2_naming_the_flag_or_the_row(files, tmp_path, capsys):
    root, vl, text, data = files

    def run(ckpt, dataset, *extra):
        with pytest.raises(SystemExit) as info:
            raise SystemExit(main(_args(ckpt, dataset, tmp_path / "out", "--algo", "sft", "--overwrite", *extra)))
        return info.value.code, capsys.readouterr().err

    code, err = run(text, data, "--unfreeze-mm-tower")  # a text-only model
    assert code == 2 and "--unfreeze-mm-tower applies to multimodal models only" in err and "qwen3" in err
    code, err = run(text, data)  # image rows for a text-only model
    assert code == 2 and "row 0" in err and "does not take image input" in err
    code, err = run(vl, data, "--mm-tower-lr", "1e-3")  # a tower schedule for a frozen tower
    assert code == 2 and "--mm-tower-lr applies only with --unfreeze-mm-tower" in err
    broken = root / "data" / "broken.jsonl"
    (root / "data" / "img" / "bad.png").write_bytes(b"\x89PNG not really")
    rows = [{"prompt": _prompt("img/0.png"), "response": "0"}, {"prompt": _prompt("img/bad.png"), "response": "1"}]
    broken.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, err = run(vl, broken)
    assert code == 2 and "broken.jsonl row 1" in err and "could not decode the image" in err
    code, err = run(vl, broken, "--max-image-bytes", "16")
    assert code == 2 and "row 0" in err and "over the size cap of 16 bytes" in err

