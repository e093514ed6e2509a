"""A prompt's images inside the rollout engine: the tokens they cover, their M-RoPE positions, their content hashes
(prefix-cache keys), and the per-step plan that gives each prefill chunk its rows of the image embeddings.

The vision tower runs in the model runner once per prompt, at the first prefill chunk that reaches an image token:
on all the prompt's images at once (the images of every prompt that starts in the same step in one tower call).
The embeddings stay on the device until the step that takes the prompt's last image rows, so chunked prefill may
split an image. The n samples of a prompt fork after its prefill and never run the tower; a sequence preempted and
recomputed runs it again unless the prefix cache still holds its image blocks (a cached block needs no rows).

Positions: prompt token ``i`` sits at ``positions[:, i]`` (``[3, P]``, ``mrope_positions``), every later token
``n`` (generated, or recomputed after a preemption) at ``n + rope_delta`` on all three streams. Only image tokens
have streams that differ, so a step without image tokens passes ``[T]`` positions, and decode passes the cache
position plus a per-row offset (the CUDA graphs' ``rope_off`` buffer).
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
from dataclasses import dataclass

import numpy as np
import torch

_keys = itertools.count()


class PromptImages:
    """The images of one prompt (shared by its n samples). ``key`` names its embeddings in the runner."""

    def __init__(self, pixel_values, image_grid_thw, hashes, spans, positions: np.ndarray, rope_delta: int):
        self.key = next(_keys)
        self.pixel_values, self.image_grid_thw = pixel_values, image_grid_thw
        self.spans = spans  # [(first token, one past the last)] of each image, in prompt order
        self.ids = [(h, *g) for h, g in zip(hashes, image_grid_thw.tolist())]  # what a prefix-cache key holds
        self.positions, self.rope_delta = positions, rope_delta
        self.prompt_len = positions.shape[1]
        self.num_rows = sum(e - s for s, e in spans)  # rows of the tower's output
        self.image_end = spans[-1][1]
        self._starts = [s for s, _ in spans]
        self._before = list(itertools.accumulate((e - s for s, e in spans), initial=0))

    @classmethod
    def from_prompt(cls, mm, prompt_ids: list[int], model) -> PromptImages | None:
        """From a ``MultimodalPrompt``-like object (``input_ids``, ``pixel_values``, ``image_grid_thw`` and, when
        known, ``image_hashes``, ``positions``, ``rope_delta``); None when it holds no image."""
        if getattr(mm, "pixel_values", None) is None:
            return None
        if not model.is_multimodal:
            raise ValueError(f"the model ({model.config.model_type}) does not take image input")
        if list(mm.input_ids) != list(prompt_ids):
            raise ValueError("prompt_ids differ from the multimodal prompt's input_ids")
        pv, grid = mm.pixel_values.detach().cpu(), torch.as_tensor(mm.image_grid_thw).cpu().long().reshape(-1, 3)
        patches = grid.prod(-1).tolist()
        if pv.shape[0] != sum(patches):
            raise ValueError(f"pixel_values has {pv.shape[0]} rows but image_grid_thw needs {sum(patches)}")
        hashes = list(getattr(mm, "image_hashes", None) or [])
        if len(hashes) != len(patches):
            hashes = [hashlib.sha256(c.contiguous().numpy().tobytes()).hexdigest() for c in pv.split(patches)]
        positions = getattr(mm, "positions", None)
        if positions is None or tuple(positions.shape) != (3, len(prompt_ids)):
            positions, deltas = model.mrope_positions(torch.tensor(prompt_ids), grid)  # checks the placeholders
            delta = deltas[0]
        else:
            delta = int(mm.rope_delta)
        positions = positions.cpu().numpy().astype(np.int64)
        cfg = model.config
        sizes = [t * h * w // cfg.vision.spatial_merge_size**2 for t, h, w in grid.tolist()]
        image = np.flatnonzero(np.asarray(prompt_ids) == cfg.image_token_id)
        if len(image) != sum(sizes):
            raise ValueError(f"the prompt holds {len(image)} image tokens but its images give {sum(sizes)}")
        firsts = list(itertools.accumulate(sizes[:-1], initial=0))
        spans = [(int(image[f]), int(image[f]) + n) for f, n in zip(firsts, sizes)]
        if any(int(image[f + n - 1]) != s + n - 1 for f, n, (s, _) in zip(firsts, sizes, spans)):
            raise ValueError("each image's placeholder tokens must be consecutive")
        return cls(pv, grid, hashes, spans, positions, delta)

    def rows_before(self, i: int) -> int:
        """Image tokens (rows of the embeddings) among the first ``i`` tokens."""
        j = bisect.bisect_right(self._starts, i) - 1
        if j < 0:
            return 0
        s, e = self.spans[j]
        return self._before[j] + min(i, e) - s

    def ids_in(self, start: int, end: int) -> tuple:
        """Identities (content hash, grid) of the images with a token in ``[start, end)``: a KV block's extra key."""
        return tuple(im for im, (s, e) in zip(self.ids, self.spans) if s < end and e > start)

    def token_rows(self, start: int, end: int) -> list[int]:
        """Indices (from ``start``) of the image tokens in ``[start, end)``."""
        out = []
        for s, e in self.spans:
            if s < end and e > start:
                out.extend(range(max(s, start) - start, min(e, end) - start))
        return out

    def rope_positions(self, start: int, end: int) -> np.ndarray:
        """int64 ``[3, end - start]``: the M-RoPE positions of tokens ``start..end-1``."""
        p = self.prompt_len
        if end <= p:
            return self.positions[:, start:end]
        later = np.arange(max(start, p), end, dtype=np.int64) + self.rope_delta
        return np.concatenate([self.positions[:, start:p], np.broadcast_to(later, (3, len(later)))], axis=1)


@dataclass
class ImageStep:
    """A step's image work, planned on TP rank 0 and executed on every rank."""

    encode: list[tuple[int, torch.Tensor, torch.Tensor, int]]  # (key, pixel_values, grid, rows): tower inputs
    take: list[tuple[int, int, int]]  # (key, first row, end row) per chunk, in the step's token order
    rows: list[int]  # the step's token rows that take the embeddings, in the same order
    release: list[int]  # keys whose embeddings no later step needs


class ImageEmbeddings:
    """The runner's resident image embeddings ``key -> (embeds [N, H], deepstack [K, N, H])`` (the same on every TP
    rank), and on rank 0 the sequences that still read each entry."""

    def __init__(self, model):
        self.model = model
        self.resident: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.readers: dict[int, list] = {}  # rank 0: key -> sequences that took rows of it

    def plan(self, chunks) -> ImageStep | None:
        """Rank 0: which images to encode, which rows each chunk takes, what to drop after the step."""
        from areno.engine.sequence import Status

        encode, take, rows, offset, planned = [], [], [], 0, set()
        for c in chunks:
            im = c.seq.mm
            if im is not None and c.start < im.image_end:
                k0, k1 = im.rows_before(c.start), im.rows_before(c.end)
                if k1 > k0:
                    if im.key not in self.resident and im.key not in planned:
                        encode.append((im.key, im.pixel_values, im.image_grid_thw, im.num_rows))
                        planned.add(im.key)
                    take.append((im.key, k0, k1))
                    rows.extend(offset + r for r in im.token_rows(c.start, c.end))
                    readers = self.readers.setdefault(im.key, [])
                    if c.seq not in readers:
                        readers.append(c.seq)
            offset += c.end - c.start
        if not take and not self.readers:
            return None
        ends = {id(c.seq): c.end for c in chunks}
        release = [key for key, seqs in self.readers.items()
                   if not any(s.status is Status.RUNNING and ends.get(id(s), s.num_computed) < s.mm.image_end
                              for s in seqs)]  # fmt: skip
        for key in release:
            del self.readers[key]
        return ImageStep(encode, take, rows, release)

    def inputs(self, plan: ImageStep, device) -> dict:
        """Every rank: run the tower on the new images, then the step's ``image_embeds`` / ``image_rows``."""
        if plan.encode:
            pv = torch.cat([p for _, p, _, _ in plan.encode]).to(device, non_blocking=True)
            grid = torch.cat([g for _, _, g, _ in plan.encode]).to(device)
            embeds, deepstack = self.model.encode_images(pv, grid)
            sizes = [n for *_, n in plan.encode]
            for (key, *_), e, d in zip(plan.encode, embeds.split(sizes), deepstack.split(sizes, dim=1)):
                self.resident[key] = (e, d)
        if not plan.take:
            return {}
        parts = [(self.resident[key][0][k0:k1], self.resident[key][1][:, k0:k1]) for key, k0, k1 in plan.take]
        embeds = parts[0][0] if len(parts) == 1 else torch.cat([e for e, _ in parts])
        deepstack = parts[0][1] if len(parts) == 1 else torch.cat([d for _, d in parts], dim=1)
        rows = torch.tensor(plan.rows, dtype=torch.int64).to(device, non_blocking=True)
        return {"image_embeds": (embeds, deepstack), "image_rows": rows}

    def release(self, plan: ImageStep) -> None:
        for key in plan.release:
            self.resident.pop(key, None)

    def clear(self) -> None:
        self.resident.clear()
        self.readers.clear()
