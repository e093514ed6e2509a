"""Split-mode rollout: engines on their own ranks (``--rollout-devices``), the policy streamed to them after each
optimizer step (``policy_sync``), prompts sent and completions returned over torch.distributed.

Train side (``RemoteRollout``, the loop's rollout interface): train rank 0 sends every command over the ``control``
group (itself and every rollout rank, in one order): ``sync`` (then the policy buckets follow on the publish groups),
``generate`` (each engine its share of the prompts, least loaded first; each prompt carries the seed the colocated
engine would have drawn for it, so the samples do not depend on how prompts are spread over engines) and ``stop``.
The completions come back to rank 0 by a gather on the same group and are broadcast to the other train ranks.

Rollout side (``serve``): each rollout rank loads the policy, builds the same engine as colocated mode (KV cache,
CUDA graphs, prefix sharing, its TP workers on the engine group) and executes commands until ``stop``. In a LoRA run
it attaches the same adapter to the same base (``--ckpt``, ``--lora-path``), applied unmerged as the trainer applies
it, and each sync streams only the adapter; a base the SFT warm-up trained is streamed once, with the next sync.
With --mtp-loss-weight each sync also streams the MTP layers' kept tensors, and the engine's draft reloads them.

With ``--max-staleness 1`` the rollout of the next step is sent before this step trains and collected at the next
step: it was sampled with the policy one step older than the one it trains (rows record the policy version), and
the truncated importance sampling against the rollout log-probs corrects for it. With 0 every rollout waits for the
new policy and the run equals a colocated one.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import random
import time

import torch
import torch.distributed as dist

from areno.config.env import env_value
from areno.distributed.collectives import broadcast_object
from areno.distributed.watchdog import watch_ranks
from areno.engine.build import device_and_dtype
from areno.models import fp8_rollout
from areno.models.lora import adapter_of
from areno.rl.rollout.colocated import reload_draft
from areno.rl.rollout.partial import PartialRollout
from areno.rl.rollout.policy_sync import PolicyPublisher, PolicyReceiver, synced_tensors

log = logging.getLogger("areno.engine")
VERIFY_ENV = "ARENO_VERIFY_POLICY_SYNC"  # 1: after every sync, fetch the engines' weights and compare them exactly


def _shares(n: int, engines: int) -> list[range]:
    """Contiguous, near-equal shares of ``n`` prompts (the first engines take the remainder)."""
    base, extra = divmod(n, engines)
    out, start = [], 0
    for i in range(engines):
        size = base + (i < extra)
        out.append(range(start, start + size))
        start += size
    return out


def _plain(c) -> dict:
    """A Completion as plain values a checkpoint loads with ``weights_only`` (arrays as tensors)."""
    d = dataclasses.asdict(c)
    if d.get("routed_experts") is not None:
        d["routed_experts"] = torch.from_numpy(d["routed_experts"])
    return d


def _unplain(d: dict) -> dict:
    if d.get("routed_experts") is not None:
        d = {**d, "routed_experts": d["routed_experts"].numpy()}
    return d


class RemoteRollout:
    """The ``Rollout`` of split mode (train ranks' side): ``model`` and ``optimizer`` are the trainer's (the
    optimizer's ``num_steps`` says whether the policy moved), ``step_index()`` the loop's step count (the policy
    version the completions are tagged with)."""

    def __init__(self, model, optimizer, cfg, layout, *, step_index):
        self.model, self.optimizer, self.layout, self.step_index = model, optimizer, layout, step_index
        self.drop_state = cfg.drop_rollout_state
        self.rank0 = dist.get_rank() == 0
        self._rng = random.Random(cfg.seed)  # the seeds the colocated engine (DP rank 0) would draw
        self.fp8 = cfg.rollout_dtype == "fp8"  # the stream carries the FP8 copies of the linear weights
        self.publisher = PolicyPublisher(model, layout, int(cfg.policy_sync_bucket_mb * 2**20), fp8=self.fp8)
        self.synced = optimizer.num_steps  # the engines hold the checkpoint the trainer started from
        self.version = step_index()
        self._plan_sent = None  # the plan the engines hold: False (trainable tensors), True (every tensor)
        self._full_next = False  # after a resume the first sync streams the frozen tensors too
        self._base_sent = False  # LoRA: a base the warm-up trained has reached the engines
        self.partial = cfg.partial_rollout
        self._pending = collections.deque()  # rank 0: (tag, policy version) of each command the engines answer later
        self._done = {}  # rank 0: tag -> (version, results, idle stats, keys) collected before its step took it
        self._ahead = 0  # async: how many of the next steps' batches are already on the engines (every train rank)
        self._cut = 0  # partial rollout: prompt groups cut into a later batch so far (--max-tail-steps)
        self._sync_stats: dict = {}
        self.background: list = []  # rank 0: waits for work that reaches the engines from another thread (agents sent
        # ahead, areno.rl.agentic.ahead), run before any command of this thread

    # ---- the loop's interface ------------------------------------------------------------------------------
    def share(self, rows: list) -> list:
        """Train rank 0 sends every prompt; the other train ranks get its completions through ``gather``."""
        return list(rows) if self.rank0 else []

    def gather(self, obj) -> list:
        return [broadcast_object(obj, self.layout.train_group)]

    def policy_changed(self) -> None:
        """The trainer's weights were replaced (a resume): the next rollout syncs whatever the optimizer says, every
        tensor, frozen ones included."""
        self.synced = None
        self._full_next = True

    def generate(self, prompt_ids, options, *, on_finished=None):
        """Completions for rank 0's ``prompt_ids`` with the current policy (the sync of this step's weights first),
        on every train rank (evaluation). ``options``: one SamplingParams, each prompt then seeded from the training
        stream unless it names a seed; or one per prompt, each with its own seed (an evaluation set: the stream is
        not drawn from). Seeded options leave the engines as they found them (their prefix cache dropped again), so
        an evaluation changes no later rollout. ``on_finished(i, completions)``: called for every prompt once the
        completions are back. ``policy_version`` then names the policy they were sampled with."""
        self.sync()
        results = None
        if self.rank0:
            self._collect_all()  # the batches in flight finish first (every command runs in order)
            if isinstance(options, list) or options.seed is not None:
                opts = options if isinstance(options, list) else [options] * len(prompt_ids)
                self._generate([None], [prompt_ids], None, per_prompt=opts)
            else:
                self._dispatch(None, prompt_ids, options)
            results = self._collect()
        results = broadcast_object(results, self.layout.train_group)
        for i, group in enumerate(results if on_finished is not None else []):
            on_finished(i, group)
        return results

    @property
    def policy_version(self) -> int:
        """The policy version the engines hold (the step count at their last sync)."""
        return self.version

    def rollout(self, prompt_ids, options, upcoming=None, *, on_group=None, keys=None):
        """This step's completions (rank 0) and the split-mode stats; ``upcoming`` (async: the batches of the steps
        to send ahead, oldest first) are sent before returning, to run while this step trains. Every train rank calls
        it. ``on_group`` is never called: the completions arrive together. ``keys`` (partial rollout): each prompt's
        key, and each upcoming batch's; the stats then name the key of each group returned (``delivered``: groups
        cut from an earlier batch come with a later one)."""
        keys = keys or {}
        stats, tag = {}, self.step_index()
        if self._ahead:  # an earlier step sent this step's prompts (every train rank knows)
            self._ahead -= 1
        else:
            stats.update(self.sync())
            if self.rank0:
                self._dispatch(tag, prompt_ids, options, keys.get("batch"))
        version, results, idle, delivered = self._take(tag) if self.rank0 else (self.version, [], {}, None)
        stats.update(idle)
        upcoming = list(upcoming or [])
        if upcoming or (self.partial and self._ahead):
            stats.update(self.sync())
            if self.rank0:
                self._send_ahead(tag + 1 + self._ahead, upcoming, options, keys.get("upcoming"))
            self._ahead += len(upcoming)
        stats.update(self._sync_stats)
        self._sync_stats = {}
        if delivered is not None:
            stats["delivered"] = delivered
        if self.partial and results:  # per sample: its oldest token's version
            lags = [tag - min(c.versions or [version]) for group in results for c in group]
            stats.update(policy_version=tag - max(lags), staleness_mean=sum(lags) / len(lags),
                         staleness_max=max(lags), tail_cut=self._cut)
        else:
            staleness = tag - version
            stats.update(policy_version=version, staleness_mean=staleness, staleness_max=staleness)
        return results, stats

    def _send_ahead(self, tag, upcoming, options, keys) -> None:
        """Rank 0: the upcoming batches (tags ``tag``, ``tag + 1``, ...) go to the engines; with partial rollout one
        command adds them and runs the engines until the next step's batch is done (unless already held)."""
        if not self.partial:
            self._generate(list(range(tag, tag + len(upcoming))), upcoming, options)
            return
        add = [(tag + i, prompts, ks) for i, (prompts, ks) in enumerate(zip(upcoming, keys or [None] * len(upcoming)))]
        nxt = self.step_index() + 1
        until = nxt if (self._ahead or upcoming) and nxt not in self._done else None
        self._partial_command(add, options, until)

    def sync(self) -> dict:
        """Stream the policy if the optimizer moved since the last sync (every train rank takes part)."""
        now = self.optimizer.num_steps
        adapter = adapter_of(self.model)
        base_moved = adapter is not None and adapter.base_changed and not self._base_sent  # the warm-up's base
        if now == self.synced and not base_moved:
            return {}
        full = self._full_next or base_moved
        self._base_sent = self._base_sent or (full and adapter is not None and adapter.base_changed)
        if self.rank0:
            self._collect_all()  # commands are executed in order: the rollouts in flight are collected first
            plan = None if self._plan_sent is full else self.publisher.plans[full][:2]
            self._command({"op": "sync", "plan": plan, "version": self.step_index()})
            self._plan_sent = full
        nbytes, seconds = self.publisher.publish(full)
        self._full_next = False
        self.synced, self.version = now, self.step_index()
        stats = {"policy_sync_time_s": seconds, "policy_sync_bytes": float(nbytes),
                 "policy_sync_gbps": nbytes / max(seconds, 1e-9) / 1e9}
        if env_value(VERIFY_ENV) == "1":
            self._verify()
            stats["policy_sync_verified"] = 1.0
        self._sync_stats = stats
        return stats

    def agent_begin(self) -> tuple[list[str], str]:
        """Rank 0, agentic rollout: every engine leader opens its token endpoint; returns their addresses (in
        engine order) and the run's bearer token. The engines stay there until ``agent_end``."""
        from areno.engine.token_service import new_token

        token = new_token()
        self._command({"op": "agent", "token": token, "version": self.version})
        parts = [None] * dist.get_world_size(self.layout.control)
        dist.gather_object(None, parts, dst=0, group=self.layout.control)
        return [parts[self.layout.rollout_ranks.index(r[0]) + 1] for r in self.layout.engines], token

    def agent_end(self, addresses: list[str], token: str) -> None:
        import httpx

        for address in addresses:  # a leader that is not told to stop would hang the run: fail loudly instead
            httpx.post(address + "/shutdown", headers={"authorization": f"Bearer {token}"},
                       timeout=60).raise_for_status()

    @contextlib.contextmanager
    def token_sampler(self):
        """The agents' token-level sampling for the length of the block: every engine serves tokens over HTTP
        (``agent_begin``/``agent_end``); yields a factory of ``RemoteTokens`` clients (made inside the agents'
        event loop)."""
        from areno.engine.token_service import RemoteTokens

        addresses, token = self.agent_begin()
        try:
            yield lambda: RemoteTokens(addresses, token)
        finally:
            self.agent_end(addresses, token)

    def refresh(self) -> None:
        pass  # the engines drop their stale prefixes when a new policy arrives (sync)

    def rng_state(self):
        return self._rng.getstate()

    def set_rng_state(self, state) -> None:
        version, internal, gauss = state
        self._rng.setstate((version, tuple(internal), gauss))

    def in_flight_count(self) -> int:
        return self._ahead

    def in_flight_state(self) -> dict | None:
        """Async: the rollouts sent ahead for the next steps (collected now, on rank 0; partial rollout: finished now,
        under the current policy, each token's version kept), for a checkpoint: they were sampled with older policies,
        which the checkpoint no longer holds, so a resumed run takes them from here instead of sampling anew. None
        when nothing is in flight."""
        if not self._ahead:
            return None
        if not self.rank0:
            return {"ahead": self._ahead, "rollouts": None, "cut": None}
        self._collect_all()
        if self.partial:
            self._command({"op": "drain"})
            self._pending.append(("drain", self.version, None))
            self._collect()
        tags = sorted(self._done)
        return {"ahead": self._ahead, "cut": self._cut, "rollouts": [
            {"tag": t, "version": self._done[t][0], "keys": self._done[t][3],
             "results": [[_plain(c) for c in group] for group in self._done[t][1]]} for t in tags]}

    def restore_in_flight(self, state: dict | None) -> None:
        """Take a checkpoint's ``in_flight_state`` as the rollouts sent ahead (every train rank)."""
        if state is None:
            return
        if "rollouts" not in state:  # a checkpoint of one rollout in flight (before K > 1): the next step's
            state = {"ahead": 1, "cut": 0, "rollouts": state["results"] and [
                {"tag": self.step_index(), "version": state["version"], "keys": None, "results": state["results"]}]}
        self._ahead = state["ahead"]
        if self.rank0:
            from areno.engine.engine import Completion

            self._cut = state["cut"]
            idle = {"train_idle_s": 0.0, "rollout_idle_s": 0.0}
            for r in state["rollouts"]:
                results = [[Completion(**_unplain(c)) for c in group] for group in r["results"]]
                self._done[r["tag"]] = (r["version"], results, idle, r["keys"])

    def drop_rollout_state(self) -> None:
        pass  # the rollout ranks drop theirs after each generate (the flag travels with the command)

    def close(self) -> None:
        if self.rank0:
            self._collect_all()
            self._command({"op": "stop"})

    # ---- rank 0 ----------------------------------------------------------------------------------------------
    def _command(self, cmd) -> None:
        broadcast_object(cmd, self.layout.control)

    def _dispatch(self, tag, prompt_ids, options, keys=None) -> None:
        """Rank 0: a rollout of ``prompt_ids`` for the step ``tag`` (None: an evaluation), answered later."""
        if self.partial and tag is not None:
            self._partial_command([(tag, prompt_ids, keys)], options, tag)
        else:
            self._generate([tag], [prompt_ids], options)

    def _generate(self, tags, batches, options, per_prompt=None) -> None:
        """Rank 0: one ``generate`` command for the steps ``tags``' batches (one engine call each, the batches' shares
        end to end: a second command in flight would cross its answer's gather on the control group). ``per_prompt``
        (one batch): its prompts' own seeded options, and the engines drop the prefixes it cached."""
        shares, sizes = [([], []) for _ in self.layout.engines], []
        for prompts in batches:
            opts = per_prompt if per_prompt is not None else self._seeded(options, len(prompts))
            ranges = _shares(len(prompts), len(self.layout.engines))
            for (ids, o), r in zip(shares, ranges):
                ids += [prompts[i] for i in r]
                o += opts[r.start:r.stop]
            sizes.append([len(r) for r in ranges])
        self._command({"op": "generate", "shares": shares, "drop": self.drop_state, "fresh": per_prompt is not None})
        self._pending.append((tags, self.version, sizes))

    def _seeded(self, options, n: int) -> list:
        return [dataclasses.replace(options, seed=self._rng.getrandbits(62)) for _ in range(n)]

    def _partial_command(self, add, options, until) -> None:
        """Rank 0: add the batches ``add`` ([(tag, prompts, keys)]) to the engines, then run them until batch
        ``until`` is done (None: answer at once)."""
        adds = []
        for tag, prompts, keys in add:
            opts = self._seeded(options, len(prompts))
            keys = list(keys) if keys is not None else list(range(len(prompts)))
            adds.append((tag, [([prompts[i] for i in r], opts[r.start:r.stop], keys[r.start:r.stop])
                               for r in _shares(len(prompts), len(self.layout.engines))]))
        self._command({"op": "partial", "add": adds, "until": until})
        self._pending.append((until, self.version, None))

    def _answers(self):
        """Wait for the oldest command in flight: its tag and version, every engine leader's answer (in engine order)
        and the idle times (with the engines' ``spec_accept_len`` under --speculative-tokens)."""
        tag, version, sizes = self._pending.popleft()
        t0 = time.perf_counter()
        parts = [None] * dist.get_world_size(self.layout.control)
        dist.gather_object(None, parts, dst=0, group=self.layout.control)
        waited = time.perf_counter() - t0
        answers = [parts[self.layout.rollout_ranks.index(ranks[0]) + 1] for ranks in self.layout.engines]
        idle = {"train_idle_s": waited, "rollout_idle_s": max((i for _, i, _ in answers), default=0.0)}
        accept = [s["spec_accept_len"] for _, _, s in answers if "spec_accept_len" in s]
        if accept:  # --speculative-tokens: the engines' mean accept length over this command
            idle["spec_accept_len"] = sum(accept) / len(accept)
            idle["spec_gated_steps"] = sum(s.get("spec_gated_steps", 0) for _, _, s in answers)
            limits = [s["spec_limit"] for _, _, s in answers if "spec_limit" in s]
            if limits:  # the gates' N at the command's end (each engine's own accept length under auto)
                idle["spec_limit"] = sum(limits) / len(limits)
        return tag, version, sizes, [a for a, _, _ in answers], idle

    def _collect(self):
        """Rank 0: collect the oldest command in flight into ``_done`` (a partial one: under each tag it finished);
        returns its completions in prompt order (of its last batch)."""
        tag, version, sizes, answers, idle = self._answers()
        if answers and isinstance(answers[0], dict):  # partial rollout: {"groups": [(key, completions)], "cut": n}
            self._cut += sum(a["cut"] for a in answers)
            if tag == "drain":  # every batch in flight: {"groups": {tag: [(key, completions)]}}
                for t in sorted({t for a in answers for t in a["groups"]}):
                    groups = [g for a in answers for g in a["groups"].get(t, [])]
                    self._done[t] = (version, [c for _, c in groups], idle, [k for k, _ in groups])
                return None
            groups = [g for a in answers for g in a["groups"]]
            results = [c for _, c in groups]
            if tag is not None:
                self._done[tag] = (version, results, idle, [k for k, _ in groups])
            return results
        offsets = [0] * len(answers)
        for t, per_engine in zip(tag, sizes):  # each batch: its share of every engine's answer, in engine order
            results = []
            for e, n in enumerate(per_engine):
                results += answers[e][offsets[e] : offsets[e] + n]
                offsets[e] += n
            if t is not None:
                self._done[t] = (version, results, idle, None)
        return results

    def _collect_all(self) -> None:
        for wait in self.background:
            wait()
        while self._pending:
            self._collect()

    def _take(self, tag):
        """Rank 0: step ``tag``'s rollout (version, completions, idle stats, keys), waiting for it if needed."""
        while tag not in self._done:
            self._collect()
        return self._done.pop(tag)

    def _verify(self) -> None:
        """Fetch every engine's weights and compare them with the trainer's, tensor by tensor, exactly."""
        mine = synced_tensors(self.model, fp8=self.fp8)
        if not self.rank0:
            return
        self._command({"op": "weights"})
        parts = [None] * dist.get_world_size(self.layout.control)
        dist.gather_object(None, parts, dst=0, group=self.layout.control)
        for ranks in self.layout.engines:
            theirs = parts[self.layout.rollout_ranks.index(ranks[0]) + 1]
            bad = [k for k in mine if not torch.equal(mine[k], theirs[k])]
            if bad or theirs.keys() != mine.keys():
                raise RuntimeError(f"policy sync: engine on ranks {ranks} differs from the trainer on {bad[:5]}")


# ---- the rollout ranks -----------------------------------------------------------------------------------------
def generate_share(engine, cmd: dict, index: int) -> list:
    """A ``generate`` command on a rollout rank of engine ``index``: that engine's share of the prompts. ``fresh`` (an
    evaluation): the prefixes it cached are dropped, so the next rollout finds the cache as the sync left it."""
    prompts, options = cmd["shares"][index]
    out = engine.generate(prompts, options) if prompts else []
    if cmd.get("fresh"):
        engine.reset_prefix_cache()
    if cmd.get("drop") and engine.runner is not None:
        engine.drop_rollout_state()
    return out


def rollout_policy(cfg, layout, device, dtype):
    """The rollout rank's frozen policy: the checkpoint (sharded over the engine's TP group), the run's LoRA adapter
    (zero B, or --lora-path's; each sync fills it), FP8 copies under --rollout-dtype fp8 (each sync streams them), the
    MTP tensors in the model's dtype under --mtp-loss-weight (each sync streams them)."""
    from areno.models import load_model
    from areno.training import lora

    model = load_model(cfg.ckpt, dtype=dtype, device=device, tp_group=layout.engine_group,
                       attn_backend=cfg.attn_backend)
    lora.apply(cfg, model)
    if cfg.mtp_loss_weight > 0:  # the trainer's MTP tensors arrive in the model's dtype
        model.stream_mtp()
    if cfg.rollout_dtype == "fp8":
        fp8_rollout.enable(model)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def spec_stats(engine) -> dict:
    """What a rollout rank reports of a command besides its answer: ``spec_accept_len``, ``spec_gated_steps`` and the
    gate's ``spec_limit`` with --speculative-tokens."""
    return {} if engine.spec is None else engine.spec.take_stats()


def receive(receiver, engine, plan) -> None:
    """A sync on a rollout rank: the policy's buckets into the engine's weights, then the MTP draft's reload."""
    receiver.receive(*plan)
    reload_draft(engine)


def serve(cfg) -> int:
    """A rollout rank's whole life: join the split world, load the policy, build the engine, run commands."""
    from areno.distributed import parallel
    from areno.engine.engine import Engine
    from areno.models import load_tokenizer
    from areno.rl.rollout.colocated import engine_config
    from areno.rl.routing_replay import routing_replay_enabled

    rank = parallel.env_rank()
    device = parallel.rank_device(cfg.rollout_devices, rank - cfg.world_size, "--rollout-devices")
    layout = parallel.init_split(cfg.world_size, cfg.tp_size, cfg.rollout_tp, device=device)
    watchdog = watch_ranks(cfg)  # a silent train rank 0 ends the run after ARENO_RANK_TIMEOUT_S
    torch_device, dtype = device_and_dtype(cfg.dtype, torch.device("cuda", device) if device is not None else "cpu")
    model = rollout_policy(cfg, layout, torch_device, dtype)
    tokenizer = load_tokenizer(cfg.ckpt)
    econf, eos = engine_config(cfg, model, tokenizer, record_routing=routing_replay_enabled(cfg, model))
    engine = Engine(model, tokenizer, econf, eos_token_ids=eos)
    receiver = PolicyReceiver(model, layout)
    partial = PartialRollout(engine, decode_steps=cfg.decode_steps, recompute=cfg.partial_rollout_kv == "recompute",
                             tail_steps=cfg.max_tail_steps, leader=rank == layout.engines[layout.engine_index][0])
    index = layout.engine_index
    leader = rank == layout.engines[index][0]
    idle, waiting = 0.0, time.perf_counter()
    log.info("rollout rank %d: engine %d of %d on %s", rank, index, len(layout.engines), torch_device)
    while True:
        cmd = broadcast_object(None, layout.control)
        idle += time.perf_counter() - waiting
        op = cmd["op"]
        if op == "stop":
            if watchdog is not None:
                watchdog.close()
            break
        if op == "sync":
            load = functools.partial(receive, receiver, engine, cmd.get("plan") or (None, None))
            if cfg.partial_rollout:  # in place, between two steps, sequences in flight
                partial.swap(load, cmd["version"])
            else:
                load()
                engine.reset_prefix_cache()  # K/V cached under the old policy are stale
        elif op in ("partial", "drain"):
            answer = partial.command(cmd, index, layout.engine_group)
            dist.gather_object((answer, idle, spec_stats(engine)) if leader else None, None, dst=0,
                               group=layout.control)
            idle = 0.0
        elif op == "generate":
            out = generate_share(engine, cmd, index)
            dist.gather_object((out, idle, spec_stats(engine)) if leader else None, None, dst=0,
                               group=layout.control)
            idle = 0.0
        elif op == "agent":  # agentic rollout: serve tokens over HTTP until the train side is done
            from areno.engine.model_runner import TPWorker, broadcast_step
            from areno.engine.token_service import TokenServer, reachable_host

            server = None
            if leader:
                server = TokenServer(engine, decode_steps=cfg.decode_steps, host=reachable_host(),
                                     token=cmd["token"], version=cmd.get("version"))
            dist.gather_object(server.address if server else None, None, dst=0, group=layout.control)
            if server is not None:
                server.wait()
                if layout.engine_group is not None:
                    broadcast_step(None, layout.engine_group)  # the TP followers leave their loop
            elif layout.engine_group is not None:
                engine._ensure_built()
                TPWorker(engine.runner).loop()
        elif op == "weights":
            tensors = synced_tensors(model, fp8=fp8_rollout.is_fp8(model))
            if engine.spec is not None:  # the MTP tensors as the draft holds them (it reloads them after a sync)
                tensors.update((k, v.cpu()) for k, v in engine.spec.draft.hub_tensors(model).items())
            dist.gather_object(tensors if leader else None, None, dst=0, group=layout.control)
        else:
            raise RuntimeError(f"rollout rank {rank}: unknown command {op!r}")
        waiting = time.perf_counter()
    return 0
