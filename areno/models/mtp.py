"""Multi-token-prediction (MTP) layers: kept as frozen opaque tensors under their Hub names (saved back untouched),
and run as the draft of speculative decoding (``MTPDraft``, built from those tensors by ``build_mtp_draft``).

The tensors a checkpoint stores for them: Qwen3.5 ``mtp.*`` (shared ``pre_fc_norm_embedding``,
``pre_fc_norm_hidden``, ``fc``, ``norm``, and ``mtp.layers.{j}.*`` decoder blocks), DeepSeek-V3 and Ling 3
``model.layers.{L+j}.*`` after the L decoder layers (``enorm``, ``hnorm``, ``eh_proj``, a decoder block, the final
norm ``shared_head.norm`` / ``final_layernorm``; DeepSeek-V3 also its own ``embed_tokens`` and
``shared_head.head``). One draft step j (MTP layer ``j mod n``; one layer is reused for every step) at position t,
given the previous hidden state ``h`` (the target's final, normed hidden state at t, or the previous draft step's)
and the next token ``x`` (token t + 1):

    z = proj(concat(enorm(embed(x)), hnorm(h)))      the embedding half first
    z = block(z, position t)                        a decoder block (its attention keeps its own paged K/V)
    logits = head(norm(z))                           the target's LM head unless the layer has its own

and the hidden state handed to step j + 1 is ``norm(z)`` (Qwen3.5) or ``z`` (DeepSeek-V3, Ling 3), as the public
implementations do. The draft's modules are copies of the kept tensors (``MTPDraft.load_kept``); ``store_kept`` writes
trained draft weights back into them. ``mtp_loss`` is the draft's teacher-forced training loss (bench/spec.py's
training, ``--mtp-loss-weight``'s during RL: areno.training.mtp); the draft never trains the target's tensors (its
shared embedding and head are read detached).
"""

from __future__ import annotations

import torch
from torch import nn

from areno.models.layers import KeptTensors, Linear, RMSNorm, VocabEmbedding
from areno.models.tp import one_layout, pieces, shard_modules


class KeptMTP:
    """Mixin for a ``CausalLM``: call ``init_mtp()`` in ``__init__`` and add ``mtp_layouts()`` to ``hf_layouts``;
    a family that can run its MTP layers defines ``mtp_draft_parts()`` (see ``build_mtp_draft``)."""

    def init_mtp(self) -> None:
        self.mtp = KeptTensors()  # frozen, opaque tensors of the MTP layers, filled at load (see keep_hf_tensor)

    @property
    def mtp_names(self) -> list[str]:
        return self.mtp.names

    @property
    def num_mtp_layers(self) -> int:
        """MTP layers the checkpoint holds (0: none loaded, nothing to draft with)."""
        return len(mtp_layer_indices(self.mtp.names, self.mtp_layer_prefix))

    def keep_hf_tensor(self, hf_name: str) -> bool:
        """True for checkpoint tensors kept opaque: those of the MTP layers after the decoder."""
        if not hf_name.startswith("model.layers."):
            return False
        index = hf_name.split(".")[2]
        return index.isdigit() and int(index) >= self.config.num_layers

    def add_hf_tensor(self, hf_name: str, tensor: torch.Tensor) -> str:
        """Hold ``tensor`` as a frozen, replicated parameter saved back under ``hf_name``; returns its name."""
        return f"mtp.{self.mtp.add(hf_name, tensor)}"

    def mtp_layouts(self) -> dict:
        return self.mtp.layouts("mtp")

    def stream_mtp(self) -> None:
        """The kept MTP tensors train (``--mtp-loss-weight``: written by the trainer's draft, outside the policy's
        optimizer): each is held in the model's dtype, as the policy's own tensors (a checkpoint's other dtype would
        round every update's write), and marked ``streamed``, so split mode's policy sync carries them with the
        trainable ones. Called on the train ranks and on split mode's rollout ranks alike."""
        dtype, fp32 = self.embed_tokens.weight.dtype, fp32_hub_names(self)
        for j, name in enumerate(self.mtp.names):  # the draft's fp32 parameters' (routers) stay fp32, as the policy's
            p = getattr(self.mtp, f"t{j}")
            if p.is_floating_point():
                p.data = p.data.to(torch.float32 if name in fp32 else dtype)
            p.streamed = True

    @property
    def mtp_layer_prefix(self) -> str:
        """The Hub prefix before an MTP layer's index (its blocks are ``{prefix}{index}.*``)."""
        return "model.layers."


def mtp_layer_indices(names: list[str], prefix: str) -> list[int]:
    """The distinct layer indices of the kept MTP tensors named ``{prefix}{index}.*``."""
    out = set()
    for name in names:
        if name.startswith(prefix):
            index = name[len(prefix) :].split(".")[0]
            if index.isdigit():
                out.add(int(index))
    return sorted(out)


def block_layouts(block, name: str, hf: str, cfg, attn: str = "self_attn", mlp: str = "mlp") -> dict:
    """The Hub layouts of a pre-norm decoder block ``block`` (its attention under ``hf.attn``, MLP under ``hf.mlp``)."""
    h = cfg.hidden_size
    out = dict(block.self_attn.layouts(f"{name}.self_attn", f"{hf}.{attn}", cfg))
    out.update(block.mlp.layouts(f"{name}.mlp", f"{hf}.{mlp}", cfg))
    for norm in ("input_layernorm", "post_attention_layernorm"):
        out[f"{name}.{norm}.weight"] = one_layout(f"{hf}.{norm}.weight", h)
    return out


def deepseek_mtp_parts(model, make_block, *, attn: str, final_norm: str, own_embed_head: bool) -> dict:
    """``MTPDraft`` parts of DeepSeek-style MTP layers ``model.layers.{L+j}``: ``enorm``/``hnorm``/``eh_proj``,
    ``make_block()`` (its attention under ``attn``), the final norm ``final_norm``, and (``own_embed_head``) the
    layer's own ``embed_tokens``/``shared_head.head``; the chained hidden state is the block's un-normed output."""
    cfg, h, v = model.config, model.config.hidden_size, model.config.vocab_size
    parts = dict(enorm=[], hnorm=[], proj=[], norm=[], blocks=[], embed=[] if own_embed_head else None,
                 head=[] if own_embed_head else None, layouts={}, chain_normed=False)
    lay = parts["layouts"]
    for j, index in enumerate(mtp_layer_indices(model.mtp_names, model.mtp_layer_prefix)):
        p = f"{model.mtp_layer_prefix}{index}"
        for key, hf in (("enorm", "enorm"), ("hnorm", "hnorm"), ("norm", final_norm)):
            parts[key].append(RMSNorm(h, cfg.rms_norm_eps))
            lay[f"{key}.{j}.weight"] = one_layout(f"{p}.{hf}.weight", h)
        parts["proj"].append(Linear(2 * h, h))
        lay[f"proj.{j}.weight"] = one_layout(f"{p}.eh_proj.weight", h, 2 * h)
        if own_embed_head:
            parts["embed"].append(VocabEmbedding(v, h))
            parts["head"].append(Linear(h, v))
            lay[f"embed.{j}.weight"] = one_layout(f"{p}.embed_tokens.weight", v, h)
            lay[f"head.{j}.weight"] = one_layout(f"{p}.shared_head.head.weight", v, h)
        parts["blocks"].append(make_block())
        lay.update(block_layouts(parts["blocks"][-1], f"blocks.{j}", p, cfg, attn))
    return parts


class MTPDraft(nn.Module):
    """The MTP layers as a draft model (see the module docstring). ``enorm``, ``hnorm``, ``proj``, ``norm``,
    ``blocks`` (and ``embed``/``head`` when the layers have their own) are ModuleLists of one entry (shared by every
    layer, Qwen3.5's pre-fc part) or one per layer; ``layouts`` maps each parameter to its kept Hub tensors."""

    def __init__(self, *, enorm, hnorm, proj, norm, blocks, layouts: dict, chain_normed: bool, embed=None,
                 head=None):  # fmt: skip
        super().__init__()
        self.enorm, self.hnorm, self.proj, self.norm = (nn.ModuleList(m) for m in (enorm, hnorm, proj, norm))
        self.blocks = nn.ModuleList(blocks)
        self.embed = None if embed is None else nn.ModuleList(embed)
        self.head = None if head is None else nn.ModuleList(head)
        self.layouts = layouts
        self.chain_normed = chain_normed
        self.tp_rank, self.tp_size = 0, 1  # its shard of the kept tensors (``build_mtp_draft`` under TP)
        for block in self.blocks:  # no routing capture/replay for the draft's MoE
            if getattr(block.mlp, "has_router", False):
                block.mlp.moe_index = 0

    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    @staticmethod
    def _pick(modules, j):
        return modules[j % len(modules)]

    def head_weight(self, model, j: int) -> torch.Tensor:
        """The head of step ``j``: the layer's own, or the target's (detached: the draft never trains the target)."""
        return model.lm_head_weight.detach() if self.head is None else self._pick(self.head, j).weight

    def forward(self, model, j: int, hidden, next_ids, positions, meta, kv_cache=None):
        """Draft step ``j``: ``hidden [T, H]`` (the previous hidden state at each position), ``next_ids [T]`` (the
        token after it) -> (the hidden state of this step's output ``[T, H]``, normed for the head; the hidden state
        handed to step j + 1)."""
        pick = self._pick
        x = model.embed_tokens(next_ids).detach() if self.embed is None else pick(self.embed, j)(next_ids)
        e = pick(self.enorm, j)(x)
        z = pick(self.proj, j)(torch.cat([e, pick(self.hnorm, j)(hidden.to(e.dtype))], dim=-1))
        h, residual = pick(self.blocks, j)(z, None, positions, model.rope, meta, kv_cache)
        out, pre = pick(self.norm, j)(h, residual)
        return out, (out if self.chain_normed else pre)

    def kept_tensors(self, model) -> dict[str, torch.Tensor]:
        return {name: getattr(model.mtp, f"t{j}") for j, name in enumerate(model.mtp.names)}

    @torch.no_grad()
    def load_kept(self, model) -> None:
        """Copy the kept Hub tensors into the draft's parameters (each parameter covered, or a KeyError naming it)."""
        kept, params = self.kept_tensors(model), dict(self.named_parameters())
        for pname, lays in self.layouts.items():
            for pc in pieces(lays, self.tp_rank, self.tp_size):
                if pc.hf_name not in kept:
                    raise KeyError(f"MTP draft: the checkpoint has no {pc.hf_name} (for {pname})")
                params[pname][pc.dst].copy_(kept[pc.hf_name][pc.src])

    @torch.no_grad()
    def store_kept(self, model) -> None:
        """Write the draft's parameters back into the kept Hub tensors (after training the draft)."""
        self._write(self.kept_tensors(model))

    @torch.no_grad()
    def hub_tensors(self, model) -> dict[str, torch.Tensor]:
        """The draft's parameters as the kept Hub tensors they came from (new tensors; the kept ones untouched)."""
        out = {name: t.clone() for name, t in self.kept_tensors(model).items()}
        self._write(out)
        return out

    def _write(self, hub: dict[str, torch.Tensor]) -> None:
        """Under TP: this rank's shard of each tensor (the rest of ``hub`` left as it is)."""
        params = dict(self.named_parameters())
        for pname, lays in self.layouts.items():
            for pc in pieces(lays, self.tp_rank, self.tp_size):
                hub[pc.hf_name][pc.src].copy_(params[pname][pc.dst])


def fp32_hub_names(model) -> set[str]:
    """The kept Hub tensors that feed a draft parameter held in float32 (a router's weight, a decay parameter)."""
    parts = getattr(model, "mtp_draft_parts", None)
    if parts is None or not getattr(model, "num_mtp_layers", 0):
        return set()
    with torch.device("meta"):
        draft = MTPDraft(**parts())
    names = set()
    for mname, module in draft.named_modules():
        for pname in getattr(module, "fp32_params", ()):
            lays = draft.layouts.get(f"{mname}.{pname}" if mname else pname)
            if lays:
                names.update(pc.hf_name for pc in pieces(lays, 0, 1))
    return names


def build_mtp_draft(model, *, trainable: bool = False) -> MTPDraft | None:
    """The model's MTP layers as an ``MTPDraft`` on its device and dtype, loaded from the kept tensors; None when the
    family cannot run them or the checkpoint has none. ``trainable``: the parameters its modules train (all but a
    router's selection bias) require gradients; otherwise none does.

    Under tensor parallelism (the engine's draft; training one is refused) the draft is sharded like the decoder:
    its blocks by the model's plan, a layer's own embedding and head by vocabulary rows like the model's, so each
    rank holds 1/TP of it and runs the same collectives as a decoder block (the kept tensors stay whole on every
    rank: each rank loads its shard from them)."""
    parts = getattr(model, "mtp_draft_parts", None)
    if parts is None or not getattr(model, "num_mtp_layers", 0):
        return None
    if model.tp_group is not None and trainable:
        raise ValueError("MTP draft: the MTP layers train on one rank only (no tensor parallelism)")
    ref = model.embed_tokens.weight
    with torch.device("meta"):
        draft = MTPDraft(**parts())
    if model.tp_group is not None:
        vocab = {f"{kind}.{j}": "vocab" for kind in ("embed", "head") for j in range(draft.num_layers)}
        shard_modules(draft, draft.layouts, model.tp_group, model.config.vocab_size, styles=vocab)
        draft.tp_rank, draft.tp_size = model.tp_rank, model.tp_size
    for module in draft.modules():  # the model's fp32 parameters (routers, biases) stay fp32
        fp32 = getattr(module, "fp32_params", ())
        for name, p in list(module.named_parameters(recurse=False)):
            dtype = torch.float32 if name in fp32 else ref.dtype
            setattr(module, name, nn.Parameter(torch.empty(p.shape, dtype=dtype, device=ref.device),
                                               requires_grad=trainable and p.requires_grad))  # fmt: skip
    draft.load_kept(model)
    for module in draft.modules():
        if module is not draft and hasattr(module, "init_buffers"):
            module.init_buffers(ref.device)
    return draft


def teacher_forced(input_ids, positions, cu_seqlens, targets):
    """Draft step 0 inputs over packed rows (``cu_seqlens`` int32 ``[B+1]``, ``targets`` the packed batch's: the next
    token where it is scored, -100 elsewhere): every position t but a row's last, with its next token t + 1 and the
    label ``targets[t + 1]`` (the token t + 2 where it is scored). Returns (indices of t, next ids, labels, positions,
    the rows' cu_seqlens, each row one shorter)."""
    t = input_ids.shape[0]
    keep = torch.ones(t, dtype=torch.bool, device=input_ids.device)
    keep[cu_seqlens[1:].long() - 1] = False
    idx = keep.nonzero().squeeze(1)
    cu = cu_seqlens - torch.arange(cu_seqlens.shape[0], dtype=cu_seqlens.dtype, device=cu_seqlens.device)
    return idx, input_ids[idx + 1], targets[idx + 1], positions[idx], cu


def mtp_loss(model, draft: MTPDraft, hidden, input_ids, positions, cu_seqlens, targets, *, chunk: int = 4096):
    """The draft's next-next-token cross-entropy, teacher forced (``teacher_forced``): its step 0 at each position t
    from the target's final normed hidden state at t (``hidden [T, H]``, detached) and the embedding of token t + 1,
    scored against token t + 2. Returns (the summed cross-entropy over the labelled positions, fp32, its gradient
    reaching the draft's parameters only; how many of them the draft's argmax gets right; how many there are)."""
    from areno.kernels.logprobs import linear_logprobs
    from areno.models.base import training_metadata

    idx, nxt, labels, pos, cu = teacher_forced(input_ids, positions, cu_seqlens, targets)
    out, _ = draft(model, 0, hidden.detach()[idx], nxt, pos, training_metadata(nxt, cu))
    weight = draft.head_weight(model, 0)
    ce = -linear_logprobs(out, weight, labels).sum()
    valid = labels != -100
    with torch.no_grad():
        o, w = out.detach(), weight.detach()
        top = torch.cat([(o[i : i + chunk] @ w.T).argmax(-1) for i in range(0, o.shape[0], chunk)]) if o.shape[0] \
            else labels
        correct = ((top == labels) & valid).sum()
    return ce, correct, valid.sum()
