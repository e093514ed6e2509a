"""What the server says about itself: ``GET /health``, ``/version``, ``/v1/models`` (and one model by id) and the
Prometheus ``/metrics``."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from areno.serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from areno.serve.state import ServeState


async def health(request: Request):
    """200 "ok" while the engine can serve; 503 "unavailable" once it cannot (every replica dead, engine stopped),
    so a load balancer or supervisor stops sending requests that would all get 503."""
    engine = request.app.state.serve.engine
    body = {"status": "ok", "active_requests": engine.num_active}
    if hasattr(engine, "health"):  # the data-parallel front end adds per-replica counters
        body.update(engine.health())
    if not engine.serving:
        return JSONResponse({**body, "status": "unavailable"}, status_code=503)
    return body


async def version():
    from areno import __version__

    return {"version": __version__}


async def models(request: Request):
    return {"object": "list", "data": request.app.state.serve.model_cards()}


async def model(model_id: str, request: Request):
    state: ServeState = request.app.state.serve
    state.check_model(model_id)
    return next(card for card in state.model_cards() if card["id"] == model_id)


async def metrics_route(request: Request):
    state: ServeState = request.app.state.serve
    return Response(await state.metrics.render(state.engine), media_type=METRICS_CONTENT_TYPE)


def add_info_routes(app, state: ServeState) -> None:
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/version", version, methods=["GET"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", model, methods=["GET"])
    app.add_api_route("/metrics", metrics_route, methods=["GET"])
