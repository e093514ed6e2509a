"""Reference helpers for the model tests: transformers' model, its gradients under Hub names, next-token targets."""

import json
import shutil

import torch
from safetensors import safe_open

FAMILIES = ("qwen3", "qwen3_moe", "llama", "olmo2", "olmo3", "gpt_oss", "gemma4_text")

# families whose checkpoints store the experts fused, as transformers holds them
HUB_FUSED_EXPERTS = ("gpt_oss", "gemma4_text", "gemma4")


def load_reference(path, dtype=torch.float32):
    """transformers' own model for the checkpoint (eager attention: the plainest reference)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="eager")


def reference_grads(ref) -> dict:
    """transformers' parameter gradients under checkpoint (Hub) names: fused experts split back per expert
    (unless the Hub stores them fused too)."""
    return renamed_grads(ref, split_experts=ref.config.model_type not in HUB_FUSED_EXPERTS)


def renamed_grads(ref, rename=lambda name: name, experts=("gate_proj", "up_proj", "down_proj"),
                  split_experts: bool = True) -> dict:
    """transformers' gradients under Hub names: ``rename(name)`` first (undoing its load-time renames), then fused
    experts split back per expert (Hub names ``experts``: gate, up, down) and a fused ``conv1d`` back into
    ``q/k/v_conv1d``; parameters without a gradient left out."""
    out = {}
    for name, p in ref.named_parameters():
        g = p.grad
        if g is None:
            continue
        name = rename(name)
        if name.endswith("attention.conv1d.weight") or name.endswith("self_attn.conv1d.weight"):
            out.update({name.replace("conv1d", f"{x}_conv1d"): c for x, c in zip("qkv", g.chunk(3))})
        elif split_experts and name.endswith("experts.gate_up_proj"):
            base, inter = name[: -len("gate_up_proj")], g.shape[1] // 2
            for e in range(g.shape[0]):
                out[f"{base}{e}.{experts[0]}.weight"] = g[e, :inter]
                out[f"{base}{e}.{experts[1]}.weight"] = g[e, inter:]
        elif split_experts and name.endswith("experts.down_proj"):
            out.update({f"{name[: -len('down_proj')]}{e}.{experts[2]}.weight": g[e] for e in range(g.shape[0])})
        else:
            out[name] = g
    return out


def next_token_targets(ids: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` ids -> flat targets for the packed rows: the next token, -100 at each sequence's end."""
    targets = torch.full_like(ids, -100)
    targets[:, :-1] = ids[:, 1:]
    return targets.reshape(-1)


def areno_hub_grads(model) -> dict:
    """areno's parameter gradients under Hub names (this process's full model)."""
    from areno.models.tp import pieces

    params, out = dict(model.named_parameters()), {}
    for pname, lays in model._tp_layouts.items():
        g = params[pname].grad
        if g is None:
            continue
        for pc in pieces(lays, 0, 1):
            out.setdefault(pc.hf_name, torch.empty(pc.hf_shape))[pc.src] = g[pc.dst]
    return out


def hub_tensors(folder) -> dict:
    """Every tensor of the safetensors files in ``folder``."""
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def assert_same_checkpoint(src, out) -> dict:
    """The safetensors of ``out`` hold the tensors of ``src``, bit for bit (names, dtypes, shapes, bytes), and the same
    config.json; returns ``src``'s tensors."""
    import json

    a, b = hub_tensors(src), hub_tensors(out)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    return a


def assert_transformers_loads_saved(model, out, load_model, save_model) -> None:
    """Perturb ``model``'s weights, save it to ``out``: transformers and areno load it to areno's logits."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    out = save_model(model, out)
    ids = torch.randint(0, 1000, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model.logits(ids)
        assert (load_reference(out)(ids).logits - want).abs().max() <= 1e-4 * want.abs().max()
        assert torch.equal(load_model(out, device="cpu").logits(ids), want)


def packed_loss(model, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token NLL of the ``[B, T]`` rows, run as one packed varlen batch through areno's forward."""
    b, t = ids.shape
    cu = torch.arange(0, (b + 1) * t, t, dtype=torch.int32, device=ids.device)
    hidden = model(ids.reshape(-1), torch.arange(t, device=ids.device).repeat(b), cu, t)
    targets = next_token_targets(ids)
    return -model.token_logprobs(hidden, targets).sum() / (targets >= 0).sum()


def varlen_logits(model, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """areno's logits of sequences of different lengths packed into one varlen forward, split back per sequence."""
    lens = [len(s) for s in seqs]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in lens])
    with torch.no_grad():
        logits = model.compute_logits(model(torch.cat(seqs), pos, cu, max(lens)))
    return list(logits.split(lens))


def assert_fp32_parity(model, ref, hub_grads) -> None:
    """Sequences of 7, 19 and 12 tokens packed into one varlen forward give transformers' logits of each alone; a
    packed batch's loss and every gradient (``hub_grads(ref)``: transformers' under Hub names) match transformers'."""
    seqs = [torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(n)) for n in (7, 19, 12)]
    for got, seq in zip(varlen_logits(model, seqs), seqs):
        with torch.no_grad():
            want = ref(seq[None]).logits[0]
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    model.train(), ref.train()
    ids = torch.randint(0, 1000, (2, 19), generator=torch.Generator().manual_seed(2))
    loss = packed_loss(model, ids)
    loss.backward()
    ref_loss = ref(ids, labels=ids).loss
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    got, want = areno_hub_grads(model), hub_grads(ref)
    assert set(got) == set(want)
    for name, g in want.items():
        assert (got[name] - g).abs().max() <= 1e-4 * g.abs().max().clamp_min(1e-8), name


def assert_bf16_parity_on_gpu(path, load_model) -> None:
    """On the GPU: areno bf16's max logit error against transformers fp32 is at most 2x transformers bf16's plus 2% of
    the logit scale (``[2, 300]`` tokens); a training step with activation checkpointing has a finite loss and
    finite gradients. One model on the device at a time."""
    vocab = load_reference(path, torch.float32).config.vocab_size
    ids = torch.randint(0, vocab, (2, 300), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        ref = load_reference(path, torch.float32).cuda()
        exact = ref(ids).logits
        del ref
        ref = load_reference(path, torch.bfloat16).cuda()
        ref_err = (ref(ids).logits.float() - exact).abs().max()
        del ref
        model = load_model(path, device="cuda")
        assert model.embed_tokens.weight.dtype == torch.bfloat16
        our_err = (model.logits(ids).float() - exact).abs().max()
    scale = exact.abs().max()
    assert our_err <= 2 * ref_err + 2e-2 * scale, (our_err, ref_err, scale)
    del exact
    model.train()
    model.set_activation_checkpointing(True)
    loss = packed_loss(model, ids[:, :257])
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)



def assert_replay_and_checkpointing_agree(model) -> None:
    """A training forward records its experts (``routing_out``); replaying them (``routed_experts``) with activation
    checkpointing on gives the same loss and gradients."""
    from areno.models.attention_metadata import AttentionMetadata

    ids = torch.randint(0, 1000, (17,), generator=torch.Generator().manual_seed(5))
    t = ids.shape[0]
    cu = torch.tensor([0, t], dtype=torch.int32)
    targets = torch.cat([ids[1:], torch.tensor([-100])])
    routes = torch.full((model.num_moe_layers, t, model.moe_top_k), -1, dtype=torch.int32)
    runs = []
    for replay in (False, True):
        model.zero_grad(set_to_none=True)
        model.set_activation_checkpointing(replay)
        if replay:
            hidden = model(ids, torch.arange(t), cu, t, routed_experts=routes.permute(1, 0, 2).contiguous())
        else:
            meta = AttentionMetadata(None, True, cu, cu, t, t, routing_out=routes)
            hidden = model(ids, torch.arange(t), attn_metadata=meta)
        loss = -model.token_logprobs(hidden, targets).mean()
        loss.backward()
        runs.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    assert (routes >= 0).all()
    torch.testing.assert_close(runs[1][0], runs[0][0], rtol=0, atol=1e-6)
    assert set(runs[1][1]) == set(runs[0][1])
    for name, g in runs[0][1].items():
        torch.testing.assert_close(runs[1][1][name], g, rtol=1e-5, atol=1e-6, msg=name)


def with_config_change(source, folder, change: dict):
    """A copy of the checkpoint folder ``source`` at ``folder`` whose config.json has ``change`` applied."""
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    return folder


def check_logits_and_grads(model, ref, ids, *, logits_rtol: float = 1e-5) -> dict:
    """One packed fwd+bwd of ``ids [B, T]`` through the areno ``model`` and transformers' ``ref`` (both in train
    mode): logits within ``logits_rtol`` of the scale, equal losses, every gradient within 1e-4 of its scale;
    returns areno's gradients by Hub name."""
    from areno.models import iter_hf_tensors

    b, t = ids.shape
    cu = torch.arange(0, (b + 1) * t, t, dtype=torch.int32)
    hidden = model(ids.reshape(-1), torch.arange(t).repeat(b), cu, t)
    out = ref(ids, labels=ids)
    logits = model.compute_logits(hidden).view(b, t, -1)
    assert (logits - out.logits).abs().max() <= logits_rtol * out.logits.abs().max()
    targets = next_token_targets(ids)
    loss = -model.token_logprobs(hidden, targets).sum() / (targets >= 0).sum()
    loss.backward()
    out.loss.backward()
    torch.testing.assert_close(loss, out.loss, rtol=1e-5, atol=1e-6)
    got, grads = dict(iter_hf_tensors(model, grads=True)), reference_grads(ref)
    assert set(got) == set(grads)
    for name, g in grads.items():
        assert (got[name] - g).abs().max() <= 1e-4 * g.abs().max().clamp_min(1e-8), name
    return got


def assert_refused_at_load(checkpoint, tmp_path, change: dict, message: str) -> None:
    """A copy of ``checkpoint`` with ``change`` merged into its config.json fails to load with a one-line
    ``CheckpointError`` matching ``message``."""
    import pytest

    from areno.models import load_model
    from areno.models.loader import CheckpointError

    folder = with_config_change(checkpoint, tmp_path / "changed", change)
    with pytest.raises(CheckpointError, match=message) as e:
        load_model(folder, device="cpu")
    assert "\n" not in str(e.value)


def packed_batch(lens: list[int], seed: int = 10):
    """Random sequences of ``lens`` packed: ``(seqs, input_ids [T], positions [T], cu_seqlens [B+1], max_seqlen)``."""
    seqs = [torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed + i)) for i, n in enumerate(lens)]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    return seqs, torch.cat(seqs), torch.cat([torch.arange(n) for n in lens]), cu, max(lens)


def bf16_parity_on_gpu(path, ids: torch.Tensor):
    """On CUDA, for ``ids [B, T]``: transformers' fp32 logits, its bf16 logits and loss, areno's bf16 logits and packed
    loss. Returns ``(areno error, transformers' bf16 error, logit scale, areno loss, transformers' loss)``."""
    from areno.models import load_model

    with torch.no_grad():
        ref32 = load_reference(path, torch.float32).cuda()
        exact = ref32(ids).logits
        del ref32
        ref = load_reference(path, torch.bfloat16).cuda()
        out = ref(ids, labels=ids)
        ref_logits, ref_loss = out.logits.float(), out.loss.float()
        del ref, out
        model = load_model(path, device="cuda")
        assert model.embed_tokens.weight.dtype == torch.bfloat16
        got = model.logits(ids).float()
        b, t = ids.shape
        cu = torch.arange(0, (b + 1) * t, t, dtype=torch.int32, device="cuda")
        hidden = model(ids.reshape(-1), torch.arange(t, device="cuda").repeat(b), cu, t)
        targets = next_token_targets(ids)
        loss = -model.token_logprobs(hidden, targets).sum() / (targets >= 0).sum()
    scale = exact.abs().max()
    return (got - exact).abs().max(), (ref_logits - exact).abs().max(), scale, loss, ref_loss


def assert_checkpointing_keeps_loss_and_grads(path, ids):
    """One packed fwd+bwd of ``ids`` on the checkpoint at ``path`` without and with activation checkpointing: the same
    loss and gradients; returns the last model and both runs' expert-load counters (None for a dense model)."""
    from areno.models import load_model

    results = []
    for enabled in (False, True):
        model = load_model(path, device="cpu").train()
        model.set_activation_checkpointing(enabled)
        loss = packed_loss(model, ids)
        loss.backward()
        counts = model.expert_load().clone() if hasattr(model, "expert_load") else None
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad},
                        counts))  # gradients of trained parameters only (not frozen tensors)
    (loss0, grads0, counts0), (loss1, grads1, counts1) = results
    torch.testing.assert_close(loss1, loss0, rtol=0, atol=0)
    for name in grads0:
        torch.testing.assert_close(grads1[name], grads0[name], rtol=1e-6, atol=1e-7, msg=name)
    return model, counts0, counts1
