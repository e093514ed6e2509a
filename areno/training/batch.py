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

Packing is vectorised: per row only its token ids and rollout log-probs are converted from lists (or taken from the
row's ``ids_tensor``/``logprobs_tensor``, which the rollout fills while other prompts still decode, so packing a
microbatch is then a concatenation); every other field is built from the row lengths with tensor ops. CUDA copies go
through pinned memory, so ``Packed.to`` never waits for the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
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
    versions: list[int] | None = None  # per response token: the policy version that sampled it (--partial-rollout)
    # Optional tensor copies of prompt_ids + response_ids (int64 [len(row)]) and rollout_logprobs (float32 [R]), made
    # ahead of the update (the rollout tensorises finished prompt groups while the rest decode); they must hold the
    # same values as the lists, pack() checks their lengths only.
    ids_tensor: torch.Tensor | None = field(default=None, repr=False, compare=False)
    logprobs_tensor: torch.Tensor | None = field(default=None, repr=False, compare=False)

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
        """The batch on ``device``. Host tensors bound for a GPU travel together: copied into one pinned staging
        buffer (16-byte aligned slots) and sent with one asynchronous copy, then viewed on the device (one copy
        instead of one pinning and one copy per tensor, and no copy from pageable memory, which may wait for the
        device's queued work)."""
        device = torch.device(device)
        fields = dict(vars(self))
        if device.type == "cuda":
            return Packed(**_to_gpu_together(fields, device))
        return Packed(**{k: ({kk: _move(vv, device) for kk, vv in v.items()} if isinstance(v, dict)
                             else _move(v, device)) for k, v in fields.items()})


def row_tensors(prompt_ids, response_ids, rollout_logprobs=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A row's ``ids_tensor`` (prompt then response ids, int64) and ``logprobs_tensor`` (float32, None without
    log-probs): what pack() would convert from the lists."""
    ids = torch.from_numpy(_array(list(prompt_ids) + list(response_ids), np.int64))
    return ids, (torch.from_numpy(_array(rollout_logprobs, np.float32)) if rollout_logprobs is not None else None)


def _array(values, dtype) -> np.ndarray:
    """Numbers (a list, tuple, array or tensor) as an array. A list goes through ``np.fromiter`` with its length:
    about 2x faster than ``np.asarray`` on a list of Python ints (4x torch.tensor), with the same rounding to
    float32; anything it cannot take goes to ``np.asarray`` (and its error)."""
    if isinstance(values, torch.Tensor):
        return np.asarray(values.detach().cpu(), dtype=dtype)
    if isinstance(values, (list, tuple)):
        try:
            return np.fromiter(values, dtype=dtype, count=len(values))
        except (TypeError, ValueError):
            pass
    return np.asarray(values, dtype=dtype)


def _move(v, device):
    return v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v


def _to_gpu_together(fields: dict, device: torch.device) -> dict:
    """``fields`` (tensors, dicts of tensors, other values) with every CPU tensor sent to ``device`` through one
    buffer (pinned for a GPU) and one copy, each arriving as a view of it; other tensors go by their own copy."""
    out, slots, total = {}, [], 0  # slots: (field, key or None, tensor, byte offset)
    for k, v in fields.items():
        moved = {}
        for kk, t in (v.items() if isinstance(v, dict) else [(None, v)]):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                slots.append((k, kk, t.contiguous(), total))
                total += -(-t.numel() * t.element_size() // 16) * 16
                moved[kk] = None  # its view of the device buffer, below
            else:
                moved[kk] = _move(t, device)
        out[k] = moved if isinstance(v, dict) else moved[None]
    if not slots:
        return out
    staging = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
    views = [(k, kk, t, slice(off, off + t.numel() * t.element_size())) for k, kk, t, off in slots]
    for _, _, t, span in views:
        staging[span].view(t.dtype).view(t.shape).copy_(t)
    on_device = staging.to(device, non_blocking=True)
    for k, kk, t, span in views:
        view = on_device[span].view(t.dtype).view(t.shape)
        if kk is None:
            out[k] = view
        else:
            out[k][kk] = view
    return out


def pack(rows: list[Row]) -> Packed:
    """Rows end to end (module doc). Response token k of row b, with P prompt tokens, is scored at packed position
    ``cu[b] + P - 1 + k``: every per-response-token list (log-probs, advantages, loss mask, extras) lands there.
    The index arithmetic runs in numpy: single-threaded, where torch would start its thread pool for every op on
    arrays of a few thousand entries."""
    if not rows:
        raise ValueError("pack() needs at least one row")
    B = len(rows)
    P = np.asarray([len(r.prompt_ids) for r in rows], dtype=np.int64)
    R = np.asarray([len(r.response_ids) for r in rows], dtype=np.int64)
    if P.min() < 1:
        raise ValueError("every row needs at least one prompt token (position P - 1 scores the first response token)")
    lens = P + R
    cu = np.zeros(B + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    T = int(cu[-1])
    ids = np.concatenate([_row_ids(r, int(n)) for r, n in zip(rows, lens)])
    # packed position of every response token, row after row (the position that predicts it)
    at = np.repeat(cu[:-1] + P - 1 - (np.cumsum(R) - R), R) + np.arange(int(R.sum()), dtype=np.int64)
    trained = ids[at + 1]
    if any(r.loss_mask is not None for r in rows):
        keep = np.concatenate([_per_response(r.loss_mask, n, np.bool_, "loss_mask") if r.loss_mask is not None
                               else np.ones(n, dtype=np.bool_) for r, n in zip(rows, R)])
        trained = np.where(keep, trained, -100)
    targets = np.full(T, -100, dtype=np.int64)
    targets[at] = trained

    def spread(values: np.ndarray) -> torch.Tensor:  # response-token values onto the packed positions
        out = np.zeros(T, dtype=np.float32)
        out[at] = values
        return torch.from_numpy(out)

    old = None
    if all(r.rollout_logprobs is not None for r in rows):
        old = spread(np.concatenate([_row_logprobs(r, int(n)) for r, n in zip(rows, R)]))
    if any(r.token_advantages is not None for r in rows):
        adv = np.concatenate([_per_response(r.token_advantages, n, np.float32, "token_advantages")
                              if r.token_advantages is not None else np.full(n, r.advantage, dtype=np.float32)
                              for r, n in zip(rows, R)])
    else:
        adv = np.repeat(np.asarray([r.advantage for r in rows], dtype=np.float32), R)
    tok, row = {}, {}
    for key in rows[0].extras:
        if isinstance(rows[0].extras[key], (list, tuple)):
            tok[key] = spread(np.concatenate([_per_response(r.extras[key], n, np.float32, f"extras[{key!r}]")
                                              for r, n in zip(rows, R)]))
        else:
            row[key] = torch.tensor([float(r.extras[key]) for r in rows], dtype=torch.float32)
    positions = torch.from_numpy(np.arange(T, dtype=np.int64) - np.repeat(cu[:-1], lens))
    media = {}
    if any(r.media is not None and r.media.positions is not None for r in rows):
        positions, media = _pack_media(rows, cu.tolist())
    routes = _pack_routes(rows) if any(r.routed_experts is not None for r in rows) else None
    return Packed(
        input_ids=torch.from_numpy(ids),
        positions=positions,
        cu_seqlens=torch.from_numpy(cu.astype(np.int32)),
        max_seqlen=int(lens.max()),
        targets=torch.from_numpy(targets),
        mask=torch.from_numpy((targets != -100).astype(np.float32)),
        seq_index=torch.from_numpy(np.repeat(np.arange(B, dtype=np.int64), lens)),
        num_rows=B,
        old_logprobs=old,
        advantages=spread(adv),
        seq_advantages=torch.tensor([r.advantage for r in rows], dtype=torch.float32),
        tok=tok,
        row=row,
        routed_experts=routes,
        **media,
    )


def _row_ids(r: Row, n: int) -> np.ndarray:
    if r.ids_tensor is not None:
        if r.ids_tensor.numel() != n:
            raise ValueError(f"a row's ids_tensor has {r.ids_tensor.numel()} tokens, its lists {n}")
        return _array(r.ids_tensor.reshape(-1), np.int64)
    return _array(list(r.prompt_ids) + list(r.response_ids), np.int64)


def _row_logprobs(r: Row, n: int) -> np.ndarray:
    if r.logprobs_tensor is not None:
        if r.logprobs_tensor.numel() != n:
            raise ValueError(f"a row's logprobs_tensor has {r.logprobs_tensor.numel()} values for {n} response tokens")
        return _array(r.logprobs_tensor.reshape(-1), np.float32)
    return _per_response(r.rollout_logprobs, n, np.float32, "rollout_logprobs")


def _per_response(values, n: int, dtype, name: str) -> np.ndarray:
    """A per-response-token list as an array; it must have one entry per response token."""
    if len(values) != n:
        raise ValueError(f"a row's {name} has {len(values)} entries for {n} response tokens")
    return _array(values, dtype)


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
