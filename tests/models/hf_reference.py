"""Reference helpers for the model tests: transformers' model, its gradients under Hub names, next-token targets."""

import json
import shutil

import torch

FAMILIES = ("qwen3", "qwen3_moe", "llama", "olmo2", "olmo3", "gpt_oss", "gemma4_text")

HUB_FUSED_EXPERTS = ("gpt_oss",)  # families whose checkpoints store the experts fused, as transformers holds them


def load_reference(path, dtype=torch.float32):
    """transformers' own model for the checkpoint (eager attention: the plainest reference)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="eager")


def reference_grads(ref) -> dict:
    """transformers' parameter gradients under checkpoint (Hub) names: fused experts split back per expert
    (unless the Hub stores them fused too)."""
    out = {}
    hub_fused = ref.config.model_type in HUB_FUSED_EXPERTS
    for name, p in ref.named_parameters():
        g = p.grad
        if hub_fused:
            out[name] = g
        elif name.endswith("mlp.experts.gate_up_proj"):
            base, inter = name[: -len("gate_up_proj")], g.shape[1] // 2
            for e in range(g.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = g[e, :inter]
                out[f"{base}{e}.up_proj.weight"] = g[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(g.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = g[e]
        else:
            out[name] = g
    return out


def next_token_targets(ids: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` ids -> flat targets for the packed rows: the next token, -100 at each sequence's end."""
    targets = torch.full_like(ids, -100)
    targets[:, :-1] = ids[:, 1:]
    return targets.reshape(-1)


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
