"""LoRA adapters on ``areno serve``, vLLM's surface: a request's ``model`` picks a loaded adapter (the base model stays
servable by its own name), ``/v1/models`` lists each adapter with ``parent`` = its base, and ``POST
/v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` / ``POST /v1/unload_lora_adapter`` ``{"lora_name"}`` change them
at run time.

The two endpoints are on whenever the server has LoRA slots (``--lora-modules`` or ``--max-loras``): vLLM hides them
behind ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``, areno behind the flags that make the slots and, like every ``/v1`` route,
the API key. A load goes to every engine (each engine-core replica holds its own slots) between two of its steps;
an adapter that cannot be served (missing files, another base model's shapes, a rank over --max-lora-rank, every
slot taken) is a 400 naming it, an unknown name a 404. An unloaded adapter's slot is reused only once the requests
still running with it have ended.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from areno.engine.lora_slots import slots_of
from areno.serve.bodies import request_body
from areno.serve.errors import APIError
from areno.serve.protocol import parse


class LoadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM's: replace a loaded adapter of that name


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; areno names adapters only


@dataclass
class ServedAdapters:
    """The adapters a server holds: name -> (path, parent), changed under one lock (the engines' slots follow)."""

    base: str
    adapters: dict[str, dict] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def cards(self, max_model_len: int) -> list[dict]:
        return [{"id": name, "object": "model", "created": 0, "owned_by": "areno", "root": a["path"],
                 "parent": a["parent"], "max_model_len": max_model_len} for name, a in self.adapters.items()]


def served_adapters(config) -> ServedAdapters | None:
    """The server's adapters from its ServeConfig (--lora-modules, loaded by the engines at start); None without
    LoRA slots."""
    if not config.lora_enabled:
        return None
    base = config.served_model_name or str(config.model_path).rstrip("/")
    adapters = config.lora_adapters() if config.lora_modules else []
    return ServedAdapters(base, {a["name"]: {"path": a["path"], "parent": a["base_model_name"]} for a in adapters})


def adapter_for(state, name: str) -> str | None:
    """The adapter a request's ``model`` names, None for the base model; a 404 for any other name."""
    if name == state.model_name:
        return None
    if state.loras is not None and name in state.loras.adapters:
        return name
    served = [state.model_name, *(state.loras.adapters if state.loras is not None else ())]
    raise APIError(404, f"The model `{name}` does not exist; this server serves {', '.join(map(repr, served))}",
                   param="model", code="model_not_found")


def check_adapter_request(req, adapter: str | None) -> None:
    """What a request for an adapter cannot ask yet: prompt log-probs (scored by the base model's forward)."""
    if adapter is None:
        return
    if getattr(req, "prompt_logprobs", None) is not None or (getattr(req, "echo", False) and req.logprobs is not None):
        raise APIError(400, f"prompt log-probs (prompt_logprobs, echo with logprobs) are not supported yet for a LoRA "
                            f"adapter ({adapter})", param="prompt_logprobs")


# ---- on the engine thread (module-level: they travel to engine-core replicas) ----------------------------------
def engine_load(engine, name: str, path: str) -> int:
    return slots_of(engine, name).load(name, path)


def engine_unload(engine, name: str) -> None:
    slots_of(engine, name).unload(name)


async def _on_engines(state, fn, *args) -> list:
    """``fn(engine, *args)`` on every engine: [(ok, result or exception)] (raised only by a stopped engine)."""
    every = getattr(state.engine, "run_on_every_engine", None)
    if every is not None:
        return [(not isinstance(r, BaseException), r) for r in (await every(fn, *args)).values()]
    try:
        return [(True, await state.engine.run_on_engine(fn, *args))]
    except APIError:
        raise
    except Exception as exc:  # noqa: BLE001 - the engine's refusal, answered below
        return [(False, exc)]


def _slots(request: Request):
    state = request.app.state.serve
    if state.loras is None:
        raise APIError(400, "this server has no LoRA slots (start it with --lora-modules or --max-loras)",
                       param="lora_name")
    return state, state.loras


async def load_lora_adapter(request: Request):
    state, loras = _slots(request)
    req = parse(await request.body(), LoadLoraRequest)
    name = req.lora_name
    if not name or name == state.model_name:
        raise APIError(400, f"{name!r} cannot name an adapter (the base model's name, or empty)", param="lora_name")
    async with loras.lock:
        if name in loras.adapters and not req.load_inplace:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded", param="lora_name")
        if name in loras.adapters:
            await _on_engines(state, engine_unload, name)
            del loras.adapters[name]
        results = await _on_engines(state, engine_load, name, req.lora_path)
        failed = [r for ok, r in results if not ok]
        if failed:
            if len(failed) < len(results):  # the engines that took it give it back: all serve the same adapters
                await _on_engines(state, engine_unload, name)
            raise APIError(400, f"LoRA adapter {failed[0]}" if str(failed[0]).startswith(name) else
                           f"LoRA adapter {name}: {failed[0]}", param="lora_path")
        loras.adapters[name] = {"path": req.lora_path, "parent": state.model_name}
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: Request):
    state, loras = _slots(request)
    req = parse(await request.body(), UnloadLoraRequest)
    async with loras.lock:
        if req.lora_name not in loras.adapters:
            raise APIError(404, f"The lora adapter '{req.lora_name}' cannot be found", param="lora_name",
                           code="model_not_found")
        del loras.adapters[req.lora_name]
        await _on_engines(state, engine_unload, req.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


def add_lora_routes(app, state) -> None:
    app.add_api_route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"],
                      openapi_extra=request_body(LoadLoraRequest))
    app.add_api_route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"],
                      openapi_extra=request_body(UnloadLoraRequest))
