"""Reference helpers for the model tests: transformers' model, its gradients under Hub names, next-token targets."""

import torch

FAMILIES = ("qwen3", "qwen3_moe", "llama", "olmo2", "olmo3")


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
    from safetensors import safe_open

    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def packed_loss(model, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token NLL of the ``[B, T]`` rows, run as one packed varlen batch through areno's forward."""
    b, t = ids.shape
    cu = torch.arange(0, (b + 1) * t, t, dtype=torch.int32)
    hidden = model(ids.reshape(-1), torch.arange(t).repeat(b), cu, t)
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


def bf16_logits_errors(path, ids, load_model) -> tuple[float, float, float]:
    """On the GPU: (areno bf16's max logit error, transformers bf16's, the logit scale), both errors against
    transformers fp32 on ``ids [B, T]``; one model on the device at a time."""
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
        del model
    return float(our_err), float(ref_err), float(exact.abs().max())
