"""The OpenAI front of a disaggregated deployment: each completion goes to a prefill instance
(``kv_transfer_params: {"do_remote_decode": true}``, one token, not streamed), then, with the
prefill's ``kv_transfer_params``, to a decode instance, whose answer (streamed or not) is the
client's. vLLM's disaggregated proxy, with failure handling:

- a prefill instance that is unreachable, errs, or is found down by the health checks while a
  request waits on it (a hang: ``unhealthy_after`` failed checks, a few seconds) fails that
  request at once with a 503 naming the instance; nothing is held anywhere (the prefill side
  frees its blocks when the request finishes or its connection closes);
- a client that goes away closes the upstream connection, and that instance aborts the
  request and frees its blocks; a transfer published but never handed to a decode instance is
  released on the prefill side.

Requests are spread over the healthy instances of each role by fewest in flight. The router
checks no API key itself: it forwards the client's Authorization header to the instances.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvserve.disagg.instances import Instance, InstanceDown, InstancePool

logger = logging.getLogger("kvserve")

ROUTED_PATHS = ("/v1/chat/completions", "/v1/completions")


@dataclass
class RouterConfig:
    prefill_urls: list[str]
    decode_urls: list[str]
    # Bound on a prefill answer and on a decode answer's silence (a long queue is not a hang:
    # the health checks catch hangs much sooner).
    prefill_timeout_s: float = 600.0
    decode_timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    health_interval_s: float = 1.0
    health_timeout_s: float = 2.0
    unhealthy_after: int = 3
    extra: dict[str, Any] = field(default_factory=dict)


def _error(status: int, message: str, kind: str = "server_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}},
                        status_code=status)


class _RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvserve_router:requests", "Requests routed, by outcome.", ["outcome"], registry=r)
        self.prefill_seconds = Histogram("kvserve_router:prefill_seconds",
                                         "Time of the prefill instance's answer (prompt, first token, KV published).",
                                         registry=r, buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64))
        self.healthy = Gauge("kvserve_router:instance_healthy", "1 while an instance passes its health checks.",
                             ["role", "url"], registry=r)


def create_router_app(config: RouterConfig) -> FastAPI:
    pool = InstancePool(config.prefill_urls, config.decode_urls, config.unhealthy_after)
    metrics = _RouterMetrics()
    timeouts = httpx.Timeout(config.prefill_timeout_s, connect=config.connect_timeout_s)
    state: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        state["client"] = httpx.AsyncClient(timeout=timeouts, limits=httpx.Limits(max_connections=None,
                                                                                  max_keepalive_connections=64))
        monitor = asyncio.ensure_future(_health_loop(pool, state["client"], config, metrics))
        yield
        monitor.cancel()
        await state["client"].aclose()

    app = FastAPI(title="kvserve router", lifespan=lifespan)
    app.state.pool = pool

    @app.get("/health")
    async def health() -> Response:
        missing = [role for role in ("prefill", "decode") if pool.pick(role) is None]
        if missing:
            return _error(503, f"no healthy {' or '.join(missing)} instance")
        return JSONResponse({"status": "ok", "instances": [
            {"role": i.role, "url": i.url, "healthy": i.healthy} for i in pool.instances]})

    @app.get("/metrics")
    async def router_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(raw: Request) -> Response:
        instance = pool.pick("decode")
        if instance is None:
            return _error(503, "no healthy decode instance")
        try:
            resp = await state["client"].get(instance.url + "/v1/models", headers=_forwarded(raw))
        except httpx.HTTPError as exc:
            return _error(503, f"decode instance {instance.url} is unreachable ({exc})")
        return Response(resp.content, status_code=resp.status_code, media_type="application/json")

    async def route(path: str, raw: Request) -> Response:
        try:
            body = await raw.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "the request body is not JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "invalid_request_error")
        if body.get("n") not in (None, 1):
            return _error(400, "a disaggregated deployment serves n = 1 only", "invalid_request_error")
        response = await _route(path, body, raw, pool, state["client"], config, metrics)
        return response

    def handler_for(path: str):
        async def handler(raw: Request) -> Response:
            return await route(path, raw)
        return handler

    for path in ROUTED_PATHS:
        app.add_api_route(path, handler_for(path), methods=["POST"])
    return app


def _forwarded(raw: Request) -> dict[str, str]:
    auth = raw.headers.get("authorization")
    return {"authorization": auth} if auth else {}


async def _wait_for_disconnect(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


async def _race(coro, instance: Instance, raw: Request):
    """Await ``coro`` unless the client goes away (None) or ``instance`` is found down
    (InstanceDown); the loser is cancelled, which closes its upstream connection."""
    down: asyncio.Future = asyncio.get_running_loop().create_future()
    instance.waiters.add(down)
    instance.in_flight += 1
    work = asyncio.ensure_future(coro)
    gone = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        done, _ = await asyncio.wait({work, gone, down}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        if down in done:
            down.result()  # raises InstanceDown
        return None  # the client went away
    finally:
        instance.in_flight -= 1
        instance.waiters.discard(down)
        for task in (work, gone):
            if not task.done():
                task.cancel()
        if not down.done():
            down.cancel()
        elif not down.cancelled():
            down.exception()  # retrieved: no "never retrieved" warning


async def _release(client: httpx.AsyncClient, prefill: Instance, params: dict, headers: dict) -> None:
    """Best effort: the transfer expires on the prefill side anyway."""
    if params.get("transfer_id") is None:
        return
    try:
        await client.post(prefill.url + "/v1/kv_transfer/release", json={"transfer_id": params["transfer_id"]},
                          headers=headers, timeout=5.0)
    except httpx.HTTPError:
        pass


async def _route(path: str, body: dict, raw: Request, pool: InstancePool, client: httpx.AsyncClient,
                 config: RouterConfig, metrics: _RouterMetrics) -> Response:
    headers = _forwarded(raw)
    prefill = pool.pick("prefill")
    if prefill is None:
        metrics.requests.labels("no_prefill").inc()
        return _error(503, "no healthy prefill instance: "
                           + "; ".join(f"{i.url}: {i.down_reason}" for i in pool.of_role("prefill")))
    prefill_body = {**body, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    prefill_body.pop("stream_options", None)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    try:
        answer = await _race(client.post(prefill.url + path, json=prefill_body, headers=headers), prefill, raw)
    except InstanceDown as exc:
        metrics.requests.labels("prefill_failed").inc()
        return _error(503, f"prefill failed: {exc}")
    except httpx.HTTPError as exc:
        metrics.requests.labels("prefill_failed").inc()
        return _error(503, f"prefill failed: the prefill instance {prefill.url} did not answer "
                           f"({type(exc).__name__}: {exc})")
    if answer is None:
        metrics.requests.labels("client_gone").inc()
        return Response(status_code=499)
    metrics.prefill_seconds.observe(loop.time() - t0)
    if answer.status_code != 200:  # the request itself is refused (400...): the client's answer
        metrics.requests.labels("prefill_refused").inc()
        return Response(answer.content, status_code=answer.status_code, media_type="application/json")
    try:
        params = answer.json().get("kv_transfer_params")
    except ValueError:
        params = None
    if not isinstance(params, dict):
        metrics.requests.labels("prefill_failed").inc()
        return _error(502, f"the prefill instance {prefill.url} answered without kv_transfer_params "
                           f"(is it serving with --disaggregation-mode prefill?)")
    decode = pool.pick("decode")
    if decode is None:
        await _release(client, prefill, params, headers)
        metrics.requests.labels("no_decode").inc()
        return _error(503, "no healthy decode instance")
    decode_body = {**body, "kv_transfer_params": params}
    stream = bool(body.get("stream"))
    request = client.build_request("POST", decode.url + path, json=decode_body, headers=headers,
                                   timeout=httpx.Timeout(config.decode_timeout_s, connect=config.connect_timeout_s))
    try:
        upstream = await _race(client.send(request, stream=stream), decode, raw)
    except (InstanceDown, httpx.HTTPError) as exc:
        await _release(client, prefill, params, headers)
        metrics.requests.labels("decode_failed").inc()
        return _error(503, f"decode failed: the decode instance {decode.url} did not answer ({exc})")
    if upstream is None:
        # The client went away while the decode instance took the request: that instance aborts
        # it (and drops its transfer) if it had it; if it had not, the prefill side must.
        await _release(client, prefill, params, headers)
        metrics.requests.labels("client_gone").inc()
        return Response(status_code=499)
    if not stream or upstream.status_code != 200:
        content = await upstream.aread() if stream else upstream.content
        if stream:
            await upstream.aclose()
        metrics.requests.labels("ok" if upstream.status_code == 200 else "decode_refused").inc()
        return Response(content, status_code=upstream.status_code, media_type="application/json")
    metrics.requests.labels("ok").inc()
    decode.in_flight += 1

    async def relay():
        # Closing the upstream response (however this ends: done, or the client gone and the
        # iteration cancelled) closes its connection: the decode instance aborts the request.
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            message = {"error": {"message": f"decode instance {decode.url} failed mid-stream ({exc})",
                                 "type": "server_error"}}
            yield f"data: {json.dumps(message)}\n\ndata: [DONE]\n\n".encode()
        finally:
            decode.in_flight -= 1
            await upstream.aclose()

    return StreamingResponse(relay(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _health_loop(pool: InstancePool, client: httpx.AsyncClient, config: RouterConfig,
                       metrics: _RouterMetrics) -> None:
    while True:
        await asyncio.gather(*(_check(pool, i, client, config, metrics) for i in pool.instances))
        await asyncio.sleep(config.health_interval_s)


async def _check(pool: InstancePool, instance: Instance, client: httpx.AsyncClient, config: RouterConfig,
                 metrics: _RouterMetrics) -> None:
    try:
        resp = await client.get(instance.url + "/health", timeout=config.health_timeout_s)
        ok, reason, unreachable = resp.status_code == 200, f"/health answered {resp.status_code}", False
    except httpx.ConnectError as exc:
        ok, reason, unreachable = False, f"unreachable ({exc})", True
    except httpx.HTTPError as exc:
        ok, reason, unreachable = False, f"no health answer within {config.health_timeout_s:.0f} s ({type(exc).__name__})", False
    if ok:
        if not instance.healthy:
            logger.warning("%s instance %s is back", instance.role, instance.url)
        pool.check_passed(instance)
    elif pool.check_failed(instance, reason, unreachable):
        logger.error("%s instance %s is down: %s", instance.role, instance.url, reason)
    metrics.healthy.labels(instance.role, instance.url).set(1 if instance.healthy else 0)


def run_router(config: RouterConfig, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    import uvicorn

    logger.setLevel(log_level.upper())
    logger.info("routing to prefill %s, decode %s; serving on http://%s:%d/v1",
                config.prefill_urls, config.decode_urls, host, port)
    uvicorn.run(create_router_app(config), host=host, port=port, log_level=log_level.lower())
