"""Colocated rollout: the engine lives in the trainer's process and decodes with the very parameter tensors the
optimizer updates in place, so a new policy costs no copy. One of the two implementations of the ``Rollout``
protocol (protocol.py; ``remote`` is the other). With --rollout-dtype fp8 the engine decodes with FP8 copies of the
linear weights (models/fp8_rollout.py), quantised again in place before the first rollout after each optimizer step.
With --mtp-loss-weight the trainer writes the MTP layers' kept tensors after each update; the engine's draft (a copy,
--speculative-tokens) reloads them before the first rollout after it (``reload_draft``).
"""

from __future__ import annotations

import contextlib
import gc
import sys

from areno.distributed.collectives import gather_objects


def engine_config(cfg, model, tokenizer, dp_rank: int = 0, *, record_routing: bool = False):
    """The rollout engine's settings for a TrainConfig (the same in both modes) and its EOS ids, through
    ``areno.engine.build`` (serve's path too); ``record_routing``: the completions carry their routes (routing
    replay)."""
    from areno.engine import build

    econf = build.engine_config(
        model, max_running=cfg.max_running_prompts or max(1, cfg.batch_size * cfg.n_samples),
        max_model_len=cfg.max_prompt_tokens + cfg.max_new_tokens, eager_decode=cfg.eager_decode,
        decode_steps=cfg.decode_steps, seed=cfg.seed + 7919 * dp_rank,
        kv_cache_memory=cfg.kv_cache_memory if cfg.kv_cache_memory is not None else 0.3,
        decode_progress_interval_s=cfg.decode_progress_interval_s or None, record_routing=record_routing,
        kv_cache_dtype=cfg.kv_cache_dtype, mamba_ssm_cache_dtype=cfg.mamba_ssm_cache_dtype,
        speculative_tokens=cfg.speculative_tokens,
        speculative_disable_by_batch_size=cfg.speculative_disable_by_batch_size,
    )
    return econf, build.eos_token_ids(cfg.ckpt, tokenizer)


def reload_draft(engine) -> None:
    """With --speculative-tokens: the engine's MTP draft reloads the model's kept MTP tensors (trained by
    --mtp-loss-weight, or replaced by a resume or a sync)."""
    spec = getattr(engine, "spec", None)
    if spec is not None:
        spec.draft.load_kept(engine.model)


class ColocatedRollout:
    """The ``Rollout`` of one process: an ``Engine`` over the trainer's own ``model``; ``optimizer.num_steps`` says
    whether the weights moved since the last rollout. ``dp_rank``/``dp_size``/``dp_group``: this rank's share."""

    def __init__(self, model, tokenizer, optimizer, cfg, *, dp_rank=0, dp_size=1, dp_group=None,
                 record_routing=False):
        from areno.engine.engine import Engine

        self.model, self.optimizer = model, optimizer
        self.dp_rank, self.dp_size, self.dp_group = dp_rank, dp_size, dp_group
        self.decode_steps = cfg.decode_steps
        econf, eos = engine_config(cfg, model, tokenizer, dp_rank, record_routing=record_routing)
        self.engine = Engine(model, tokenizer, econf, eos_token_ids=eos)
        self.fp8 = cfg.rollout_dtype == "fp8"
        self.mtp_trains = cfg.mtp_loss_weight > 0  # the trainer writes the MTP layers: the engine's draft reloads
        if self.fp8:
            from areno.models import fp8_rollout

            fp8_rollout.quantize(model)
        self._version = self._policy_version()

    def _policy_version(self) -> int:
        return self.optimizer.num_steps

    def refresh(self) -> None:
        """Before sampling: if the optimizer moved the weights since the last rollout, the prefix cache's K/V were
        computed by an older policy and are dropped (the weights themselves are shared: nothing to copy but the FP8
        copies, quantised again)."""
        version = self._policy_version()
        if version != self._version:
            self.engine.reset_prefix_cache()
            self._version = version
            if self.fp8:
                self._requantize()
            if self.mtp_trains:
                reload_draft(self.engine)

    def _requantize(self) -> None:
        from areno.models import fp8_rollout

        fp8_rollout.quantize(self.model)

    def _forward(self):
        """The engine's forward for the length of the block: the FP8 copies with --rollout-dtype fp8."""
        from areno.models.fp8_rollout import fp8_forward

        return fp8_forward(self.model, self.fp8)

    def share(self, rows: list) -> list:
        """This rank's part of a rollout batch (its data-parallel slice)."""
        return rows[self.dp_rank :: self.dp_size]

    def gather(self, obj) -> list:
        """Every data-parallel rank's ``obj``, on every rank."""
        return gather_objects(obj, self.dp_group)

    def generate(self, prompt_ids, options, *, on_finished=None):
        self.refresh()
        model = self.model
        model.eval()
        try:
            with self._forward():
                return self.engine.generate(prompt_ids, options, on_finished=on_finished)
        finally:
            model.train()

    def rollout(self, prompt_ids, options, upcoming=None, *, on_group=None, keys=None):
        """This step's completions and the rollout's own stats (with --speculative-tokens: ``spec_accept_len``,
        ``spec_gated_steps`` and the gate's ``spec_limit`` of this rollout; nothing else, the weights are the
        trainer's). ``on_group(i, completions)``: called as soon as every sample of prompt ``i`` has finished, while
        the others still decode (``Engine.generate``'s ``on_finished``)."""
        out = self.generate(prompt_ids, options, on_finished=on_group)
        return out, ({} if self.engine.spec is None else self.engine.spec.take_stats())

    def sync(self) -> dict:
        return {}  # the engine decodes with the trainer's own tensors

    @contextlib.contextmanager
    def token_sampler(self):
        """The agents' token-level sampling for the length of the block: an ``AsyncEngine`` over this engine (the
        model in eval mode); yields a factory of ``LocalTokens`` clients."""
        from areno.engine.async_engine import AsyncEngine

        self.refresh()  # stale prefixes from the previous policy go
        self.model.eval()
        async_engine = AsyncEngine(self.engine, decode_steps=self.decode_steps)
        # the engine thread and the agents' event loop share the GIL: with the default 5 ms switch interval a
        # turn boundary's hundreds of resubmissions queue behind engine steps 5 ms at a time
        # and no cyclic-GC pass during the rollout: a full collection over its many small objects stalls both
        interval, collecting = sys.getswitchinterval(), gc.isenabled()
        sys.setswitchinterval(min(interval, 0.0005))
        gc.disable()
        try:
            with self._forward():
                yield lambda: LocalTokens(async_engine)
        finally:
            sys.setswitchinterval(interval)
            if collecting:
                gc.enable()
            async_engine.shutdown(drain=False)
            self.model.train()

    def rng_state(self):
        return self.engine.rng_state()

    def set_rng_state(self, state) -> None:
        self.engine.set_rng_state(state)

    def policy_changed(self) -> None:
        if self.fp8:  # the trainer's weights were replaced (a resume)
            self._requantize()
        reload_draft(self.engine)

    def in_flight_count(self) -> int:
        return 0

    def in_flight_state(self) -> None:
        return None  # nothing is ever sampled ahead of its step here

    def restore_in_flight(self, state) -> None:
        pass

    def drop_rollout_state(self) -> None:
        self.engine.drop_rollout_state()

    def close(self) -> None:
        pass


class LocalTokens:
    """Token-level sampling on the colocated ``AsyncEngine`` (the same calls as ``RemoteTokens``)."""

    def __init__(self, async_engine):
        self.async_engine = async_engine

    async def sample(self, prompt_ids, options, key) -> dict:
        from areno.engine.token_service import sample_local

        return await sample_local(self.async_engine, prompt_ids, options)

    async def aclose(self) -> None:
        pass
