"""A replica's processes (``areno.serve.replicas`` starts them, spawned; its docstring has the wire protocol): TP rank 0
builds the engine and runs ``ReplicaWorker``, which applies the front end's commands between engine steps and sends
one message per step with every sequence's new tokens; the other TP ranks hold their shards and follow rank 0's
broadcast steps."""

from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import os
import pickle
import queue
import signal
import time

from areno.config import ConfigError
from areno.config.env import env_value

log = logging.getLogger("areno.serve")


def start_process(engine_kwargs: dict, threads: int, dist_env: dict | None):
    """Common start of a replica's process: signals left to the front end, CPU threads, the replica's TP group."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides when replicas stop
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    import torch

    if not torch.cuda.is_available():
        torch.set_num_threads(threads)
    if dist_env:
        from datetime import timedelta

        from areno.distributed import parallel

        os.environ.update(dist_env)
        # followers wait on their rank 0 for as long as the server idles
        parallel.init_distributed(tp_size=engine_kwargs["tp_size"], timeout=timedelta(days=30))


def replica_main(rank: int, engine_kwargs: dict, threads: int, commands, events, dist_env=None) -> None:
    """A replica's process (its TP rank 0): build the engine, then serve commands until shutdown or the front
    end's death; at the end, release the replica's TP followers."""
    try:
        start_process(engine_kwargs, threads, dist_env)
        from areno.engine.build import build_engine

        engine, _ = build_engine(**engine_kwargs)
        engine.capture_graphs((1,))  # the server decodes one token per step; no capture stalls a request later
        engine.warm_up()  # nor a JIT compile or an autotune of an eager (prefill or mixed) step
        gc.freeze()  # the model and engine objects leave the collector's scans: shorter GC pauses while serving
    except BaseException as exc:  # report, so the front end fails at start with the reason
        # a refused flag travels as (flag, reason): the front end raises the same ConfigError (exit 2 naming it)
        why = (exc.flag, exc.reason) if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}"
        events.put((rank, "failed", why))
        return
    events.put((rank, "ready", engine.max_model_len))
    try:
        ReplicaWorker(rank, engine, commands, events).run()
    finally:
        engine.close()


def tp_follower_main(engine_kwargs: dict, threads: int, dist_env: dict) -> None:
    """A non-zero TP rank of a replica: load its shard, execute the steps its rank 0 broadcasts until it closes."""
    start_process(engine_kwargs, threads, dist_env)
    from areno.engine.build import build_engine

    engine, _ = build_engine(**engine_kwargs)
    engine.follow()


def trace_stalls() -> float | None:
    """``ARENO_TRACE_STEPS_MS=N``: log every engine step slower than N ms and every Triton kernel compiled while
    serving (a stall's usual causes); None when unset."""
    value = env_value("ARENO_TRACE_STEPS_MS")
    if not value:
        return None
    import triton

    def compiled(*args, **kwargs):
        log.warning("triton compiled %s", str(kwargs.get("repr", ""))[:300])

    if hasattr(triton, "knobs"):
        triton.knobs.runtime.jit_post_compile_hook = compiled
    return float(value)


class ReplicaWorker:
    def __init__(self, rank, engine, commands, events):
        self.rank, self.engine, self.commands, self.events = rank, engine, commands, events
        engine.grammars.off_loop = True  # a new grammar compiles while the other requests decode
        self.seqs: dict[int, list] = {}  # rid -> its sequences
        self.rid_of: dict[int, int] = {}  # seq_id -> rid
        self.stopping = False
        self.parent = mp.parent_process()
        self.sent: dict[int, int] = {}  # seq_id -> output tokens already sent
        self.decode_steps = 1  # the server decodes one token per step (lowest latency per token)

    def _apply(self, cmd) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, prompt_ids, options, *images = cmd
            try:
                mm = pickle.loads(images[0]) if images else None  # a MultimodalPrompt, sent by value
                seqs = self.engine.add_request(prompt_ids, options, mm=mm)
            except Exception as exc:  # a request the engine refuses fails alone
                self.events.put((self.rank, "error", (rid, isinstance(exc, ValueError), str(exc))))
                return
            self.seqs[rid] = seqs
            for seq in seqs:
                self.rid_of[seq.seq_id] = rid
        elif kind == "abort":
            self._abort(cmd[1])
        elif kind == "call":
            _, cid, fn, args = cmd
            try:
                result = (cid, True, fn(self.engine, *args))
            except Exception as exc:  # the caller's failure, not the replica's
                result = (cid, False, (isinstance(exc, ValueError), str(exc)))
            self.events.put((self.rank, "result", result))
        elif kind == "shutdown":
            self.stopping = True
            if not cmd[1]:
                for rid in list(self.seqs):
                    self._abort(rid)

    def _abort(self, rid) -> None:
        seqs = self.seqs.pop(rid, None)
        if seqs is None:
            return
        self.engine.abort(seqs)
        rows = []
        for seq in seqs:
            self.sent.pop(seq.seq_id, None)
            if self.rid_of.pop(seq.seq_id, None) is not None:
                rows.append((rid, seq.sample_index, [], [], "abort", None, None))
        if rows:
            self.events.put((self.rank, "tokens", rows))

    def _next_commands(self, block: bool) -> list:
        out = []
        try:
            out.append(self.commands.get(timeout=0.05) if block else self.commands.get_nowait())
            while True:
                out.append(self.commands.get_nowait())
        except queue.Empty:
            pass
        return out

    def run(self) -> None:
        engine, sent = self.engine, self.sent
        slow_ms = trace_stalls()
        while True:
            for cmd in self._next_commands(block=not engine.has_work()):
                self._apply(cmd)
            if self.parent is not None and not self.parent.is_alive():
                return  # orphaned: nobody is left to read the results
            if not engine.has_work():
                if engine.spec is not None:
                    engine.spec.reopen()  # the server's gate window: idle to idle (``AsyncEngine.reopen_when_idle``)
                if self.stopping:
                    break
                continue
            try:
                t0 = time.perf_counter()
                seqs = engine.step(self.decode_steps)
                if slow_ms is not None and (ms := (time.perf_counter() - t0) * 1e3) > slow_ms:
                    log.warning("replica %d: slow step %.0f ms: %d rows, %d running, %d waiting", self.rank, ms,
                                len(seqs), len(engine.scheduler.running), len(engine.scheduler.waiting))
            except Exception as exc:  # keep serving: fail the requests in flight, not the replica
                log.exception("replica %d: engine step failed", self.rank)
                for rid, seqs in list(self.seqs.items()):
                    engine.abort(seqs)
                    self.events.put((self.rank, "error", (rid, False, f"engine step failed: {exc}")))
                self.seqs.clear()
                self.rid_of.clear()
                sent.clear()
                continue
            rows = []  # one message per engine step: every sequence's new tokens
            for seq in seqs:
                rid = self.rid_of.get(seq.seq_id)
                if rid is None:
                    continue
                start, end = sent.get(seq.seq_id, 0), len(seq.logprobs)
                tokens = seq.tokens[seq.prompt_len + start : seq.prompt_len + end]
                top = seq.top_logprobs[start:end] if seq.options.top_logprobs else None
                rows.append((rid, seq.sample_index, tokens, seq.logprobs[start:end], seq.finish_reason,
                             seq.stop_text, top))
                if seq.is_finished:
                    del self.rid_of[seq.seq_id]
                    sent.pop(seq.seq_id, None)
                    if not any(s.seq_id in self.rid_of for s in self.seqs[rid]):
                        del self.seqs[rid]
                else:
                    sent[seq.seq_id] = end
            if rows:
                self.events.put((self.rank, "tokens", rows))
        self.events.put((self.rank, "closed", None))
