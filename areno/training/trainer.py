"""The training side of a step: per-token log-probs of a packed batch and optimizer updates over microbatches.

``--mini-bs`` rows form one gradient microbatch (per data-parallel rank); ``--gradient-accumulation-steps``
microbatches form one optimizer update. Losses are normalised by the token/row counts of the whole update (summed
over microbatches and data-parallel ranks), so accumulation gives the same update as one big microbatch.
The model's parameters are shared with the colocated rollout engine: the optimizer writes them in place.
Named optimizer groups (an unfrozen multimodal tower or projector) follow their own schedules (``group_schedules``)
and their rates are reported as ``lr_<group>`` beside ``lr``. Images reach the forward as the packed batch's
``pixel_values``/``image_grid_thw`` with ``[3, T]`` M-RoPE positions; with the tower and projector frozen, each
distinct image of a microbatch is encoded once (no gradient) and its embeddings reused by every row that shows it.
``train_cuda_graphs`` (auto/on/off, ``--train-cuda-graphs``): replay each text microbatch's forward/backward and the
optimizer step as CUDA graphs per shape bucket (areno.training.graphs: which models and runs it applies to, and the
per-microbatch eager cases); "auto" graphs where it applies, "on" refuses a model or run where it cannot.
A ``loss_fn`` is a ``LossFn`` (areno.training.loss) or a plain callable: one with ``token_weights`` (linear in the
log-probs: SFT) or ``token_loss`` (a ``linear_logprobs_loss`` token function: GRPO/PPO) runs the head as
``linear_logprobs_loss`` (gradient taken in the forward, one GEMM-equivalent fewer; a token function eagerly only,
weights in graphs too) and gets the loss as ``ForwardOut.loss``, which it must return as its own; not with entropy or
a TP group. ``mtp`` (``--mtp-loss-weight``, areno.training.mtp): each eager microbatch also trains the MTP draft on the
forward's detached hidden states, its optimizer stepping after the policy's.
"""

from __future__ import annotations

import logging
import math

import torch

from areno.config import ConfigError
from areno.config.constants import TRAIN_CUDA_GRAPHS
from areno.config.fields import check_choice
from areno.distributed.collectives import all_sum, group_rank, group_size
from areno.kernels.logprobs import linear_logprobs
from areno.kernels.logprobs.loss import linear_logprobs_loss
from areno.training.batch import Packed, Row, pack
from areno.training.graphs import TrainGraphs, unsupported
from areno.training.loss import ForwardOut, LossFn, Norms
from areno.training.multimodal import media_inputs

log = logging.getLogger("areno.train")


def _read_back(values: torch.Tensor, then=None) -> list[float]:
    """``values.tolist()``; on CUDA ``then()`` (more GPU work, e.g. the parameter update) is queued after the copy
    and not waited for: the host goes on while it runs (later GPU work is ordered after it on the stream)."""
    if not values.is_cuda:
        if then is not None:
            then()
        return values.tolist()
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    if then is not None:
        then()
    done.synchronize()
    return host.tolist()


class PolicyTrainer:
    def __init__(self, model, optimizer, schedule, *, temperature=1.0, grad_clip=1.0, dp_group=None, tp_group=None,
                 logprob_chunk_size=None, router_bias_update_rate=0.0, group_schedules=None,
                 train_cuda_graphs="auto"):
        self.model = model
        self.optimizer = optimizer
        self.schedule = schedule
        self.group_schedules = dict(group_schedules or {})  # optimizer group name -> LRSchedule
        self.temperature = temperature
        self.grad_clip = grad_clip
        self.dp_group = dp_group
        self.tp_group = tp_group
        self.chunk_size = logprob_chunk_size
        self.router_bias_update_rate = router_bias_update_rate
        self.routing_replay = False  # the loop turns it on (--routing-replay): rows' routes go to the policy forward
        self.mtp = None  # an areno.training.mtp.MTPTrainer (--mtp-loss-weight): the MTP draft trains beside the policy
        if router_bias_update_rate and not model.has_routing_bias:
            raise ConfigError("--router-bias-update-rate", f"the {model.config.model_type} policy has no MoE selection "
                              "bias to update (Ling 3, bailing_hybrid, has one)")
        self.device = next(model.parameters()).device
        self.dp_rank, self.dp_size = group_rank(dp_group), group_size(dp_group)
        self.num_updates = 0
        check_choice("--train-cuda-graphs", train_cuda_graphs, TRAIN_CUDA_GRAPHS)
        self.graphs: TrainGraphs | None = None
        self.graphs_required = train_cuda_graphs == "on"
        why = None if train_cuda_graphs == "off" else unsupported(model, tp_group=tp_group)
        if train_cuda_graphs == "on" and why:
            raise ConfigError("--train-cuda-graphs", f"on does not apply to this run: {why}")
        if train_cuda_graphs != "off" and why is None:
            self.graphs = TrainGraphs(model, optimizer, temperature=temperature, chunk_size=logprob_chunk_size,
                                      grad_clip=grad_clip)

    # ---- log-probs -----------------------------------------------------------------------------------------
    def forward(self, packed: Packed, *, entropy=False, keep_hidden=False, replay=True,
                token_loss=None) -> ForwardOut:
        """Log-probs (and entropy) of ``packed``'s targets; with routing replay on and ``replay``, the policy runs
        the experts the rollout chose (areno.rl.routing_replay). ``token_loss`` (weights [T] or a token function): also
        its loss through ``linear_logprobs_loss`` (no entropy, no TP group)."""
        p = packed.to(self.device) if packed.input_ids.device != self.device else packed
        if self.model.is_value_model:
            values = self.model.values(p.input_ids, p.positions, cu_seqlens=p.cu_seqlens, max_seqlen=p.max_seqlen,
                                       **media_inputs(self.model.backbone, p))
            return ForwardOut(None, None, values=values)
        routes = {}
        if replay and self.routing_replay and p.routed_experts is not None:
            routes["routed_experts"] = p.routed_experts
        hidden = self.model(p.input_ids, p.positions, cu_seqlens=p.cu_seqlens, max_seqlen=p.max_seqlen,
                            **media_inputs(self.model, p), **routes)
        if token_loss is not None:
            if entropy or self.tp_group is not None:
                raise ValueError("token_loss: linear_logprobs_loss has no entropy and no TP group")
            loss, lp = linear_logprobs_loss(hidden, self.model.lm_head_weight, p.targets, token_loss,
                                            temperature=self.temperature, chunk_size=self.chunk_size)
            return ForwardOut(lp, None, hidden if keep_hidden else None, loss=loss)
        if self.model.logit_softcap is not None:  # Gemma 4: soft-capped logits, the model's own log-probs
            out = self.model.token_logprobs(hidden, p.targets, temperature=self.temperature, return_entropy=entropy,
                                            chunk_size=self.chunk_size)
        else:
            out = linear_logprobs(hidden, self.model.lm_head_weight, p.targets, temperature=self.temperature,
                                  return_entropy=entropy, chunk_size=self.chunk_size, tp_group=self.tp_group)
        lp, ent = out if entropy else (out, None)
        return ForwardOut(lp, ent, hidden if keep_hidden else None)

    @torch.no_grad()
    def compute_logprobs(self, rows: list[Row], mini_bs: int, *, model=None) -> list[list[float]]:
        """Response-token log-probs of ``rows`` under the current (or given) model, no gradient."""
        from areno.training.batch import per_row

        model_saved = self.model
        if model is not None:
            self.model = model
        try:
            out = []
            for i in range(0, len(rows), mini_bs):
                packed = pack(rows[i : i + mini_bs])
                lp = self.forward(packed, replay=model is None).logprobs  # the reference routes by itself
                out.extend(per_row(lp, packed))
            return out
        finally:
            self.model = model_saved

    # ---- updates -------------------------------------------------------------------------------------------
    def train(self, rows: list[Row], loss_fn, mini_bs: int, gradient_accumulation_steps: int,
              *, epochs: int = 1, entropy: bool = False, shuffle_seed: int | None = None, unit: int = 1) -> dict:
        """Run ``epochs`` passes of optimizer updates over ``rows`` (every rank passes the same global rows).

        ``loss_fn(out: ForwardOut, packed: Packed, norms: Norms) -> (loss, stats)`` returns this microbatch's share
        of the update's loss. ``unit`` rows stay together (2 for DPO's chosen/rejected pairs): ``mini_bs`` counts
        units. Returns summed stats, mean grad norm, lr and the number of updates.
        """
        units = [rows[i : i + unit] for i in range(0, len(rows), unit)]
        per_update = mini_bs * gradient_accumulation_steps * self.dp_size
        totals: dict[str, float] = {}
        grad_norms, lrs, group_lrs = [], [], {}
        for epoch in range(epochs):
            order = list(units)
            if shuffle_seed is not None and epochs > 1:
                g = torch.Generator().manual_seed(shuffle_seed + epoch)
                order = [order[i] for i in torch.randperm(len(order), generator=g).tolist()]
            for start in range(0, len(order), per_update):
                stats, gn, lr, group_lrs = self._update(order[start : start + per_update], loss_fn, mini_bs,
                                                        entropy)
                for k, v in stats.items():
                    totals[k] = totals.get(k, 0.0) + v
                grad_norms.append(gn)
                lrs.append(lr)
        totals["grad_norm"] = sum(grad_norms) / max(1, len(grad_norms))
        totals["lr"] = lrs[-1] if lrs else self.schedule.lr(self.num_updates)
        for name, s in self.group_schedules.items():
            totals[f"lr_{name}"] = group_lrs[name] if lrs else s.lr(self.num_updates)
        totals["num_updates"] = len(grad_norms)
        return totals if self.mtp is None else self.mtp.metrics(totals)

    def _update(self, group: list[list[Row]], loss_fn, mini_bs: int, entropy: bool):
        mine = group[self.dp_rank :: self.dp_size]
        all_rows = [r for u in group for r in u]
        n_tokens = sum(len(r.response_ids) for r in all_rows)
        norms = Norms(num_tokens=max(1.0, float(n_tokens)), num_seqs=float(max(1, len(all_rows))))
        micro = [[r for u in mine[i : i + mini_bs] for r in u] for i in range(0, len(mine), mini_bs)]
        packs = [pack(rows) for rows in micro]
        loss_fn = LossFn.of(loss_fn)
        weights_of = loss_fn.token_weights  # linear: graphed too
        function_of = loss_fn.token_loss  # a token function: eager microbatches
        if entropy or self.tp_group is not None or self.model.is_value_model or self.model.logit_softcap is not None:
            weights_of = function_of = None
        buckets, mode = self._plan(packs, entropy, weighted=weights_of is not None)
        stats: dict[str, float] = {}
        pending: list[tuple[str, torch.Tensor]] = []  # device scalars, read back once per update (no sync per
        for host, bucket in zip(packs, buckets):        # microbatch)
            packed = host.to(self.device)
            weights = None if weights_of is None else weights_of(packed, norms).float()
            if bucket is None:
                token_loss = function_of(packed, norms) if weights is None and function_of is not None else weights
                out = self.forward(packed, entropy=entropy, token_loss=token_loss, keep_hidden=self.mtp is not None)
            else:
                out = self.graphs.forward(packed, bucket, mode, weights)  # padded on the device, no host copy
            loss, s = loss_fn(out, packed, norms)
            loss.backward()
            if self.mtp is not None:  # the draft's loss on the target's detached hidden states: its own gradient
                s = {**s, **self.mtp.backward(out.hidden, packed, norms)}
            for k, v in [*s.items(), ("loss", loss)]:
                if torch.is_tensor(v):
                    pending.append((k, v.detach().float().reshape(())))
                else:
                    stats[k] = stats.get(k, 0.0) + float(v)
        lr = self.schedule.lr(self.num_updates)
        group_lrs = {name: s.lr(self.num_updates) for name, s in self.group_schedules.items()}
        device_norm = None
        if mode is not None and self.graphs.device_optimizer:  # queued without a host sync
            device_norm = self.graphs.optimizer_step(lr, group_lrs, mode, buckets[0])
        elif group_lrs:
            grad_norm = self.optimizer.step(lr=lr, grad_clip=self.grad_clip, group_lrs=group_lrs)
        else:
            grad_norm = self.optimizer.step(lr=lr, grad_clip=self.grad_clip)
        if self.mtp is not None:
            self.mtp.step(lr, self.grad_clip)
        reads = [v for _, v in pending] + ([device_norm] if device_norm is not None else [])
        if reads:  # the stats and the device norm read back together: one host sync per update
            values = _read_back(torch.stack([v.to(self.device, torch.float64) for v in reads]),
                                then=None if device_norm is None else lambda: self.graphs.optimizer_update(
                                    mode, buckets[0]))
            if device_norm is not None:
                grad_norm = values.pop()
                self.graphs.count_step(grad_norm)
            for (k, _), v in zip(pending, values):
                stats[k] = stats.get(k, 0.0) + v
        # ranks with fewer microbatches still joined the collectives inside the optimizer
        if self.dp_size > 1:
            keys = sorted(stats)
            summed = all_sum([stats[k] for k in keys], self.dp_group)
            stats = dict(zip(keys, summed))
        if self.model.has_routing_bias:
            # once per optimizer step, from this step's expert loads (a skipped step moves nothing); counters reset
            rate = self.router_bias_update_rate if math.isfinite(float(grad_norm)) else 0.0
            self.model.update_routing_bias(rate, self.dp_group)
        self.num_updates += 1
        return stats, float(grad_norm), lr, group_lrs

    def close(self) -> None:
        """Release the optimizers' state (disk offload files)."""
        self.optimizer.close()
        if self.mtp is not None:
            self.mtp.close()

    def _plan(self, packs: list[Packed], entropy: bool, weighted: bool = False):
        """Each microbatch's graph bucket (None: eager) and the update's gradient mode (None: all eager), with
        the update's graphs captured and its gradients zeroed (areno.training.graphs)."""
        self.optimizer.zero_grad()
        if self.mtp is not None:
            self.mtp.zero_grad()
        graphs = self.graphs if self.mtp is None else None  # the draft reads the eager forward's hidden states
        if graphs is None:
            return [None] * len(packs), None
        buckets = [graphs.bucket(p, entropy, routes=self.routing_replay and p.routed_experts is not None,
                                 weighted=weighted) for p in packs]
        if all(b is None for b in buckets):
            return buckets, None
        try:
            return buckets, graphs.begin_update(buckets, packs)
        except Exception as e:  # a capture that fails: "on" stops, "auto" trains eagerly from here on
            if self.graphs_required:
                raise
            log.warning("training CUDA graphs off (--train-cuda-graphs auto): capture failed: %s: %s",
                        type(e).__name__, e)
            graphs.close()
            self.graphs = None
            self.optimizer.zero_grad()
            return [None] * len(packs), None
