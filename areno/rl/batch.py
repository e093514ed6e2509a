"""The packed batch layout every loss shares.

A row is one sequence: prompt tokens then response tokens. Rows are packed end to end into ``input_ids [T]`` with
``cu_seqlens``; position j of a row predicts its token j + 1, so the response token k of a row with P prompt tokens
is scored at position P - 1 + k. ``targets`` holds that next token at scored positions and -100 elsewhere; every
per-token field (rollout log-probs, advantages, ...) is laid out on the same positions.

A row whose prompt shows images carries them in ``media`` (the ``MultimodalPrompt`` of its prompt: pixel rows,
``image_grid_thw``, ``[3, P]`` M-RoPE positions, decode offset ``rope_delta``). When any row of a batch has media,
``positions`` is ``[3, T]``: such a row's prompt keeps its M-RoPE positions and its response token ``k`` sits at
``P + k + rope_delta`` on all three streams (where the engine decoded it); a text row counts up on all three. The
images are concatenated in row order (``pixel_values``, ``image_grid_thw``, one ``image_hashes`` entry each) and
``image_rows`` lists the packed positions of the prompts' image tokens (a response token equal to the image
placeholder id is text: the policy sampled it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Row:
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float] | None = None  # log-prob of each response token under the rollout policy
    advantage: float = 0.0  # sequence-level (GRPO/GSPO); PPO fills token_advantages
    reward: float = 0.0
    token_advantages: list[float] | None = None
    extras: dict = field(default_factory=dict)
    loss_mask: list[int] | None = None  # per response token: 1 trained, 0 context (an agent's tool results, ...)
    meta: dict = field(default_factory=dict)  # not packed: messages, finish reason, policy version (dumps)
    media: object = None  # the prompt's images: an areno.models.multimodal.MultimodalPrompt, None for text
    routed_experts: object = None  # routing replay: int [len(row), num_moe_layers, k] rollout expert ids (-1: none)

    def scored(self, values: list) -> list:
        """The entries of a per-response-token list at the trained positions (all of them without a mask)."""
        return list(values) if self.loss_mask is None else [v for v, m in zip(values, self.loss_mask) if m]

    def spread(self, values: list) -> list:
        """A list over the trained positions back over every response token (0.0 at context positions)."""
        if self.loss_mask is None:
            return list(values)
        it = iter(values)
        return [next(it) if m else 0.0 for m in self.loss_mask]

    def __len__(self):
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass
class Packed:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T], or [3, T] (M-RoPE) when a row has images
    cu_seqlens: torch.Tensor  # int32 [B+1]
    max_seqlen: int
    targets: torch.Tensor  # int64 [T], -100 where nothing is scored
    mask: torch.Tensor  # float32 [T]
    seq_index: torch.Tensor  # int64 [T]
    num_rows: int
    old_logprobs: torch.Tensor | None = None  # float32 [T]
    advantages: torch.Tensor | None = None  # float32 [T]
    seq_advantages: torch.Tensor | None = None  # float32 [B]
    tok: dict[str, torch.Tensor] = field(default_factory=dict)  # per-token extras (row.extras lists), float32 [T]
    row: dict[str, torch.Tensor] = field(default_factory=dict)  # per-row extras (row.extras scalars), float32 [B]
    pixel_values: torch.Tensor | None = None  # every row's images, in row order
    image_grid_thw: torch.Tensor | None = None  # int64 [n, 3]
    image_rows: torch.Tensor | None = None  # int64 [N]: packed positions of the image tokens
    image_hashes: list[str] = field(default_factory=list)  # one per image (identical images, identical hashes)
    routed_experts: torch.Tensor | None = None  # int32 [T, num_moe_layers, k] (areno.rl.routing_replay), -1: none

    def to(self, device) -> Packed:
        move = lambda v: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v  # noqa: E731
        kw = {k: ({kk: move(vv) for kk, vv in v.items()} if isinstance(v, dict) else move(v))
              for k, v in vars(self).items()}
        return Packed(**kw)


def pack(rows: list[Row]) -> Packed:
    ids, pos, tgt, seq, old, adv, cu = [], [], [], [], [], [], [0]
    has_old = all(r.rollout_logprobs is not None for r in rows)
    for i, r in enumerate(rows):
        P, R = len(r.prompt_ids), len(r.response_ids)
        tokens = list(r.prompt_ids) + list(r.response_ids)
        ids.extend(tokens)
        pos.extend(range(P + R))
        trained = r.response_ids if r.loss_mask is None else [t if m else -100 for t, m in zip(r.response_ids,
                                                                                           r.loss_mask)]
        tgt.extend([-100] * (P - 1) + list(trained) + [-100])
        seq.extend([i] * (P + R))
        if has_old:
            old.extend([0.0] * (P - 1) + list(r.rollout_logprobs) + [0.0])
        token_adv = r.token_advantages if r.token_advantages is not None else [r.advantage] * R
        adv.extend([0.0] * (P - 1) + list(token_adv) + [0.0])
        cu.append(cu[-1] + P + R)
    targets = torch.tensor(tgt, dtype=torch.int64)
    tok, row = {}, {}
    for key in rows[0].extras if rows else ():
        if isinstance(rows[0].extras[key], (list, tuple)):
            vals = []
            for r in rows:
                vals.extend([0.0] * (len(r.prompt_ids) - 1) + list(r.extras[key]) + [0.0])
            tok[key] = torch.tensor(vals, dtype=torch.float32)
        else:
            row[key] = torch.tensor([float(r.extras[key]) for r in rows], dtype=torch.float32)
    positions = torch.tensor(pos, dtype=torch.int64)
    media = {}
    if any(r.media is not None and r.media.positions is not None for r in rows):
        positions, media = _pack_media(rows, cu)
    routes = _pack_routes(rows) if any(r.routed_experts is not None for r in rows) else None
    return Packed(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=positions,
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        max_seqlen=max(len(r) for r in rows),
        targets=targets,
        mask=(targets != -100).float(),
        seq_index=torch.tensor(seq, dtype=torch.int64),
        num_rows=len(rows),
        old_logprobs=torch.tensor(old, dtype=torch.float32) if has_old else None,
        advantages=torch.tensor(adv, dtype=torch.float32),
        seq_advantages=torch.tensor([r.advantage for r in rows], dtype=torch.float32),
        tok=tok,
        row=row,
        routed_experts=routes,
        **media,
    )


def _pack_routes(rows: list[Row]) -> torch.Tensor:
    """The rows' recorded routes end to end, ``[T, num_moe_layers, k]``; -1 for a row without a record."""
    shape = next(r.routed_experts for r in rows if r.routed_experts is not None).shape[1:]
    parts = [torch.as_tensor(r.routed_experts, dtype=torch.int32) if r.routed_experts is not None
             else torch.full((len(r), *shape), -1, dtype=torch.int32) for r in rows]
    for r, part in zip(rows, parts):
        if part.shape != (len(r), *shape):
            raise ValueError(f"routed_experts must be [{len(r)}, {shape[0]}, {shape[1]}] for a row of {len(r)} "
                             f"tokens, got {tuple(part.shape)}")
    return torch.cat(parts)


def _pack_media(rows: list[Row], cu: list[int]) -> tuple[torch.Tensor, dict]:
    """``[3, T]`` positions and the images of the rows (see the module doc)."""
    pos, pixels, grids, hashes, index = [], [], [], [], []
    for r, start in zip(rows, cu):
        P, R = len(r.prompt_ids), len(r.response_ids)
        m = r.media
        if m is None or m.positions is None:
            pos.append(torch.arange(P + R).expand(3, -1))
            continue
        if m.positions.shape != (3, P):
            raise ValueError(f"a row's M-RoPE positions are {tuple(m.positions.shape)}, its prompt has {P} tokens")
        pos += [m.positions.to(torch.int64), (torch.arange(P, P + R) + m.rope_delta).expand(3, -1)]
        if m.pixel_values is not None:
            pixels.append(m.pixel_values)
            grids.append(m.image_grid_thw)
            hashes += list(m.image_hashes)
            image = [k for k, t in enumerate(r.prompt_ids) if t == m.image_token_id]
            index.append(torch.tensor(image, dtype=torch.int64) + start)
    out: dict = {}
    if pixels:
        out = {"pixel_values": torch.cat(pixels), "image_grid_thw": torch.cat(grids).to(torch.int64),
               "image_rows": torch.cat(index), "image_hashes": hashes}
    return torch.cat(pos, dim=1), out


def per_row(values: torch.Tensor, packed: Packed) -> list[list[float]]:
    """Split a per-token tensor back into each row's response-token values."""
    out, vals, mask = [], values.detach().float().cpu(), packed.mask.cpu() > 0
    cu = packed.cu_seqlens.tolist()
    for b in range(packed.num_rows):
        sl = slice(cu[b], cu[b + 1])
        out.append(vals[sl][mask[sl]].tolist())
    return out


def microbatches(rows: list, mini_bs: int) -> list[list]:
    return [rows[i : i + mini_bs] for i in range(0, len(rows), mini_bs)]
