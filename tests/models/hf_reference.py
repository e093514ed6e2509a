"""Reference helpers for the model tests: transformers' model, its gradients under Hub names, next-token targets."""

import json
import shutil

import torch
from safetensors import safe_open

FAMILIES = ("qwen3", "qwen3_moe", "llama", "olmo2", "olmo3", "gpt_oss")

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


def packed_loss(model, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token NLL of ``[B, T]`` ids through areno's packed varlen forward and fused log-probs."""
    b, t = ids.shape
    cu = torch.arange(0, (b + 1) * t, t, dtype=torch.int32, device=ids.device)
    hidden = model(ids.reshape(-1), torch.arange(t, device=ids.device).repeat(b), cu, t)
    targets = next_token_targets(ids)
    return -model.token_logprobs(hidden, targets).sum() / (targets >= 0).sum()


def safetensors_tensors(folder) -> dict:
    """Every tensor of a folder's ``*.safetensors`` files, by name."""
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out
