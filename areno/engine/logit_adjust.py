"""Logit adjustments of the runner's sampled rows: logit_bias and the min_tokens ban of EOS and stop ids (a sparse
per-row list), repetition/presence/frequency penalties (a per-sequence slot of token counts on the device), min-p.

Rank 0 plans a step's ``LogitAdjust`` (``LogitAdjuster.plan``); every rank fills the token-count slots the step
takes (``fill``), applies the adjustments to fp32 logits (``apply``) and counts the sampled tokens (``record``).
``adjust_host`` turns a plan into padded host tensors (eager steps and the CUDA graphs' static inputs alike).
"""

from __future__ import annotations

import numpy as np
import torch

from areno.engine.sequence import Status
from areno.engine.step_inputs import LogitAdjust, host_tensor
from areno.kernels.penalties import apply_logit_bias, apply_penalties, record_tokens, reset_token_state


class LogitAdjuster:
    """The token-count slots of penalised sequences (``[max_running, V]`` int32, made when first needed) and the
    rows' adjustments."""

    def __init__(self, max_running: int, vocab_size: int, device, eos_token_ids=()):
        self.max_running, self.vocab_size, self.device = max_running, vocab_size, device
        self.eos_token_ids = sorted(set(eos_token_ids))  # banned with the stop ids before min_tokens
        self.token_state = None  # [max_running, V] int32 token counts (areno.kernels.penalties), made when needed
        self.reset()

    def reset(self) -> None:
        """Drop the token counts and free every slot (``--drop-rollout-state``)."""
        self.token_state = None
        self._slots: dict[int, tuple] = {}  # rank 0: seq_id -> (sequence, its token-state slot)
        self._free_slots = list(range(self.max_running))[::-1]

    def plan(self, rows) -> LogitAdjust | None:
        """The rows' logit adjustments (rank 0). A penalised sequence takes a token-state slot at its first sampled
        step and gives it back once it no longer runs (finished, aborted or preempted: refilled on its return)."""
        if self._slots:
            self._release_slots(rows)
        if not any(s.options.adjusts_logits for s in rows):
            return None
        adj = LogitAdjust([], [], [], [], [], [], [], [])
        for seq in rows:
            o = seq.options
            slot = -1
            if o.penalized:
                held = self._slots.get(seq.seq_id)
                if held is None:
                    if not self._free_slots:
                        raise RuntimeError("no token-state slot free: more penalised sequences than max_running")
                    slot = self._free_slots.pop()
                    self._slots[seq.seq_id] = (seq, slot)
                    adj.init.append((slot, seq.tokens[: seq.prompt_len], seq.tokens[seq.prompt_len :]))
                else:
                    slot = held[1]
            left = max(0, o.min_new_tokens - seq.num_output)
            entries = {t: (b, False) for t, b in o.logit_bias.items()}
            if left:
                for t in o.stop_token_ids + ([] if o.ignore_eos else self.eos_token_ids):
                    entries[t] = (entries.get(t, (0.0, False))[0], True)
            adj.slots.append(slot)
            adj.repetition.append(o.repetition_penalty)
            adj.presence.append(o.presence_penalty)
            adj.frequency.append(o.frequency_penalty)
            adj.min_p.append(o.min_p)
            adj.min_left.append(left)
            adj.sparse.append([(t, b, ban) for t, (b, ban) in entries.items()])
        if max(adj.slots) < 0 and not any(adj.min_p) and not adj.width:
            return None  # only a min_tokens that is already reached
        return adj

    def _release_slots(self, rows) -> None:
        current = {s.seq_id for s in rows}
        for seq_id, (seq, slot) in list(self._slots.items()):
            if seq.status is not Status.RUNNING and seq_id not in current:
                del self._slots[seq_id]
                self._free_slots.append(slot)

    def counts(self) -> torch.Tensor:
        if self.token_state is None:
            self.token_state = torch.zeros(self.max_running, self.vocab_size, dtype=torch.int32, device=self.device)
        return self.token_state

    def fill(self, adj: LogitAdjust) -> None:
        """Every rank: the token counts of the sequences that took a slot at this step."""
        for slot, prompt, output in adj.init:
            reset_token_state(self.counts(), slot, prompt, output)

    def apply(self, logits, adj: dict, min_left) -> None:
        """In place on fp32 logits: logit_bias and the min_tokens ban, then the penalties (vLLM's order)."""
        if adj["sp_ids"].shape[1]:
            apply_logit_bias(logits, adj["sp_ids"], adj["sp_bias"], adj["sp_ban"], min_left)
        if "pen_slot" in adj:
            apply_penalties(logits, adj["pen_slot"], self.counts(), adj["rep"], adj["pres"], adj["freq"])

    def record(self, adj: dict, tokens: torch.Tensor) -> None:
        """Count the sampled ``tokens`` into their rows' slots (rows with penalties)."""
        if "pen_slot" in adj:
            record_tokens(self.token_state, adj["pen_slot"], tokens)


def adjust_host(adj: LogitAdjust, bsz: int, width: int, penalties: bool | None = None) -> dict:
    """The adjustments as host tensors, padded to ``bsz`` rows and ``width`` sparse entries; the penalty
    entries only with ``penalties`` (default: when some row has a slot)."""
    pad = bsz - len(adj.slots)
    ids = np.full((bsz, width), -1, dtype=np.int64)
    bias = np.zeros((bsz, width), dtype=np.float32)
    ban = np.zeros((bsz, width), dtype=np.bool_)
    for i, entries in enumerate(adj.sparse):
        for j, (t, b, banned) in enumerate(entries):
            ids[i, j], bias[i, j], ban[i, j] = t, b, banned
    host = {"min_p": host_tensor(adj.min_p + [0.0] * pad, torch.float32),
            "min_left": host_tensor(adj.min_left + [0] * pad, torch.int32),
            "sp_ids": torch.from_numpy(ids), "sp_bias": torch.from_numpy(bias), "sp_ban": torch.from_numpy(ban)}
    if penalties or (penalties is None and max(adj.slots) >= 0):
        host.update(pen_slot=host_tensor(adj.slots + [-1] * pad),
                    rep=host_tensor(adj.repetition + [1.0] * pad, torch.float32),
                    pres=host_tensor(adj.presence + [0.0] * pad, torch.float32),
                    freq=host_tensor(adj.frequency + [0.0] * pad, torch.float32))
    return host
