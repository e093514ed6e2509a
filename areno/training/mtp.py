"""MTP draft training beside the policy (``--mtp-loss-weight W``): the model's multi-token-prediction layers learn
from the very sequences the policy trains on, so speculative decoding's draft stays aligned with the moving policy.

``MTPTrainer`` holds the draft (``areno.models.mtp.MTPDraft``, its parameters trainable) and its own optimizer (the
policy's AdamW settings and learning rate, a separate ``MasterAdamW``: clipping uses the policy's global grad norm, so
sharing one would let the draft's gradient change the policy's update). Each training microbatch adds
``W * mtp_loss`` (the draft's next-next-token cross-entropy on the microbatch's rows, teacher forced from the
target's detached final hidden states; labels are the scored tokens, normalised by the update's token count as the
policy losses are; the --sft-warmup-steps updates train it too, on their responses); nothing of it reaches the
policy's gradient. After each optimizer update the draft's weights are written into the model's kept MTP tensors
(``store_kept``): checkpoints save them under their Hub names, the colocated engine's draft reloads them, split mode's
sync streams them (``KeptMTP.stream_mtp``). Metrics per step: ``mtp_loss`` (mean cross-entropy per labelled token),
``mtp_accuracy`` (the draft's top-1 agreement), ``mtp_grad_norm``.

``fit_draft`` fits the draft alone to given sequences (e.g. the model's own outputs) before any engine is built: the
speculation bench's stand-in for a released model's MTP layers on random-weight checkpoints, and the tests'.
"""

from __future__ import annotations

import itertools

import torch

from areno.config import ConfigError
from areno.models.mtp import build_mtp_draft, mtp_loss
from areno.training.optimizer import MasterAdamW

FLAG = "--mtp-loss-weight"
RAW = ("mtp_ce_total", "mtp_correct", "mtp_tokens")  # summed per step, turned into the metrics by ``metrics``


def check_model(model) -> None:
    """A ``ConfigError`` naming the flag for a policy whose MTP layers cannot train here."""
    kind = model.config.model_type
    if not getattr(model, "num_mtp_layers", 0) or getattr(model, "mtp_draft_parts", None) is None:
        raise ConfigError(FLAG, f"needs a model with MTP (multi-token-prediction) layers: the {kind} policy has none "
                          "loaded (Qwen3.5, DeepSeek-V3 and Ling 3 checkpoints ship them)")
    if model.is_multimodal:
        raise ConfigError(FLAG, f"with a vision-language model ({kind}) is not built yet")
    if model.tp_group is not None:
        raise ConfigError(FLAG, "with --tp-size > 1 is not built yet (the MTP layers train on one rank)")


class MTPTrainer:
    """The draft of ``model`` and its optimizer (``make_optimizer(params) -> MasterAdamW``); see the module
    docstring."""

    def __init__(self, model, weight: float, make_optimizer):
        check_model(model)
        self.model, self.weight = model, float(weight)
        model.stream_mtp()  # before the engine and the split-mode sync plan are built
        self.draft = build_mtp_draft(model, trainable=True)
        self.draft.train()
        self.optimizer = make_optimizer([p for p in self.draft.parameters() if p.requires_grad])
        self.grad_norms: list[float] = []

    def backward(self, hidden, packed, norms) -> dict:
        """This microbatch's MTP loss, backpropagated into the draft; its device-scalar sums (``RAW``)."""
        ce, correct, count = mtp_loss(self.model, self.draft, hidden, packed.input_ids, packed.positions,
                                      packed.cu_seqlens, packed.targets)
        (ce * (self.weight / norms.num_tokens)).backward()
        return {"mtp_ce_total": ce.detach(), "mtp_correct": correct, "mtp_tokens": count}

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def step(self, lr: float, grad_clip: float) -> None:
        """The draft's optimizer update (its own grad norm and clipping), then its weights into the kept tensors."""
        self.grad_norms.append(float(self.optimizer.step(lr=lr, grad_clip=grad_clip)))
        self.draft.store_kept(self.model)

    def metrics(self, totals: dict) -> dict:
        """``totals`` (a train() call's summed stats) with ``RAW`` replaced by the step's MTP metrics."""
        ce, correct, count = (totals.pop(k, 0.0) for k in RAW)
        out = {"mtp_loss": ce / max(count, 1.0), "mtp_accuracy": correct / max(count, 1.0)}
        if self.grad_norms:
            out["mtp_grad_norm"] = sum(self.grad_norms) / len(self.grad_norms)
        self.grad_norms = []
        return {**totals, **out}

    def reload(self) -> None:
        """The draft from the model's kept tensors (after a resume replaced them)."""
        self.draft.load_kept(self.model)

    def close(self) -> None:
        self.optimizer.close()


def draft_state(trainer) -> dict:
    """``{"mtp": optimizer}`` of a PolicyTrainer that trains the MTP layers (the checkpoint's extra optimizer
    state), else ``{}``."""
    mtp = getattr(trainer, "mtp", None)
    return {} if mtp is None else {"mtp": mtp.optimizer}



def fit_draft(model, sequences: list[list[int]], steps: int, *, lr: float = 1e-3, epochs: int = 4) -> dict:
    """Fit the MTP draft of ``model`` to ``sequences`` (token lists, e.g. the model's own outputs) alone: ``steps``
    Adam steps (``MasterAdamW``: fp32 master weights and moments whatever the model's dtype), teacher forced from
    the target's final hidden states (no gradient to the model), each step a packed batch of enough sequences (in
    turn) that each is seen ``epochs`` times; the trained weights written into the kept MTP tensors (an engine built
    after drafts with them). Returns the first and last mean cross-entropy."""
    check_model(model)
    model.requires_grad_(False)
    draft = build_mtp_draft(model, trainable=True)
    # fp32 master weights and moments (as MTPTrainer's): Adam on fp16 parameters overflows to NaN, on bf16 ones it
    # loses the small late updates
    opt = MasterAdamW([p for p in draft.parameters() if p.requires_grad], lr=lr)
    dev = model.embed_tokens.weight.device
    pack = max(1, -(-len(sequences) * epochs // max(steps, 1)))
    losses = []
    for step in range(steps):
        batch = [sequences[(step * pack + i) % len(sequences)] for i in range(pack)]
        lens = [len(s) for s in batch]
        ids = torch.tensor([t for s in batch for t in s], device=dev)
        pos = torch.cat([torch.arange(n, device=dev) for n in lens])
        cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=dev)
        with torch.no_grad():
            hidden = model(ids, pos, cu_seqlens=cu, max_seqlen=max(lens))
        # every position scored: the label of position t is token t + 2 (areno.models.mtp.teacher_forced)
        targets = torch.roll(ids, -1)
        targets[cu[1:].long() - 1] = -100
        ce, _, count = mtp_loss(model, draft, hidden, ids, pos, cu, targets)
        loss = ce / count
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    draft.store_kept(model)
    return {"mtp_loss_first": losses[0] if losses else None, "mtp_loss_last": losses[-1] if losses else None,
            "mtp_train_sequences": len(sequences)}
