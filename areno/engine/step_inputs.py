"""The records a step travels as: ``StepInputs`` (plain lists, what TP rank 0 broadcasts and every rank executes),
its ``LogitAdjust`` rows, and ``DecodeLaunch``, a queued k-step decode group (see ``model_runner``)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from areno.engine.images import ImageStep


@dataclass
class LogitAdjust:
    """A step's per-row logit adjustments (see the module docstring), one entry per sampled row."""

    slots: list[int]  # the row's token-count slot, -1: no penalties
    repetition: list[float]
    presence: list[float]
    frequency: list[float]
    min_p: list[float]
    min_left: list[int]  # output tokens still to sample before EOS and stop ids may be (min_tokens)
    sparse: list[list[tuple[int, float, bool]]]  # (token id, bias, banned while min_left > 0); distinct ids
    init: list[tuple[int, list[int], list[int]]]  # slots to fill before the step: (slot, prompt ids, output ids)

    @property
    def width(self) -> int:
        return max(map(len, self.sparse), default=0)


@dataclass
class StepInputs:
    """One step as plain lists: what TP rank 0 broadcasts and every rank executes."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    cu_q: list[int]
    seq_lens: list[int]
    tables: list[list[int]]
    is_decode: bool
    row_index: list[int]  # hidden row sampled by each output row
    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    seeds: list[int]
    offsets: list[int]
    top_logprobs: int
    copies: list[tuple[int, int]]
    decode_steps: int = 1  # > 1: multi-step decode (see the module docstring)
    adjust: LogitAdjust | None = None  # per-row logit adjustments, None when no row has any
    token_mask: tuple | None = None  # structured outputs: (rows, int32 bitmask), see areno.engine.grammar
    # prompts with images (areno.engine.images), None for text: the model's positions where they differ from the
    # cache positions ([T], or [3][T] when the step holds image tokens), decode's per-row offsets, the image work
    rope_positions: list | None = None
    rope_offsets: list[int] | None = None
    images: ImageStep | None = None
    # hybrid models: each sequence's (chunk's) recurrent-state slot, and the (src, dst) slot copies of forks
    state_slots: list[int] | None = None
    state_copies: list[tuple[int, int]] | None = None
    # several KV-cache groups (sliding-window layers, see areno.engine.kv_cache): groups 1.. own tables and slots,
    # [group - 1][sequence] (``tables`` and ``slots`` are group 0's); None with one group
    group_tables: list[list[list[int]]] | None = None
    group_slots: list[list[int]] | None = None
    # LoRA serving (areno.engine.lora_slots): the adapter slot of each token row (-1: the base); None when none has one
    lora: list[int] | None = None
    # a steady speculative step without TP: its drafts' tokens [B, K] on the device (``ids`` holds zeros there),
    # written into the verify's ids by ``spec_graphs.VerifyGraphs.run``; never broadcast (TP steps list them)
    draft_ids: torch.Tensor | None = None


@dataclass
class DecodeLaunch:
    """A k-step decode group queued on the device and not yet read (``ModelRunner.launch_decode_steps``)."""

    k: int
    n: int  # rows
    device_tokens: torch.Tensor | None  # [k, >= n] on the device: a later group's input ids come from its last step
    host: tuple  # (tokens int64, logprobs) [k, >= n] on the host: pinned copies in flight, or the results
    event: object = None  # a CUDA event after the copies to ``host``; None when ``host`` is ready


def unused_filters(top_k: list[int], top_p: list[float]) -> tuple[bool, bool]:
    """Whether no row uses top-k (every k <= 0) and whether none uses top-p (every p >= 1), read from the host lists:
    the sampler is then given None for that filter and skips its threshold (on the native path a sort of every row),
    drawing the same tokens."""
    return all(k <= 0 for k in top_k), all(p >= 1.0 for p in top_p)


def pad_tables(tables: list[list[int]], rows: int, width: int, repeat: int = 1) -> np.ndarray:
    """Block tables as an int32 ``[rows, width]`` array, zero-padded: row ``i * repeat + j`` holds ``tables[i]``
    for j < ``repeat`` (a verify's K + 1 rows of one sequence share its table), rows past them zeros. From 24 tables
    one scatter whatever the count (a row-by-row fill cost ~1.5 us a row, 0.9 ms a step at 128 sequences where each
    row was a tensor of its own)."""
    out = np.zeros((rows, width), dtype=np.int32)
    n = len(tables)
    if n < 24:  # a few rows: one slice each is cheaper than the scatter's fixed ~10 us
        for i, tb in enumerate(tables):
            out[i * repeat : (i + 1) * repeat, : len(tb)] = tb
        return out
    lens = np.fromiter(map(len, tables), dtype=np.int64, count=n)
    total = int(lens.sum())
    flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int32, count=total)
    row = np.repeat(np.arange(n), lens)
    col = np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens)
    if repeat == 1:
        out[row, col] = flat
    else:
        one = np.zeros((n, width), dtype=np.int32)
        one[row, col] = flat
        out[: n * repeat] = np.repeat(one, repeat, axis=0)
    return out


_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32, torch.float64: np.float64}


def host_tensor(values, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on the host, through numpy: a step's per-row lists become tensors
    ~7x faster (384 ints: 8 us against 60; a steady verify step at 128 sequences builds a dozen such)."""
    return torch.from_numpy(np.array(values, dtype=_NUMPY[dtype]))
