"""Reference helpers for the model tests: transformers' model, its gradients under Hub names, next-token targets."""

import torch

FAMILIES = ("qwen3", "qwen3_moe", "llama", "olmo2", "olmo3", "gemma4_text")


def load_reference(path, dtype=torch.float32):
    """transformers' own model for the checkpoint (eager attention: the plainest reference)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="eager")


def reference_grads(ref) -> dict:
    """transformers' parameter gradients under checkpoint (Hub) names: fused experts split back per expert."""
    out = {}
    for name, p in ref.named_parameters():
        g = p.grad
        if name.endswith("mlp.experts.gate_up_proj"):
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
