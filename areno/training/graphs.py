"""CUDA graphs for the training step: each microbatch's forward + log-probs and backward, and the optimizer step,
replayed per shape bucket, so the GPU never waits for Python to launch ~30 kernels per layer.

Buckets. A packed microbatch of T tokens, B rows and longest row L runs as ``Bucket(T', B', L', entropy)``: T' and L'
are T and L rounded up on a grid of four steps per octave (..., 1024, 1280, 1536, 1792, 2048, ...: at most 25%
over), the T' - T extra tokens form padding sequences of at most L' tokens (token 0 at position 0, target -100), and
``cu_seqlens`` is filled up to B' + 1 entries with zero-length sequences. A padding token belongs to its own
sequence, so attention keeps it out of every real row; its target is -100, so ``linear_logprobs`` gives it log-prob
0 and a zero gradient, and the loss sees only the first T log-probs: loss, normalisers (``Norms``, real tokens) and
gradients are those of the unpadded microbatch, up to the summation order of GEMMs over T' rows.

Graphs. Per (bucket, gradient mode) a forward graph (model + ``linear_logprobs`` from static input buffers into static
log-prob/entropy buffers) and a backward graph (static output gradients -> parameter gradients); all graphs share one
memory pool and replay one after another, never concurrently. The loss runs eagerly in between (any ``loss_fn``),
through an autograd Function whose backward replays the backward graph. A weighted bucket (a loss linear in the
log-probs, its token weights a static input) runs ``linear_logprobs_loss`` instead: its forward graph also returns the
loss and takes the head's gradients, and its backward graph starts from the loss. Gradient modes:

- "own" (an update of one microbatch, optimizer graphed): the backward graph writes fresh gradients into the pool,
  where activations it has consumed lived (as the eager path allocates them), and that entry's optimizer graphs
  (``MasterAdamW.device_norm``, then ``device_update``) read them: no more memory than eager. The trainer reads the
  norm and the update's stats between the two, so its host returns while the parameter update still runs.
- "acc" (several microbatches, or an eager optimizer step): persistent per-parameter gradient buffers that every
  backward, graphed or eager, adds into; one optimizer graph reads them.

A bucket is captured the ``capture_after``-th time a microbatch falls in it (2: a one-off shape runs eagerly and
never pays for a capture). Before each capture an eager warm-up runs the same shapes (Triton autotuning, lazy
initialisation); warm-up and capture happen before the update's gradients are zeroed. At most ``max_graphs`` entries
are kept (least recently used dropped). Nothing inside a captured region reads tensor values on the host
(max_seqlen is the bucket's).

Eager fallback per microbatch: activation checkpointing on, images or M-RoPE positions, routing-replay routes.
Never graphed (``unsupported`` says why): no CUDA device, a TP group, MoE / hybrid / vision-language / value models,
the native attention backend or ``ARENO_KERNELS=native`` (SDPA sizes its per-sequence loop from cu_seqlens on the
host). The optimizer graph needs one rank without state offload; otherwise the eager ``step()`` follows the graphed
microbatches. The pool stays reserved between updates (colocated rollout cannot borrow that memory).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from areno.kernels.logprobs import linear_logprobs
from areno.kernels.logprobs.loss import linear_logprobs_loss
from areno.training.loss import ForwardOut

MAX_GRAPHS = 8
MIN_TOKENS = 64  # the smallest token bucket: tiny microbatches share one graph


def bucket_up(n: int, floor: int = 1) -> int:
    """Smallest value >= max(n, floor) on a grid of four steps per octave: every integer up to 4, then multiples of
    2^(k-2) between 2^k and 2^(k+1) (1024, 1280, 1536, 1792, 2048, ...), so at most 25% above."""
    n = max(int(n), floor)
    if n <= 4:
        return n
    step = 1 << (n.bit_length() - 3)
    return -(-n // step) * step


@dataclass(frozen=True)
class Bucket:
    tokens: int  # T': padded token count
    seqs: int  # B': cu_seqlens has B' + 1 entries (rows, padding sequences, zero-length sequences)
    max_seqlen: int  # L': the attention grid's sequence bound
    entropy: bool  # whether the graph also returns the entropy
    weighted: bool = False  # the head is linear_logprobs_loss: the graph returns the loss (its gradient already taken)


def bucket_of(packed, entropy: bool = False, min_tokens: int = MIN_TOKENS, weighted: bool = False) -> Bucket:
    """The bucket a packed microbatch runs in (see the module docstring)."""
    t = packed.input_ids.numel()
    tokens = bucket_up(t, min_tokens)
    max_seqlen = bucket_up(packed.max_seqlen)
    pad_seqs = -(-(tokens - t) // max_seqlen)
    return Bucket(tokens, bucket_up(packed.num_rows + pad_seqs), max_seqlen, bool(entropy), bool(weighted))


def pad_inputs(packed, bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids [T'], positions [T'], cu_seqlens int32 [B'+1], targets [T'])`` of ``packed`` padded to ``bucket``,
    on ``packed``'s device; the first T entries are ``packed``'s own."""
    t = packed.input_ids.numel()
    pad, cap = bucket.tokens - t, bucket.max_seqlen
    lengths = [cap] * (pad // cap) + ([pad % cap] if pad % cap else []) if pad > 0 else []
    rows = packed.num_rows + len(lengths)
    if pad < 0 or rows > bucket.seqs or packed.max_seqlen > cap or packed.positions.dim() != 1:
        raise ValueError(f"a microbatch of {t} tokens, {packed.num_rows} rows (longest {packed.max_seqlen}) does not "
                         f"fit {bucket}")
    dev = packed.input_ids.device
    # the padding sequences' ends t + cap, t + 2 cap, ..., then t + pad: formed on the device (no host copy)
    ends = t + cap * torch.arange(1, pad // cap + 1, dtype=torch.int32, device=dev)
    tail = [torch.full((1,), t + pad, dtype=torch.int32, device=dev)] if pad % cap else []
    cu = torch.cat([packed.cu_seqlens.to(torch.int32), ends, *tail,
                    torch.full((bucket.seqs - rows,), bucket.tokens, dtype=torch.int32, device=dev)])
    zeros = torch.zeros(pad, dtype=torch.int64, device=dev)  # padding tokens: id 0 at position 0
    return (torch.cat([packed.input_ids, zeros]), torch.cat([packed.positions.to(torch.int64), zeros]), cu,
            torch.cat([packed.targets, torch.full_like(zeros, -100)]))


def unsupported(model, *, tp_group=None) -> str | None:
    """Why the training step of ``model`` cannot be graphed on this run, or None when it can."""
    from areno.kernels.dispatch import kernel_mode
    from areno.models.base import Attention, CausalLM

    if not torch.cuda.is_available() or next(model.parameters()).device.type != "cuda":
        return "needs a CUDA device"
    if model.is_value_model:
        return "a value model (the PPO critic) trains eagerly"
    kind = model.config.model_type
    if not isinstance(model, CausalLM) or type(model).forward is not CausalLM.forward:
        return f"the {kind} forward is not graphed (dense text decoders only)"
    if model.num_moe_layers or model.recurrent_state_shapes() is not None or any(
            type(layer.self_attn) is not Attention for layer in model.layers):
        return f"the {kind} model has MoE or recurrent layers (dense attention decoders only)"
    if tp_group is not None and torch.distributed.get_world_size(tp_group) > 1:
        return "tensor parallelism (--tp-size > 1) is not graphed"
    if model.attn_backend == "native" or kernel_mode() == "native":
        return "the native attention path (--attn-backend native or ARENO_KERNELS=native) reads cu_seqlens on the host"
    return None


class CudaGraph:
    """One graph captured into the shared pool on the capture stream."""

    def __init__(self, pool, stream):
        self.graph, self.pool, self.stream = torch.cuda.CUDAGraph(), pool, stream

    def capture(self, body) -> None:
        with torch.cuda.graph(self.graph, pool=self.pool, stream=self.stream):
            body()

    def replay(self) -> None:
        self.graph.replay()


@dataclass
class _Entry:
    bucket: Bucket
    mode: str
    inputs: tuple[torch.Tensor, ...]  # static input_ids, positions, cu_seqlens, targets (, token weights)
    outputs: list[torch.Tensor]  # static log-probs (, entropy), fp32 [T']; weighted: loss [], log-probs [T']
    grad_outputs: list[torch.Tensor]  # the differentiable outputs' gradients (the first ones), written before the
    # backward replay
    fwd: object = None
    bwd: object = None
    opt: object = None  # "own" mode: this entry's optimizer graphs (norm, update)
    live: tuple | None = field(default=None, repr=False)  # outputs with autograd history, between fwd and bwd capture


class _Replay(torch.autograd.Function):
    """Forward: replay the forward graph, return aliases of its outputs. Backward: copy the incoming gradients into
    the static buffers and replay the backward graph (it writes the parameters' gradients itself)."""

    @staticmethod
    def forward(ctx, entry, anchor):
        entry.fwd.replay()
        ctx.entry = entry
        ctx.set_materialize_grads(False)
        outs = tuple(o.detach() for o in entry.outputs)
        ctx.mark_non_differentiable(*outs[len(entry.grad_outputs):])
        return outs

    @staticmethod
    def backward(ctx, *grads):
        entry = ctx.entry
        for buf, g in zip(entry.grad_outputs, grads):
            if g is None:
                buf.zero_()
            else:
                buf.copy_(g)
        entry.bwd.replay()
        return None, None


class TrainGraphs:
    """Captured training microbatches of one model (and optimizer steps of its ``MasterAdamW``); see the module
    docstring. ``graph_class`` builds one graph from ``(pool, stream)`` (``CudaGraph``; tests pass a CPU stand-in
    whose ``capture`` runs the body once and whose ``replay`` runs it again)."""

    def __init__(self, model, optimizer, *, temperature=1.0, chunk_size=None, grad_clip=1.0, max_graphs=MAX_GRAPHS,
                 capture_after=2, graph_class=None):
        from areno.training.optimizer import MasterAdamW

        self.model, self.optimizer = model, optimizer
        self.temperature, self.chunk_size, self.grad_clip = temperature, chunk_size, float(grad_clip)
        self.max_graphs = max(1, int(max_graphs))
        self.capture_after = max(1, int(capture_after))
        self.seen: dict[Bucket, int] = {}  # microbatches per bucket so far
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.device = self.params[0].device
        self.graph_class = graph_class or CudaGraph
        on_cuda = self.device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if on_cuda else None
        self.stream = torch.cuda.Stream(self.device) if on_cuda else None
        self.device_optimizer = (isinstance(optimizer, MasterAdamW) and optimizer.dp_group is None
                                 and optimizer.tp_group is None and optimizer.offload == "none"
                                 and optimizer.states == "fp32")  # 8-bit moments: the eager step
        self.entries: OrderedDict[tuple[Bucket, str], _Entry] = OrderedDict()
        self.anchor = torch.zeros(0, device=self.device, requires_grad=True)  # gives _Replay a backward
        scalar = lambda: torch.zeros((), dtype=torch.float32, device=self.device)  # noqa: E731
        self.lr, self.step, self.skip = scalar(), scalar(), scalar()
        self.group_lrs = {name: scalar() for name in getattr(optimizer, "groups", [])}
        self.norm = torch.zeros((), dtype=torch.float64, device=self.device)
        self.grads: list[torch.Tensor] | None = None  # "acc" mode's persistent gradients
        self.acc_opt = None
        self.optimizer_warm = False
        self.captures = self.replays = 0  # graphs captured, microbatches replayed (tests and benchmarks read them)

    # ---- when graphs apply -------------------------------------------------------------------------------------
    def applies(self, packed, routes=False) -> bool:
        """Whether this microbatch can replay a graph now (the per-microbatch eager cases of the module doc)."""
        checkpointing = self.model.activation_checkpointing
        return not (checkpointing or routes or packed.positions.dim() != 1 or packed.pixel_values is not None)

    def bucket(self, packed, entropy=False, routes=False, weighted=False) -> Bucket | None:
        """The bucket this microbatch replays in, or None to run it eagerly (it cannot be graphed, or its bucket
        has been seen fewer than ``capture_after`` times). ``weighted``: the loss is linear in the log-probs and
        comes with its token weights (``linear_logprobs_loss``)."""
        if not self.applies(packed, routes):
            return None
        b = bucket_of(packed, entropy, weighted=weighted)
        if len(self.seen) > 4096:
            self.seen.clear()
        self.seen[b] = self.seen.get(b, 0) + 1
        captured = any(key[0] == b for key in self.entries)
        return b if captured or self.seen[b] >= self.capture_after else None

    # ---- one update ----------------------------------------------------------------------------------------------
    def begin_update(self, buckets: list[Bucket | None], packs: list) -> str:
        """Capture what this update's microbatches need (before any gradient of the update exists), then set up
        the gradients: none ("own") or the zeroed persistent buffers attached as ``p.grad`` ("acc"). Returns the
        mode the microbatches and the optimizer step use."""
        mode = "own" if len(packs) == 1 and self.device_optimizer else "acc"
        needed = []
        for bucket, packed in zip(buckets, packs):
            if bucket is None:
                continue
            key = (bucket, mode)
            if key not in self.entries:
                self._evict(keep=needed)
                self.entries[key] = self._capture(bucket, mode, packed)
            self.entries.move_to_end(key)
            needed.append(key)
        if mode == "own":
            self._clear_grads()
            return mode
        if self.grads is None:
            self.grads = [torch.zeros_like(p) for p in self.params]
        for p, g in zip(self.params, self.grads):
            p.grad = g
        if self.device_optimizer and self.acc_opt is None:
            self.acc_opt = self._capture_optimizer()
        torch._foreach_zero_(self.grads)
        return mode

    def forward(self, packed, bucket: Bucket, mode: str, token_weights=None):
        """Replay ``packed`` (host or device) through its bucket's forward graph: a ForwardOut over its own T tokens,
        differentiable (the backward replays the backward graph). A weighted bucket takes ``token_weights`` [T]
        and returns the loss (``ForwardOut.loss``) beside log-probs without gradient."""
        entry = self.entries[(bucket, mode)]
        t = packed.input_ids.numel()
        for buf, src in zip(entry.inputs, pad_inputs(packed, bucket)):
            buf.copy_(src, non_blocking=True)
        if bucket.weighted:
            if token_weights is None or token_weights.shape != (t,):
                raise ValueError(f"a weighted bucket needs token weights for its {t} tokens")
            entry.inputs[4][:t].copy_(token_weights, non_blocking=True)
            entry.inputs[4][t:].zero_()
        outs = _Replay.apply(entry, self.anchor)
        self.replays += 1
        if bucket.weighted:
            return ForwardOut(outs[1][:t], None, loss=outs[0])
        return ForwardOut(outs[0][:t], outs[1][:t] if bucket.entropy else None)

    def optimizer_step(self, lr: float, group_lrs: dict[str, float], mode: str, bucket: Bucket | None) -> torch.Tensor:
        """Replay the norm graph of this update's gradients; returns the device norm. The caller queues its reads
        of the norm, then calls ``optimizer_update`` (so the host need not wait for the update), reads the norm and
        calls ``count_step``."""
        self.lr.fill_(lr)
        for name, t in self.group_lrs.items():
            t.fill_(group_lrs[name])
        self.step.fill_(float(self.optimizer.num_steps))
        self.skip.fill_(0.0)
        self._optimizer_graphs(mode, bucket)[0].replay()
        return self.norm

    def optimizer_update(self, mode: str, bucket: Bucket | None) -> None:
        """Replay the update graph after ``optimizer_step``."""
        self._optimizer_graphs(mode, bucket)[1].replay()

    def _optimizer_graphs(self, mode: str, bucket: Bucket | None):
        return self.entries[(bucket, mode)].opt if mode == "own" else self.acc_opt

    def count_step(self, norm: float) -> None:
        """The host side of ``device_step``: a finite norm was an update."""
        if norm == norm and abs(norm) != float("inf"):
            self.optimizer.num_steps += 1

    def close(self) -> None:
        """Drop every graph and buffer (their pool memory returns once nothing uses it)."""
        self.entries.clear()
        self.acc_opt, self.grads = None, None
        self._clear_grads()

    def _clear_grads(self) -> None:
        for p in self.params:
            p.grad = None

    # ---- capture -------------------------------------------------------------------------------------------------
    def _stream(self):
        if self.stream is None:
            return contextlib.nullcontext()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.stream)

    def _join(self) -> None:
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def _evict(self, keep) -> None:
        while len(self.entries) >= self.max_graphs:
            old = next((k for k in self.entries if k not in keep), None)
            if old is None:
                return
            del self.entries[old]

    def _forward_body(self, entry: _Entry) -> None:
        input_ids, positions, cu_seqlens, targets = entry.inputs[:4]
        hidden = self.model(input_ids, positions, cu_seqlens=cu_seqlens, max_seqlen=entry.bucket.max_seqlen)
        if entry.bucket.weighted:
            out = linear_logprobs_loss(hidden, self.model.lm_head_weight, targets, entry.inputs[4],
                                       temperature=self.temperature, chunk_size=self.chunk_size)
        else:
            out = linear_logprobs(hidden, self.model.lm_head_weight, targets, temperature=self.temperature,
                                  return_entropy=entry.bucket.entropy, chunk_size=self.chunk_size)
        entry.live = out if isinstance(out, tuple) else (out,)
        with torch.no_grad():
            for dst, src in zip(entry.outputs, entry.live):
                dst.copy_(src)

    def _backward_body(self, entry: _Entry) -> None:
        live, entry.live = entry.live, None
        torch.autograd.backward(live[: len(entry.grad_outputs)], entry.grad_outputs)

    def _capture(self, bucket: Bucket, mode: str, packed) -> _Entry:
        dev = self.device
        inputs = tuple(t.to(dev).clone() for t in pad_inputs(packed, bucket))
        if bucket.weighted:  # token weights (zero while warming up and capturing); loss and log-probs out
            inputs += (torch.zeros(bucket.tokens, device=dev),)
            entry = _Entry(bucket, mode, inputs, [torch.zeros((), device=dev), torch.zeros(bucket.tokens, device=dev)],
                           [torch.zeros((), device=dev)])
        else:
            n = 2 if bucket.entropy else 1
            entry = _Entry(bucket, mode, inputs, [torch.zeros(bucket.tokens, device=dev) for _ in range(n)],
                           [torch.zeros(bucket.tokens, device=dev) for _ in range(n)])
        self._clear_grads()
        with self._stream():  # warm-up: autotuning and lazy initialisation outside the capture
            self._forward_body(entry)
            self._backward_body(entry)
        self._join()
        self._clear_grads()
        if mode == "acc":
            if self.grads is None:
                self.grads = [torch.zeros_like(p) for p in self.params]
            for p, g in zip(self.params, self.grads):  # the backward graph adds into these
                p.grad = g
        entry.fwd = self.graph_class(self.pool, self.stream)
        entry.fwd.capture(lambda: self._forward_body(entry))
        entry.bwd = self.graph_class(self.pool, self.stream)
        entry.bwd.capture(lambda: self._backward_body(entry))
        self.captures += 2
        if mode == "own":  # p.grad now holds the pool tensors the backward graph writes
            entry.opt = self._capture_optimizer()
        self._clear_grads()
        return entry

    def _norm_body(self, held: dict) -> None:
        norm, held["bad"], held["scale"] = self.optimizer.device_norm(self.grad_clip, skip=self.skip,
                                                                      plan=held["plan"])
        self.norm.copy_(norm)

    def _update_body(self, held: dict) -> None:
        self.optimizer.device_update(self.lr, self.step, held["bad"], held["scale"], group_lrs=self.group_lrs,
                                     plan=held["plan"])

    def _capture_optimizer(self):
        """The optimizer's two graphs over the current ``p.grad`` tensors (``MasterAdamW.device_norm``, then
        ``device_update`` from the clip factor and skip flag the first leaves in the pool). Captured (and, once,
        warmed up) as a dry run: ``skip`` is 1 until a replay sets it to 0."""
        self.skip.fill_(1.0)
        # the multi-tensor launch tables over these gradients, built before the capture; the graphs hold them
        held: dict = {"plan": self.optimizer.device_plan()}  # and the norm graph's bad/scale for the update graph
        if not self.optimizer_warm:
            warm = {"plan": held["plan"]}
            with self._stream():
                self._norm_body(warm)
                self._update_body(warm)
            self._join()
            self.optimizer_warm = True
        graphs = (self.graph_class(self.pool, self.stream), self.graph_class(self.pool, self.stream))
        graphs[0].capture(lambda: self._norm_body(held))
        graphs[1].capture(lambda: self._update_body(held))
        graphs[0].held = graphs[1].held = held
        self.captures += 2
        return graphs
