"""`areno train --algo grpo` on the tiny Ling 3 (bailing_hybrid: recurrent KDA layers in the rollout engine, a sparse
MoE) with routing replay on and off: the rows carry the experts the rollout used, and with replay on the training
forward runs exactly those; the flag is refused where it cannot apply."""

import json
import random

import numpy as np
import pytest
import torch

from areno.cli import main
from areno.engine.engine import Engine
from areno.models.bailing_hybrid import SigmoidMoE
from areno.testing import make_tiny_checkpoint
from areno.training.trainer import PolicyTrainer


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("replay")
    ckpt = make_tiny_checkpoint(root / "ling3", family="bailing_hybrid", seed=0)
    rng = random.Random(0)
    rows = [{"prompt": [{"role": "user", "content": f"{rng.randint(0, 9)}+{rng.randint(0, 9)}="}]} for _ in range(8)]
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reward = root / "reward.py"
    reward.write_text("def reward_fn(record):\n    return float(len(record.completion) % 2)\n")
    return ckpt, data, reward, root


def _args(files, out, mode):
    ckpt, data, reward, _ = files
    return ["train", "--algo", "grpo", "--ckpt", str(ckpt), "--dataset-path", str(data), "--reward-fn-path",
            str(reward), "--batch-size", "2", "--n-samples", "2", "--mini-bs", "4", "--max-steps", "3",
            "--max-new-tokens", "5", "--save-path", str(out), "--lr", "1e-3", "--no-tensorboard", "--dtype", "float32",
            "--routing-replay", mode]


@pytest.mark.parametrize("mode", ["on", "off"])
def test_grpo_three_steps_on_ling3_with_routing_replay(files, mode, monkeypatch):
    rollout_routes, train_calls, route_calls = {}, [], []
    completion = Engine.completion

    def record_completion(self, seq):
        c = completion(self, seq)
        rollout_routes[tuple(c.prompt_ids + c.token_ids)] = c.routed_experts
        return c

    forward = PolicyTrainer.forward

    def record_forward(self, packed, **kw):
        if self.model.training and torch.is_grad_enabled():
            train_calls.append(packed)
        return forward(self, packed, **kw)

    route = SigmoidMoE.route

    def record_route(self, x, given=None):
        weights, ids = route(self, x, given)
        if torch.is_grad_enabled():
            route_calls.append((given, ids))
        return weights, ids

    monkeypatch.setattr(Engine, "completion", record_completion)
    monkeypatch.setattr(PolicyTrainer, "forward", record_forward)
    monkeypatch.setattr(SigmoidMoE, "route", record_route)
    out = files[3] / f"out-{mode}"
    assert main(_args(files, out, mode)) == 0
    lines = [json.loads(x) for x in (out / "metrics" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3]
    assert all(x.get("skipped") or np.isfinite(x["logprob_diff"]) for x in lines)
    assert rollout_routes and train_calls and route_calls
    if mode == "off":
        assert all(r is None for r in rollout_routes.values()) and all(g is None for g, _ in route_calls)
        return
    # the rows carry the rollout's routes, token for token
    for p in train_calls:
        cu = p.cu_seqlens.tolist()
        for a, b in zip(cu, cu[1:]):
            want = rollout_routes[tuple(p.input_ids[a:b].tolist())]
            assert torch.equal(p.routed_experts[a:b].long(), torch.from_numpy(want).long())
    # and every training forward's MoE layers ran those experts (all tokens but each row's last, never fed)
    known = 0
    for given, ids in route_calls:
        assert given is not None
        rows = given[:, 0] >= 0
        assert torch.equal(ids[rows].long(), given[rows].long())
        known += int(rows.sum())
    assert known > 0.6 * sum(len(g) for g, _ in route_calls)


def test_routing_replay_is_refused_where_it_cannot_apply(files, tmp_path, capsys):
    dense = make_tiny_checkpoint(tmp_path / "dense", family="qwen3", seed=0)
    ckpt, data, reward, _ = files
    args = _args(files, tmp_path / "o", "on")
    args[args.index(str(ckpt))] = str(dense)
    assert main(args) == 2
    assert "--routing-replay on needs a sparse-MoE policy" in capsys.readouterr().err
    sft = _args(files, tmp_path / "o2", "on")
    sft[sft.index("grpo")] = "sft"
    with pytest.raises(SystemExit) as e:
        main(sft)
    assert e.value.code == 2 and "--routing-replay on applies to RL" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["qwen3_moe", "bailing_hybrid", "gpt_oss"])
def test_replayed_experts_are_used_and_the_router_still_learns(family, tmp_path):
    """``model(..., routed_experts=ids)``: every MoE layer runs the given experts (rows of -1 route themselves),
    which changes the output when they differ from the router's own choice, and the router weights still get a
    gradient through the routing weights."""
    from areno.models import load_model
    from areno.models.attention_metadata import AttentionMetadata

    model = load_model(make_tiny_checkpoint(tmp_path, family, seed=1), dtype=torch.float32, device="cpu")
    t, layers, k = 9, model.num_moe_layers, model.moe_top_k
    ids, pos = torch.randint(0, 500, (t,)), torch.arange(t)
    cu = torch.tensor([0, t], dtype=torch.int32)

    def run(routes):
        meta = AttentionMetadata(None, True, cu, cu, t, t)
        meta.routing_out = torch.empty(layers, t, k, dtype=torch.int32)
        return model(ids, pos, attn_metadata=meta, routed_experts=routes), meta.routing_out.permute(1, 0, 2)

    with torch.no_grad():
        own_h, own = run(None)
    given = (own + 1) % model.config.num_experts  # other experts than the router's, still distinct per token
    given[-2:] = -1
    h, used = run(given)
    # the -1 rows route themselves (the first MoE layer's input is unchanged for them; later ones see replayed
    # tokens through attention)
    assert torch.equal(used[:-2], given[:-2]) and torch.equal(used[-2:, 0], own[-2:, 0])
    assert not torch.allclose(h, own_h)
    h.square().mean().backward()
    gates = [m.gate.weight for m in model.moe_layers()]
    assert all(g.grad is not None and g.grad.abs().sum() > 0 for g in gates)
