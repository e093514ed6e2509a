"""The rollout engine: requests in, token ids + log-probs out, by continuous batching over a paged KV cache.

One engine serves RL rollout (the synchronous :meth:`Engine.generate`), ``areno serve`` and agentic rollout (the
asyncio front end in ``async_engine.py``, which drives :meth:`Engine.step` from one thread). Model, KV cache and
CUDA graphs persist across calls until :meth:`Engine.drop_rollout_state`.

Hybrid models (recurrent layers, e.g. ``bailing_hybrid``) get a recurrent-state slot per running sequence
(``state_cache.py``); their prefix caching across requests is off (a cached prefix would need the state at its
end), while the n samples of a prompt still share its prefill (state copied at the fork). Chained decode steps and
the lookahead that queues the next chain early: ``decode_chain.py``.
``record_routing`` (sparse-MoE models, routing replay): each completion carries the expert ids every MoE layer chose
for each of its tokens (``Completion.routed_experts``); prefix caching across requests is then off too, so every
prompt token's routing comes from this request.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from areno.config import SamplingParams
from areno.config.rollout import spec_gate
from areno.engine.block_manager import BlockManager
from areno.engine.decode_chain import DecodeChains
from areno.engine.grammar import EngineGrammars, token_mask
from areno.engine.images import PromptImages
from areno.engine.kv_cache import cache_dtype, check_kv_cache_dtype, kv_groups, plan_num_blocks
from areno.engine.lora_slots import LoraSlots, slots_of
from areno.engine.model_runner import ModelRunner, TPWorker, broadcast_step
from areno.engine.scheduler import Scheduler, Step
from areno.engine.sequence import Sequence
from areno.engine.spec_decode import check_request, spec_budget, spec_decoder
from areno.engine.state_cache import state_dtype
from areno.engine.stopping import StopChecker

log = logging.getLogger("areno.engine")


@dataclass
class EngineConfig:
    block_size: int = 16
    max_running: int = 256  # --max-running-prompts: active sequences
    max_batched_tokens: int = 8192  # token budget of one mixed prefill/decode step
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    kv_cache_memory: float | None = None  # fraction of free GPU memory (<= 1) or bytes (> 1)
    eager_decode: bool = False
    prefix_caching: bool = True
    decode_progress_interval_s: float | None = None
    seed: int = 0
    decode_steps: int = 1  # generate(): decode steps per scheduling round when only decodes run (multi-step)
    # generate() with decode_steps > 1: queue the next k-step group before reading the current one's tokens, so the
    # host's stop checks and input packing run under the device's work (see Engine.step). None: on a CUDA device
    # (on the CPU the groups run one after the other anyway: it would only add the dropped tokens' work)
    lookahead: bool | None = None
    record_routing: bool = False  # sparse-MoE models: completions carry their tokens' expert ids (routing replay)
    max_loras: int = 0  # > 0: that many LoRA adapter slots (areno.engine.lora_slots); requests pick one by name
    max_lora_rank: int = 16
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype: the paged cache in the model's dtype, or fp8 (E4M3 + scales)
    # --mamba-ssm-cache-dtype: the hybrids' delta-rule state pool, float32 (the trainer's precision) or bfloat16
    # (half the bytes; fp32 math, stored rounded); bfloat16 is refused for a model without recurrent layers
    mamba_ssm_cache_dtype: str = "auto"
    speculative_tokens: int = 0  # > 0: MTP speculative decoding with up to that many draft tokens (spec_decode.py)
    # the gate (spec_gate.py): speculate while at most N sequences decode in a step; "auto" (None too): N from the
    # device's roofline; 0 or "off": never gated
    speculative_disable_by_batch_size: str | int | None = "auto"

    def __post_init__(self):
        for name in ("block_size", "max_running", "max_batched_tokens", "decode_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.speculative_tokens < 0:
            raise ValueError(f"--speculative-tokens must be >= 0, got {self.speculative_tokens}")
        self.speculative_disable_by_batch_size = spec_gate(self.speculative_disable_by_batch_size)


@dataclass
class Completion:
    """One sample's result."""

    request_id: object
    index: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str | None = None
    stop_text: str | None = None
    timings: dict = field(default_factory=dict)
    # record_routing: int16 [prompt + output tokens, num_moe_layers, k] expert ids per token (-1: not computed, the
    # last output token), else None
    routed_experts: np.ndarray | None = None
    versions: list[int] | None = None  # partial rollout: the policy version that sampled each output token


class Engine:
    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None, *, eos_token_ids=None):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        cfg = self.config
        model_max = model.config.max_position_embeddings
        self.max_model_len = cfg.max_model_len or model_max
        if eos_token_ids is None:
            eos_token_ids = tokenizer_eos_ids(tokenizer)
        self.stopper = StopChecker(tokenizer, eos_token_ids, self.max_model_len)
        self._rng = random.Random(cfg.seed)
        self.grammars = EngineGrammars(self)  # structured outputs: compiled grammars, matchers, compiles off the loop
        self.runner = None
        # LoRA serving: the adapter slots (built once: they outlive drop_rollout_state); load with lora_slots.load
        self.lora = LoraSlots(model, cfg.max_loras, cfg.max_lora_rank) if cfg.max_loras else None
        self._build()
        self._progress_t = time.perf_counter()
        self._progress_tokens = 0
        self._hold_waiting = False  # the last step admitted while requests waited: the next one may decode k steps
        # forward steps run one at a time / inside k-step chains / of those, queued by the lookahead behind a chain in
        # flight (the host's turn hidden behind the device's work)
        self.step_counts = {"single": 0, "chained": 0, "ahead": 0}
        self.chains = DecodeChains(self)  # k-step decode groups and the lookahead's queued one

    def _build(self):
        cfg = self.config
        device, dtype = next(self.model.parameters()).device, next(self.model.parameters()).dtype
        check_kv_cache_dtype(self.model, cfg.kv_cache_dtype)
        kv_dtype, sd = cache_dtype(cfg.kv_cache_dtype, dtype), state_dtype(self.model, cfg.mamba_ssm_cache_dtype)
        self.spec_budget = getattr(self, "spec_budget", None) or spec_budget(self, device, dtype, sd)  # kept: rebuilds
        num_blocks = plan_num_blocks(
            self.model, block_size=cfg.block_size, dtype=dtype, device=device, kv_cache_memory=cfg.kv_cache_memory,
            max_running=cfg.max_running, max_model_len=self.max_model_len, kv_dtype=kv_dtype, state_dtype=sd,
            extra_layers=int(cfg.speculative_tokens > 0), reserved=self.spec_budget.reserved if self.spec_budget else 0)
        hybrid = self.model.is_hybrid
        record = cfg.record_routing and self.model.is_moe
        if cfg.prefix_caching and (hybrid or record):
            log.info("prefix caching across requests is off: %s", "the model has recurrent state" if hybrid else
                     "routing is recorded for replay")
        self.blocks = BlockManager(num_blocks, cfg.block_size, prefix_caching=cfg.prefix_caching and not (
            hybrid or record), state_slots=cfg.max_running if hybrid else 0,
            windows=[g.window for g in kv_groups(self.model, self.max_model_len)])
        self.scheduler = Scheduler(
            self.blocks, max_running=cfg.max_running, max_batched_tokens=cfg.max_batched_tokens,
            max_model_len=self.max_model_len,
        )
        self.runner = ModelRunner(
            self.model, num_blocks=num_blocks, block_size=cfg.block_size, max_model_len=self.max_model_len,
            max_running=cfg.max_running, eager=cfg.eager_decode, device=device, eos_token_ids=self.stopper.eos,
            record_routing=record, lora=self.lora, kv_dtype=kv_dtype, state_dtype=sd,
        )
        self.spec = spec_decoder(self)  # a SpecDecoder with --speculative-tokens, else None

    # ---- session state -------------------------------------------------------------------------------------
    def rng_state(self):
        """The generator that draws a seed for each request that gives none (saved in checkpoints: exact resume)."""
        return self._rng.getstate()

    def set_rng_state(self, state) -> None:
        version, internal, gauss = state
        self._rng.setstate((version, tuple(internal), gauss))

    def reset_prefix_cache(self) -> None:
        """The model's weights changed: cached prefixes hold stale K/V (an RL step, a policy sync)."""
        if self.runner is not None:
            self.blocks.reset_prefix_cache()

    def drop_rollout_state(self) -> None:
        """Free the KV cache and CUDA graphs; the next request rebuilds them."""
        if self.has_work():
            raise RuntimeError("drop_rollout_state() while requests are in flight")
        self.runner.release()
        self.runner = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def close(self) -> None:
        """Release the TP followers (they leave their loop); call once, on rank 0, when the session ends."""
        group = self.model.tp_group
        if group is not None and self.tp_rank == 0:
            broadcast_step(None, group)

    def follow(self) -> None:
        """A non-zero TP rank of a long-lived session (the server): execute rank 0's steps until it closes."""
        self._ensure_built()
        TPWorker(self.runner).loop()

    def _ensure_built(self):
        if self.runner is None:
            self._build()

    def capture_graphs(self, decode_steps=(1,)) -> int:
        """Capture graphs now, not on first use: ``ModelRunner.capture_graphs``, ``SpecDecoder``'s with speculation."""
        self._ensure_built()
        if self.model.tp_group is not None:
            return 0
        return self.spec.capture_graphs() if self.spec is not None else self.runner.capture_graphs(decode_steps)

    def warm_up(self, *, on_cpu: bool = False) -> dict:
        """Compile and autotune what eager steps run before the first request does (a server calls this at start):
        every paged-attention variant of the caches, then one prefill per attention sequence bucket (64 tokens up to
        the step's token budget; odd lengths, so integer specialisations are compiled too) with a second request
        arriving while the first decodes (a mixed step). The prefix cache is emptied after. Nothing under tensor
        parallelism (the ranks would have to step together), nor off the GPU unless ``on_cpu`` (nothing compiles
        there). Seeded requests: the engine's own seed stream is untouched. Returns {"variants": n, "prefills": m}."""
        self._ensure_built()
        if self.model.tp_group is not None or (self.runner.device.type != "cuda" and not on_cpu):
            return {"variants": 0, "prefills": 0}
        variants = self.runner.warm_kernels()
        vocab = self.runner.vocab_size
        opts = SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True, seed=0)
        limit, n, prefills = min(self.max_model_len - opts.max_new_tokens, self.config.max_batched_tokens), 64, 0
        while n <= limit:
            self.add_request([(7 * j + n) % vocab for j in range(n - 1)], opts)
            self.step()
            self.add_request([(5 * j + n + 1) % vocab for j in range(n // 2 + 1)], opts)
            while self.has_work():
                self.step()
            prefills += 2
            n *= 2
        self.reset_prefix_cache()
        return {"variants": variants, "prefills": prefills}

    # ---- requests ------------------------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int] | None, options: SamplingParams | None = None, request_id=None, *,
                    mm=None):  # fmt: skip
        """Queue one prompt for ``options.n`` samples; returns the samples' Sequence objects.

        ``mm``: the prompt's images, a ``MultimodalPrompt`` (``areno.models.multimodal``) or any object with its
        ``input_ids``, ``pixel_values`` and ``image_grid_thw`` (``image_hashes``, ``positions``, ``rope_delta``
        are computed when absent); ``prompt_ids`` then equals ``mm.input_ids`` or is None. A ``ValueError`` when
        the model takes no images or the placeholders do not match the images."""
        self._ensure_built()
        if prompt_ids is None:
            if mm is None:
                raise ValueError("add_request needs prompt_ids or mm")
            prompt_ids = list(mm.input_ids)
        images = PromptImages.from_prompt(mm, prompt_ids, self.model) if mm is not None else None
        options = options or SamplingParams()
        check_request(self.spec, options)
        if options.logit_bias and max(options.logit_bias) >= self.runner.vocab_size:
            raise ValueError(f"logit_bias token ids must be in [0, {self.runner.vocab_size})")
        if options.lora is not None:
            slots_of(self, options.lora).slot_of(options.lora)  # an unknown adapter is refused before any work
        base = options.seed if options.seed is not None else self._rng.getrandbits(62)
        group = [
            Sequence(list(prompt_ids), options, request_id=request_id, sample_index=i,
                     seed=(base * 1_000_003 + i) % (2**62))
            for i in range(options.n)
        ]
        if images is not None:
            for seq in group:
                seq.mm = images
        if options.lora is not None:
            self.lora.attach(group, options.lora)
        if options.grammar is not None and not self.grammars.attach(group, options):
            return group  # it waits for its grammar's compile (EngineGrammars.admit)
        self.scheduler.add(group)
        return group

    def abort(self, seqs) -> None:
        for seq in seqs:
            if not seq.is_finished and not self.grammars.abort(seq):
                self.scheduler.abort(seq)

    def has_work(self) -> bool:
        return self.chains.ahead is not None or self.scheduler.has_work() or bool(self.grammars.waiting)

    def step(self, decode_steps: int = 1) -> list[Sequence]:
        """One forward step; returns the sequences that received a token (finished ones included).

        ``decode_steps`` k > 1: when the step only decodes and no waiting request fits (``Scheduler.can_admit``), run
        k decode steps in one go and give each sequence up to k tokens (``decode_chain.py``, with the lookahead that
        queues the next group before the host reads this one).

        Requests that arrive while sequences decode (agent turns, a stream of clients) would otherwise hold every step
        to one token: after a step that admitted with requests waiting, the next step leaves the few that arrived since
        (at most a quarter of the running count: many arrivals are worth admitting at once) waiting and decodes k
        tokens, so waiting costs at most one k-step group and steady arrivals still let chained steps run."""
        if self.spec is not None:
            return self.spec.step()
        if self.chains.ahead is not None:
            return self.chains.step_ahead()
        if self.grammars.waiting and (failed := self.grammars.admit()):
            return failed  # their compile failed: finished
        running, waiting = len(self.scheduler.running), len(self.scheduler.waiting)
        hold = decode_steps > 1 and self._hold_waiting and 0 < 4 * waiting <= running
        waited = bool(self.scheduler.waiting)
        step = self.scheduler.schedule(admit=not hold)
        self._hold_waiting = False
        if not step.chunks:
            return []
        copies, state_copies = list(self.blocks.pending_copies), list(self.blocks.pending_state_copies)
        self.blocks.pending_copies.clear()
        self.blocks.pending_state_copies.clear()
        rows, row_index, offset = [], [], 0
        for chunk in step.chunks:
            offset += chunk.end - chunk.start
            if chunk.samples:
                for seq in [chunk.seq] + [c for c in getattr(chunk.seq, "children", []) if not c.is_finished]:
                    rows.append(seq)
                    row_index.append(offset - 1)
        if decode_steps > 1 and self.chains.reserve(step, rows, decode_steps, hold):
            return self.chains.run(step, rows, decode_steps, copies, state_copies)
        self._hold_waiting = waited and not hold  # a held step is followed by an admitting one
        mask = token_mask([s.grammar for s in rows]) if self.grammars.cache is not None else None
        self.step_counts["single"] += 1
        tokens, logprobs, top = self.runner.run(step, rows, row_index, copies, token_mask=mask,
                                                state_copies=state_copies)
        self.keep_routing(step)
        self.scheduler.after_step(step)
        tokens, logprobs = tokens.cpu().tolist(), logprobs.cpu().tolist()  # .cpu() waits without the GIL
        for i, seq in enumerate(rows):
            seq.append(tokens[i], logprobs[i])
            if top is not None and seq.options.top_logprobs:
                k = seq.options.top_logprobs
                seq.top_logprobs.append(list(zip(top[0][i, :k].tolist(), top[1][i, :k].tolist())))
            reason = self.stopper.check(seq)
            if seq.grammar is not None:
                reason = _grammar_reason(seq, tokens[i], reason)
            if reason is not None:
                seq.finish(reason)
                self.scheduler.finish(seq)
        self.note_progress(len(rows))
        return rows

    def keep_routing(self, step: Step) -> None:
        """Routing capture: each chunk's sequence keeps the expert ids of the tokens the step computed for it;
        samples not yet forked from a head that finished its prompt take the prompt's."""
        r = self.runner.last_routing
        if r is None:
            return
        if r.dim() == 3:  # [layers, T, k] over the step's tokens, chunk after chunk
            r, off = r.permute(1, 0, 2).to(torch.int16).numpy(), 0
            for c in step.chunks:
                c.seq.routing.append((c.start, r[off : off + c.end - c.start]))
                off += c.end - c.start
        else:  # decode: [steps, layers, rows, k], row i = chunk i, positions start, start + 1, ...
            r = r.permute(2, 0, 1, 3).to(torch.int16).numpy()
            for i, c in enumerate(step.chunks):
                c.seq.routing.append((c.start, r[i]))
        for c in step.chunks:
            if c.samples:
                for child in getattr(c.seq, "children", []):
                    child.routing = list(c.seq.routing)

    def note_progress(self, n_tokens: int) -> None:
        """Count decoded tokens; log the rate every ``decode_progress_interval_s``."""
        interval = self.config.decode_progress_interval_s
        self._progress_tokens += n_tokens
        if not interval:
            return
        now = time.perf_counter()
        if now - self._progress_t >= interval:
            rate = self._progress_tokens / (now - self._progress_t)
            log.info(
                "decode: %.1f tok/s, %d active sequences, %d waiting, cuda graph replay: %s, kv blocks used %d/%d",
                rate, len(self.scheduler.running), len(self.scheduler.waiting), self.runner.last_step_used_graph,
                self.blocks.num_used, self.blocks.num_blocks,
            )
            self._progress_t, self._progress_tokens = now, 0

    # ---- synchronous API (RL rollout) ----------------------------------------------------------------------
    @property
    def tp_rank(self) -> int:
        group = self.model.tp_group
        return dist.get_rank(group) if group is not None else 0

    def generate(self, prompts: list, options=None, *, on_finished=None) -> list[list[Completion]]:
        """Generate for every prompt (``options``: one SamplingParams or one per prompt); blocks until done.

        A prompt is a list of token ids, or a prompt with images (a ``MultimodalPrompt``: anything with
        ``input_ids``, see :meth:`add_request`).

        ``on_finished(i, completions)``: called (on this thread, between steps: keep it short) as soon as every
        sample of prompt ``i`` has finished, while the other prompts still decode; each prompt once, in the order
        they finish. The returned lists hold the same Completion objects.

        Under tensor parallelism every rank of the TP group calls this: rank 0 schedules and runs the steps, the
        others execute the steps it broadcasts, and all return rank 0's results.
        """
        group = self.model.tp_group
        if group is not None and self.tp_rank != 0:
            self._ensure_built()
            TPWorker(self.runner).loop()
            box = [None]
            dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
            return box[0]
        if options is None or isinstance(options, SamplingParams):
            options = [options or SamplingParams()] * len(prompts)
        groups = [self.add_request(None, o, request_id=i, mm=p) if hasattr(p, "input_ids") else
                  self.add_request(p, o, request_id=i) for i, (p, o) in enumerate(zip(prompts, options))]  # fmt: skip
        done: dict[int, list[Completion]] = {}
        with self.chains.on(self.config.decode_steps):
            while self.has_work():
                rows = self.step(self.config.decode_steps)
                if on_finished is not None:
                    for i in sorted({s.request_id for s in rows if s.is_finished} - done.keys()):
                        if all(s.is_finished for s in groups[i]):
                            done[i] = [self.completion(s) for s in groups[i]]
                            on_finished(i, done[i])
        out = [done.get(i) or [self.completion(s) for s in g] for i, g in enumerate(groups)]
        if on_finished is not None:
            for i in range(len(groups)):
                if i not in done:  # e.g. finished without a step of its own
                    on_finished(i, out[i])
        if group is not None:
            broadcast_step(None, group)  # the followers leave their loop
            dist.broadcast_object_list([out], src=dist.get_global_rank(group, 0), group=group)
        return out

    def completion(self, seq: Sequence) -> Completion:
        text = seq.text if seq.stop_text is not None else None
        return Completion(
            request_id=seq.request_id, index=seq.sample_index, prompt_ids=seq.tokens[: seq.prompt_len],
            token_ids=seq.output_ids, logprobs=list(seq.logprobs), finish_reason=seq.finish_reason or "abort",
            text=text, stop_text=seq.stop_text, timings=seq.timings(), routed_experts=_routed_experts(seq),
        )


def swap_weights(engine: Engine, load, *, recompute: bool = False) -> None:
    """Partial rollout (areno.rl.rollout.partial): ``engine`` takes new weights between two steps while sequences are
    in flight. The decode group queued ahead is read first (its tokens are the old weights'), then ``load()`` copies
    the new weights in place (the CUDA graphs keep their pointers), the prefix cache is dropped and, with
    ``recompute``, every running sequence goes back to the queue to have its K/V computed again under the new weights
    (its tokens are kept); else their K/V, computed under the old weights, stay."""
    engine.chains.drain()
    load()
    if recompute and engine.runner is not None:
        for seq in list(reversed(engine.scheduler.running)):  # youngest first: the oldest ends up first in line
            engine.scheduler._preempt(seq, Step())
    engine.reset_prefix_cache()  # after the preemptions: their freed blocks hold the old weights' K/V too


def _routed_experts(seq: Sequence) -> np.ndarray | None:
    """The recorded routing of every token of ``seq`` (later pieces win: a preempted sequence is recomputed)."""
    if not seq.routing:
        return None
    out = np.full((len(seq.tokens), *seq.routing[0][1].shape[1:]), -1, dtype=np.int16)
    for start, r in seq.routing:
        end = min(start + len(r), len(out))
        out[start:end] = r[: end - start]
    out[-1] = -1  # the last output token is no step's input (a k-step chain may have run it; the tokens after it
    return out    # were dropped): -1 whatever the decode mode


def _grammar_reason(seq: Sequence, token: int, reason: str | None) -> str | None:
    """Advance the sequence's grammar by its new token: the stop token after a whole output finishes it ("stop",
    also under ignore_eos); a token the grammar refuses (no allowed token was left to sample) aborts it."""
    if not seq.grammar.accept(token):
        log.warning("request %s: token %d is outside its grammar; the sample is aborted", seq.request_id, token)
        return "abort"
    return "stop" if seq.grammar.finished else reason


def tokenizer_eos_ids(tokenizer) -> list[int]:
    """The tokenizer's EOS id (the engine's stop ids when none are given; ``engine.build.eos_token_ids`` adds the
    checkpoint's generation_config/config ids)."""
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    return [] if eos is None else [eos]
