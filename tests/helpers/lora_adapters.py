"""PEFT adapters for the LoRA serving tests: written by the real ``peft`` package on transformers' model of a tiny
checkpoint (random A and B, so each adapter changes the answers)."""

from __future__ import annotations

from pathlib import Path

import torch


def reference_model(base):
    """transformers' own model of the checkpoint (eager attention, fp32)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32,
                                                             attn_implementation="eager")


def make_adapter(base, folder, *, rank: int, alpha: float, targets, seed: int) -> Path:
    """Save a PEFT LoRA adapter of ``base`` with random weights (std 0.2) into ``folder``."""
    import peft

    torch.manual_seed(seed)
    conf = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)
    pm = peft.get_peft_model(reference_model(base), conf)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    pm.save_pretrained(str(folder))
    return Path(folder)


def peft_greedy(base, adapter, prompt: list[int], steps: int) -> list[int]:
    """``steps`` greedy tokens of ``peft.PeftModel`` (the adapter on transformers' model), one full forward each."""
    import peft

    pm = peft.PeftModel.from_pretrained(reference_model(base), str(adapter)).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(pm(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]
