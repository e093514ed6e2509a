"""Token-in/token-out sampling for agentic rollout, on the local engine or, in split mode, on the rollout ranks.

``sample_local(async_engine, prompt_ids, options)`` submits one request to an ``AsyncEngine`` in this process.
``TokenServer`` runs on a split-mode engine leader while an agentic rollout lasts: an HTTP endpoint (``POST
/generate`` with ``prompt_ids`` and the sampling options, ``POST /shutdown``) over an ``AsyncEngine`` on that rank's
engine, so the sessions of every agent share one continuous batch per engine. ``RemoteTokens`` is the train side's
client: a session always goes to the same engine (its earlier turns are in that engine's prefix cache). Requests
carry a bearer token made for the run; the answer is the sampled ids, their log-probs, the finish reason, the stop
string, how many prompt tokens the prefix cache served and the policy version of the engine's weights (``version``:
the train side's step count at its last sync, None on the local engine), which stamps every token of the answer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
import time
import uuid

from fastapi import Request  # module level: FastAPI resolves the handlers' annotations here

from areno.config import SamplingParams


async def sample_local(async_engine, prompt_ids: list[int], options: SamplingParams) -> dict:
    stream = await async_engine.submit(list(prompt_ids), options, final_only=True)
    ids, lps, finish, stop_text = [], [], None, None
    async for first in stream:  # final_only: a sample's events come in one go, when it finishes
        for event in (first, *stream.pending()):
            if event.token_id is not None:
                ids.append(event.token_id)
                lps.append(event.logprob)
            if event.finish_reason is not None:
                finish, stop_text = event.finish_reason, event.stop_text
    seq = stream.seqs[0] if stream.seqs else None
    return {"ids": ids, "logprobs": lps, "finish_reason": finish, "stop_text": stop_text,
            "prefix_cached": seq.prefix_cached if seq is not None else 0}


class TokenServer:
    """An engine leader's endpoint for one agentic rollout; ``wait()`` returns after ``/shutdown``."""

    def __init__(self, engine, *, decode_steps: int, host: str, token: str, version: int | None = None):
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse

        from areno.engine.async_engine import AsyncEngine

        self.async_engine = AsyncEngine(engine, decode_steps=decode_steps)
        self.done = threading.Event()
        app = FastAPI()

        def authorised(request) -> bool:
            return request.headers.get("authorization") == f"Bearer {token}"

        @app.post("/generate")
        async def generate(request: Request):
            if not authorised(request):
                return JSONResponse({"error": "unauthorised"}, status_code=401)
            body = await request.json()
            options = SamplingParams(**body["options"])
            return {**await sample_local(self.async_engine, body["prompt_ids"], options), "version": version}

        @app.post("/shutdown")
        async def shutdown(request: Request):
            if not authorised(request):
                return JSONResponse({"error": "unauthorised"}, status_code=401)
            self.done.set()
            return {"ok": True}

        self._server, self._thread, self.address = serve_in_thread(app, host, "areno-token-server")

    def wait(self) -> None:
        """Serve until ``/shutdown``, then stop the endpoint and the engine thread (the engine stays)."""
        self.done.wait()
        self._server.should_exit = True
        self._thread.join(10)
        self.async_engine.shutdown(drain=False)


def serve_in_thread(app, host: str, name: str):
    """Serve ``app`` on a free port of ``host`` from a daemon thread; returns (server, thread, "http://host:port")
    once it accepts connections. ``server.should_exit = True`` then ``thread.join()`` stops it."""
    import uvicorn

    sock = socket.socket()
    sock.bind((host, 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    server.install_signal_handlers = lambda: None
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError(f"{name}: the HTTP endpoint did not start")
        time.sleep(0.01)
    return server, thread, f"http://{host}:{sock.getsockname()[1]}"


def reachable_host() -> str:
    """This rank's address for the train side: loopback on one node, the host's address across nodes."""
    from areno.distributed.parallel import single_node

    if single_node():
        return "127.0.0.1"
    return socket.gethostbyname(socket.gethostname())


def new_token() -> str:
    return uuid.uuid4().hex


class RemoteTokens:
    """The train side's client to the engines' token endpoints."""

    def __init__(self, addresses: list[str], token: str):
        import httpx

        self.addresses = addresses
        self._client = httpx.AsyncClient(timeout=None, headers={"authorization": f"Bearer {token}"})

    async def sample(self, prompt_ids: list[int], options: SamplingParams, key: int) -> dict:
        url = self.addresses[key % len(self.addresses)] + "/generate"
        reply = await self._client.post(url, json={"prompt_ids": list(prompt_ids),
                                                   "options": dataclasses.asdict(options)})
        reply.raise_for_status()
        return reply.json()

    async def aclose(self) -> None:
        await self._client.aclose()
