"""Engine-core processes: ``areno serve`` runs its engine in a process of its own (one replica), and with
``--world-size W --tp-size T``, W / T > 1, runs W / T engine replicas (data-parallel serving).

Why a process: the engine's host work (scheduling, input packing, stop checks) and the HTTP path (parsing,
detokenisation, SSE encoding, socket writes) would otherwise take turns on one interpreter lock, and every time the
engine waits for it the GPU idles. Here the engine core loops on its own core; the front end receives one message per
engine step and hands it to the event loop as one callback (``deliver``), so a stream that fell behind sends all its
new tokens in one chunk and the engine never waits for HTTP.

Each replica is a worker process (``multiprocessing`` spawn) that loads the model and holds its own engine session
on devices ``[r*T, (r+1)*T)`` of the visible GPUs (its ``CUDA_VISIBLE_DEVICES``; on a CPU-only host every replica
runs on the CPU, for tests and tiny models). The HTTP front end keeps one :class:`ReplicaPool`, which looks to
``areno.serve.app`` like an ``AsyncEngine``: ``submit`` sends a request to the least-loaded live replica (active
sequences, then fewest requests served), a reader thread turns the replicas' token events back into each request's
asyncio stream, and ``abort`` (client disconnect, shutdown) is forwarded to the replica holding the request.

Wire protocol, front end -> replica (one queue each): ``("add", rid, prompt_ids, options[, pickled mm])`` (a
prompt's images: its ``MultimodalPrompt``), ``("abort", rid)``, ``("call", cid, fn, args)`` (``fn(engine, *args)``
between two engine steps: prompt log-probs), ``("shutdown", drain)``. Replica -> front end (one shared queue):
``(rank, "ready", max_model_len)``, ``(rank, "failed", message or (flag, reason))`` (the pair: a ConfigError, raised
again by the front end), ``(rank, "tokens", [(rid, index, tokens, logprobs, finish, stop_text, tops), ...])`` (one
message per engine step: each sequence's new tokens), ``(rank, "error", (rid, is_value_error, message))``, ``(rank,
"result", (cid, ok, value or (is_value_error, message)))``, ``(rank, "closed", None)``.

With T > 1 a replica is a tensor-parallel group of T processes, all started by the front end: the first (TP rank 0)
runs the replica's engine and speaks the wire protocol, the other T - 1 hold their weight shards and execute the
steps it broadcasts (``Engine.follow``). Each replica group has its own ``torch.distributed`` rendezvous on a free
loopback port (NCCL on GPUs, gloo on the CPU), so replicas never wait on each other.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import os
import pickle
import queue
import threading
import time
from dataclasses import dataclass, field

from areno.config import ConfigError
from areno.engine.async_engine import RequestStream, TokenEvent, deliver
from areno.serve.errors import APIError
from areno.serve.replica_worker import replica_main, tp_follower_main

log = logging.getLogger("areno.serve")

STARTUP_TIMEOUT_S = 600.0  # loading a large checkpoint on every replica takes a while


def check_topology(world_size: int, tp_size: int, num_gpus: int) -> int:
    """The number of replicas, or a ConfigError for a topology this build cannot run."""
    if world_size % tp_size:
        raise ConfigError("--world-size", f"{world_size} is not divisible by --tp-size {tp_size}")
    if num_gpus and world_size > num_gpus:
        raise ConfigError("--world-size", f"{world_size} needs {world_size} GPUs; {num_gpus} are visible")
    return world_size // tp_size


def visible_gpus() -> list[str]:
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = [d.strip() for d in env.split(",") if d.strip()] if env else [str(i) for i in range(n)]
    return names[:n]


# ---- front end -------------------------------------------------------------------------------------------------


@dataclass
class Replica:
    rank: int
    devices: list[str]
    process: object
    commands: object
    alive: bool = True
    followers: list = field(default_factory=list)  # TP ranks 1..T-1 of this replica
    active: int = 0  # sequences in flight
    requests: int = 0  # requests dispatched to it, ever
    rids: set = field(default_factory=set)

    @property
    def processes(self) -> list:
        """TP rank 0 (the replica's engine) then its followers."""
        return [self.process, *self.followers]

    def info(self) -> dict:
        return {"rank": self.rank, "pid": self.process.pid, "devices": self.devices or "cpu", "alive": self.alive,
                "active_requests": self.active, "requests": self.requests}


class ReplicaStream(RequestStream):
    def __init__(self, pool, replica: Replica, rid: int, prompt_ids, options):
        super().__init__(pool, prompt_ids, options)
        self.replica, self.rid = replica, rid
        self._abort_sent = False

    def abort(self):
        if self.remaining > 0 and not self._abort_sent and self.replica.alive:
            self._abort_sent = True
            self.replica.commands.put(("abort", self.rid))


class ReplicaPool:
    """The front end's view of W / T replica processes, with the interface of ``AsyncEngine``."""

    def __init__(self, engine_kwargs: dict, num_replicas: int, *, tp_size: int = 1, gpus: list[str] | None = None):
        ctx = mp.get_context("spawn")
        self.events = ctx.Queue()
        self.replicas: list[Replica] = []
        self._streams: dict[int, tuple[ReplicaStream, int]] = {}  # rid -> (stream, samples left)
        self._calls: dict[int, tuple[Replica, object, asyncio.Future]] = {}  # cid -> (replica, loop, future)
        self._lock = threading.Lock()
        self._rids = itertools.count()
        self._closed = False
        threads = max(1, (os.cpu_count() or 1) // (num_replicas * tp_size))
        for rank in range(num_replicas):
            devices = list(gpus[rank * tp_size : (rank + 1) * tp_size]) if gpus else []
            commands = ctx.Queue()
            # seed + rank: unseeded requests must not repeat each other's samples across replicas
            kwargs = dict(engine_kwargs, seed=engine_kwargs.get("seed", 0) + rank)
            if tp_size == 1:
                kwargs["device"] = "cuda:0" if devices else "cpu"
            envs = [None]
            if tp_size > 1:  # one rendezvous per replica group; each rank's device is cuda:LOCAL_RANK
                from areno.distributed.launch import free_port

                port = str(free_port())
                envs = [{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(tp_size),
                         "RANK": str(i), "LOCAL_RANK": str(i)} for i in range(tp_size)]
            procs = [ctx.Process(target=replica_main, args=(rank, kwargs, threads, commands, self.events, envs[0]),
                                 name=f"areno-replica-{rank}", daemon=True)]
            procs += [ctx.Process(target=tp_follower_main, args=(kwargs, threads, env),
                                  name=f"areno-replica-{rank}-tp{i}", daemon=True)
                      for i, env in enumerate(envs[1:], start=1)]
            before = os.environ.get("CUDA_VISIBLE_DEVICES")
            if devices:  # the child inherits the environment at start, before anything in it touches CUDA
                os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
            try:
                for proc in procs:
                    proc.start()
            finally:
                if devices:
                    if before is None:
                        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
                    else:
                        os.environ["CUDA_VISIBLE_DEVICES"] = before
            self.replicas.append(Replica(rank, devices, procs[0], commands, followers=procs[1:]))
        try:
            self.max_model_len = self._wait_ready()
        except BaseException:
            self._kill()
            raise
        self._reader = threading.Thread(target=self._read, name="areno-replica-events", daemon=True)
        self._reader.start()

    def _wait_ready(self) -> int:
        ready: dict[int, int] = {}
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(ready) < len(self.replicas):
            try:
                rank, kind, payload = self.events.get(timeout=1.0)
            except queue.Empty:
                kind = None
            if kind is None:
                dead = [p for r in self.replicas for p in r.processes if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"{dead[0].name} exited during start-up (exit code {dead[0].exitcode})")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"replicas not ready after {STARTUP_TIMEOUT_S:.0f} s")
                continue
            if kind == "failed":
                if isinstance(payload, tuple):  # a flag the replica's engine refused
                    raise ConfigError(*payload)
                raise RuntimeError(f"replica {rank} failed to start: {payload}")
            ready[rank] = payload
            log.info("replica %d ready on %s", rank, ",".join(self.replicas[rank].devices) or "cpu")
        return min(ready.values())

    # ---- the AsyncEngine interface ---------------------------------------------------------------------------
    def _least_loaded(self):
        """The live replica with the fewest active sequences (then requests); a 503 when none serves. Hold the lock."""
        live = [r for r in self.replicas if r.alive]
        if self._closed or not live:
            raise APIError(503, "no engine replica is serving", type="server_error")
        return min(live, key=lambda r: (r.active, r.requests, r.rank))

    async def submit(self, prompt_ids: list[int], options, *, mm=None) -> ReplicaStream:
        with self._lock:
            replica = self._least_loaded()
            rid = next(self._rids)
            stream = ReplicaStream(self, replica, rid, list(prompt_ids), options)
            self._streams[rid] = (stream, options.n)
            replica.active += options.n
            replica.requests += 1
            replica.rids.add(rid)
        # images travel pickled by value (a tensor put on the queue as it is would go through shared memory that
        # this process must keep alive until the replica has read it)
        images = () if mm is None else (pickle.dumps(mm),)
        replica.commands.put(("add", rid, stream.prompt_ids, options, *images))
        return stream

    async def run_on_engine(self, fn, *args):
        """``fn(engine, *args)`` in the least-loaded replica, between two of its engine steps (``fn`` a module-level
        function: it travels by name)."""
        _check_picklable(fn, args)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            replica = self._least_loaded()
            cid = next(self._rids)
            self._calls[cid] = (replica, loop, future)
        replica.commands.put(("call", cid, fn, args))
        return await future

    async def run_on_every_engine(self, fn, *args) -> dict:
        """``fn(engine, *args)`` in every live replica, each between two of its engine steps: {rank: result, or
        the exception it raised}."""
        _check_picklable(fn, args)
        loop = asyncio.get_running_loop()
        sent = []
        with self._lock:
            for replica in self.replicas:
                if replica.alive and not self._closed:
                    cid = next(self._rids)
                    future = loop.create_future()
                    self._calls[cid] = (replica, loop, future)
                    sent.append((replica, cid, future))
        for replica, cid, _ in sent:
            replica.commands.put(("call", cid, fn, args))
        results = await asyncio.gather(*(f for _, _, f in sent), return_exceptions=True)
        return {replica.rank: result for (replica, _, _), result in zip(sent, results)}

    @property
    def num_active(self) -> int:
        with self._lock:
            return sum(r.active for r in self.replicas)

    def health(self) -> dict:
        with self._lock:
            return {"replicas": [r.info() for r in self.replicas]}

    @property
    def serving(self) -> bool:
        """Whether a request can be served: the pool is open and a replica is alive."""
        with self._lock:
            return not self._closed and any(r.alive for r in self.replicas)

    def shutdown(self, *, drain: bool = False, timeout: float = 30.0) -> None:
        """Stop every replica (aborting in-flight requests unless ``drain``) and wait for the processes."""
        with self._lock:
            first = not self._closed
            self._closed = True
        if first:
            for r in self.replicas:
                if r.alive:
                    r.commands.put(("shutdown", drain))
        deadline = time.monotonic() + timeout
        for r in self.replicas:
            for proc in r.processes:  # rank 0 releases its followers as it ends
                proc.join(max(0.0, deadline - time.monotonic()))
        self._kill()
        if getattr(self, "_reader", None) is not None:
            self._reader.join(5)

    # ---- internals -------------------------------------------------------------------------------------------
    def _kill(self):
        for r in self.replicas:
            for proc in r.processes:
                if proc.is_alive():
                    proc.kill()
                    proc.join(5)

    def _finish(self, rid: int, samples: int) -> None:
        """Account for ``samples`` of request ``rid`` ending (called with the lock held)."""
        stream, left = self._streams[rid]
        left -= samples
        stream.replica.active -= samples
        if left > 0:
            self._streams[rid] = (stream, left)
        else:
            del self._streams[rid]
            stream.replica.rids.discard(rid)

    def _read(self) -> None:
        """The reader thread: replica events -> request streams; a replica that dies fails its requests."""
        while True:
            try:
                rank, kind, payload = self.events.get(timeout=0.5)
            except queue.Empty:
                self._reap()
                if all(not r.alive for r in self.replicas):
                    return
                continue
            except (EOFError, OSError):
                return
            with self._lock:
                if kind == "tokens":
                    self._dispatch(payload)
                elif kind == "error":
                    rid, is_value_error, message = payload
                    entry = self._streams.get(rid)
                    if entry is not None:
                        self._finish(rid, entry[1])
                        _push(entry[0], ValueError(message) if is_value_error else RuntimeError(message))
                elif kind == "result":
                    cid, ok, value = payload
                    entry = self._calls.pop(cid, None)
                    if entry is not None:
                        if not ok:
                            is_value_error, message = value
                            value = ValueError(message) if is_value_error else RuntimeError(message)
                        _settle(entry[1], entry[2], ok, value)
                elif kind == "closed":
                    self._fail_replica(self.replicas[rank], "stopped")

    def _dispatch(self, rows) -> None:
        """One engine step's rows -> one batch per event loop, delivered by one callback (called with the lock
        held, on the reader thread)."""
        batches: dict = {}  # event loop -> {stream: [events]}
        streams = self._streams
        for rid, index, tokens, logprobs, finish, stop_text, tops in rows:
            entry = streams.get(rid)
            if entry is None:
                continue
            stream = entry[0]
            n = len(tokens)
            if n == 1 and not tops:  # the common case: one decoded token
                events = [TokenEvent(index, tokens[0], logprobs[0], finish, stop_text)]
            else:
                events = [TokenEvent(index, t, lp, None, None, tops[j] if tops else None)
                          for j, (t, lp) in enumerate(zip(tokens, logprobs))]
                if finish is not None:
                    if not events:
                        events.append(TokenEvent(index, None, None))
                    events[-1].finish_reason, events[-1].stop_text = finish, stop_text
            if finish is not None:
                self._finish(rid, 1)
            by_stream = batches.setdefault(stream.loop, {})
            if stream in by_stream:
                by_stream[stream].extend(events)
            else:
                by_stream[stream] = events
        for loop, by_stream in batches.items():
            try:
                loop.call_soon_threadsafe(deliver, list(by_stream.items()))
            except RuntimeError:  # its event loop is gone (server shut down): nobody is waiting
                pass

    def _reap(self) -> None:
        with self._lock:
            for r in self.replicas:
                gone = [p for p in r.processes if not p.is_alive()]
                if r.alive and gone:  # one lost rank stalls the whole TP group: stop what is left of it
                    log.error("replica %d: process %s exited (code %s)", r.rank, gone[0].name, gone[0].exitcode)
                    for proc in r.processes:
                        if proc.is_alive():
                            proc.kill()
                    self._fail_replica(r, f"exited with code {gone[0].exitcode}")

    def _fail_replica(self, replica: Replica, why: str) -> None:
        replica.alive = False
        for rid in list(replica.rids):
            stream, left = self._streams[rid]
            self._finish(rid, left)
            _push(stream, RuntimeError(f"engine replica {replica.rank} {why}"))
        for cid, (r, loop, future) in list(self._calls.items()):
            if r is replica:
                del self._calls[cid]
                _settle(loop, future, False, RuntimeError(f"engine replica {replica.rank} {why}"))


def _check_picklable(fn, args) -> None:
    """A call that cannot travel fails here, at once: the queue's feeder thread would drop it (printing the error)
    and its caller would wait forever."""
    import pickle

    try:
        pickle.dumps((fn, args))
    except Exception as exc:
        raise TypeError(f"run_on_engine: {fn!r} and its arguments must be picklable (a module-level function): "
                        f"{exc}") from exc


def _settle(loop, future, ok: bool, value) -> None:
    """Resolve a ``run_on_engine`` future from the reader thread."""

    def settle():
        if not future.done():
            future.set_result(value) if ok else future.set_exception(value)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # its event loop is gone: nobody is waiting
        pass


def _push(stream: RequestStream, item) -> None:
    try:
        stream.push(item)
    except RuntimeError:  # its event loop is gone (server shut down): nobody is waiting for it
        pass


def build_pool(config, num_replicas: int) -> ReplicaPool:
    """Start the replicas for a ServeConfig (each loads the model itself)."""
    gpus = visible_gpus()
    engine_kwargs = dict(
        model_path=config.model_path, tp_size=config.tp_size, max_running=config.max_running_prompts, seed=config.seed,
        max_model_len=config.max_model_len, eager_decode=config.eager_decode, attn_backend=config.attn_backend,
        decode_progress_interval_s=config.decode_progress_interval_s or None, kv_cache_memory=config.kv_cache_memory,
        dtype=config.dtype, rollout_dtype=config.rollout_dtype, kv_cache_dtype=config.kv_cache_dtype,
        mamba_ssm_cache_dtype=config.mamba_ssm_cache_dtype, **config.lora_engine_kwargs(),
    )
    if not gpus:
        log.warning("no CUDA device: all %d replicas run on the CPU", num_replicas)
    return ReplicaPool(engine_kwargs, num_replicas, tp_size=config.tp_size, gpus=gpus)
