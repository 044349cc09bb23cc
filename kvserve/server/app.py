"""The OpenAI-compatible HTTP server: FastAPI app, API-key check, and ``run_server``."""
from __future__ import annotations

import contextlib
import gc
import ipaddress
import logging
import secrets
from pathlib import Path
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi_offline import FastAPIOffline

from kvserve.config import ConfigError
from kvserve.server.chat import create_chat_completion
from kvserve.server.completions import create_completion
from kvserve.server.embeddings import create_embeddings
from kvserve.server.errors import bad_request, error_body, install_error_handlers
from kvserve.server.metrics import ServerMetrics
from kvserve.server.protocol import (ChatCompletionRequest, ChatCompletionResponse,
                                     CompletionRequest, CompletionResponse, DetokenizeRequest,
                                     DetokenizeResponse, EmbeddingRequest, EmbeddingResponse,
                                     ErrorResponse, KVTransferRelease, ModelCard, ModelList,
                                     MAX_TOKENS_MARK, TOKEN_ID_MARK, TOKEN_KEY_MARK, TokenizeRequest, TokenizeResponse)
from kvserve.server.response_store import DEFAULT_CAPACITY, ResponseStore
from kvserve.server.responses import create_response, get_response
from kvserve.server.responses_protocol import ResponsesRequest
from kvserve.server.serving import ServingContext, check_text
from kvserve.server.shutdown import DrainingServer, DrainMiddleware, DrainState
from kvserve.server.streams import AdmissionGate
from kvserve.server.webpage import install_page

logger = logging.getLogger("kvserve")

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 429, 500)}
# A streamed answer: server-sent events whose data is one JSON chunk (or "[DONE]").
_SSE = {"text/event-stream": {"schema": {
    "type": "object", "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "required": ["data"]}}}


class APIKeyMiddleware:
    """Bearer-token check on /v1/*, answered before the body is read (so a client without
    the key learns that first, whatever it sent). Plain ASGI: it must not wrap ``receive``,
    which streaming responses use to notice a client going away."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/") \
                or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if secrets.compare_digest(given, self._expected):
            return await self.app(scope, receive, send)
        message = ("missing API key: send it as 'Authorization: Bearer <key>'" if not given
                   else "incorrect API key")
        response = JSONResponse(error_body(message, code="invalid_api_key"), status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


def create_app(async_engine, served_model_name: str, api_key: Optional[str] = None,
               max_waiting_requests: Optional[int] = None,
               allowed_origins: Optional[list[str]] = None,
               response_store_size: int = DEFAULT_CAPACITY):
    """The ASGI app serving ``async_engine`` (an AsyncLLMEngine) under ``served_model_name``.
    The engine loop is started with the app; stopping it is the caller's business, since
    several apps may share one engine. ``allowed_origins``: the browser origins allowed to
    call it (CORS; "*" for any). ``response_store_size``: how many /v1/responses results are
    kept in memory for ``previous_response_id`` (least recently used first out).
    ``app.state.drain`` is what graceful shutdown drains."""
    metrics = ServerMetrics(async_engine.stats)
    gate = None
    if max_waiting_requests is not None:
        gate = AdmissionGate(max_waiting_requests,
                             engine_waiting=lambda: async_engine.num_waiting)
    ctx = ServingContext(async_engine, served_model_name, metrics, gate)
    response_store = ResponseStore(response_store_size)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        async_engine.start()
        yield

    # /docs and /redoc from assets shipped in a package (fastapi-offline), not a CDN: the page
    # works on a machine with no internet, as a server here usually is.
    app = FastAPIOffline(title="kvserve", version="0.1.0", lifespan=lifespan,
                         description="OpenAI-compatible API of the kvserve inference engine.")
    app.state.ctx = ctx
    install_error_handlers(app, on_server_rejection=metrics.count_server_rejection,
                           counted_paths=GENERATION_PATHS)

    from kvserve.async_engine import EngineDeadError

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        # The model is gone (a parallel worker died or hung): unavailable, not a bad request.
        return JSONResponse(error_body(str(exc), type="server_error"), status_code=503)

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.is_running:
            return JSONResponse(error_body("the engine loop is not running", type="server_error"),
                                status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus_metrics() -> Response:
        # Engine stats are the engine thread's last snapshot: no lock, no wait for a step
        # (and not in a worker thread, which may all be waiting for the lock to tokenize).
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> ModelCard:
        return ModelCard(id=served_model_name, max_model_len=ctx.max_model_len,
                         chat_template=async_engine.engine.tokenizer.has_chat_template)

    @app.post("/v1/kv_transfer/release", responses=_ERRORS)
    async def release_kv_transfer(body: KVTransferRelease) -> JSONResponse:
        # A prefill instance's published KV whose decode side will not come (the router's
        # client went away in between): staged bytes go now rather than at expiry. The staging
        # area has its own lock: no wait for the engine's step.
        return JSONResponse({"released": async_engine.engine.release_transfer(body.transfer_id)})

    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> ModelList:
        return ModelList(data=[model_card()])

    @app.get("/v1/models/{model:path}", response_model=ModelCard, responses=_ERRORS)
    async def get_model(model: str) -> ModelCard:
        ctx.check_model(model)
        return model_card()

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses={**_ERRORS, 200: {"content": _SSE}})
    async def completions(body: CompletionRequest, raw_request: Request):
        return await create_completion(ctx, body, raw_request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses={**_ERRORS, 200: {"content": _SSE}})
    async def chat_completions(body: ChatCompletionRequest, raw_request: Request):
        return await create_chat_completion(ctx, body, raw_request)

    @app.post("/v1/responses", responses={**_ERRORS, 200: {"content": {
        "application/json": {"schema": {"type": "object"}}, **_SSE}}})
    async def responses(body: ResponsesRequest, raw_request: Request):
        return await create_response(ctx, response_store, body, raw_request)

    @app.get("/v1/responses/{response_id}", responses=_ERRORS)
    async def retrieve_response(response_id: str) -> JSONResponse:
        return JSONResponse(await get_response(response_store, response_id))

    @app.post("/v1/embeddings", response_model=EmbeddingResponse, responses=_ERRORS)
    async def embeddings(body: EmbeddingRequest) -> EmbeddingResponse:
        return await create_embeddings(ctx, body)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt or messages")
        if body.prompt is not None:
            check_text(body.prompt, "prompt")
            tokens = await ctx.in_engine(lambda engine: engine.tokenizer.encode(
                body.prompt, add_special_tokens=body.add_special_tokens))
        else:
            tokens = await ctx.chat_prompt_ids(body.messages, body.add_generation_prompt)
        return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=ctx.max_model_len)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        ctx.check_model(body.model)
        return DetokenizeResponse(prompt=await ctx.decode(body.tokens))

    install_page(app)

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = served_spec(get_openapi(
                title=app.title, version=app.version, description=app.description,
                routes=app.routes), ctx.vocab_size, ctx.max_model_len)
        return app.openapi_schema

    app.openapi = openapi
    # The last added is the outermost: CORS answers a preflight before the key is asked for,
    # and its headers reach a browser on every answer (a 401 or a 503 included).
    app.state.drain = DrainState()
    app.add_middleware(DrainMiddleware, state=app.state.drain)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"],
                           allow_headers=["*"], allow_credentials="*" not in allowed_origins)
    return app


def load_chat_template(value: str) -> str:
    """``--chat-template``: a file's text, or the template itself (vLLM's flag)."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" not in value and "{%" not in value:
        raise ConfigError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    return value


def served_spec(spec: dict, vocab_size: int, max_model_len: int) -> dict:
    """The OpenAPI spec with what only the running server knows: token ids are below the
    vocabulary size and generation lengths below the context (the server refuses others with
    a 400); bounds pydantic left as raw
    ge/le keys are written as JSON Schema keywords."""
    keywords = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum"}

    def walk(node):
        if isinstance(node, dict):
            if node.get("type") in ("integer", "number"):
                for raw, keyword in keywords.items():
                    if raw in node:
                        node[keyword] = node.pop(raw)
            if node.pop(TOKEN_ID_MARK, False):
                node["maximum"] = vocab_size - 1
            if node.pop(MAX_TOKENS_MARK, False):  # on an Optional field: the integer branch
                for branch in node.get("anyOf", [node]):
                    if branch.get("type") == "integer":
                        branch["maximum"] = max_model_len - 1
            if node.pop(TOKEN_KEY_MARK, False):
                node["pattern"] = decimal_below_pattern(vocab_size)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
    walk(spec)
    return spec


def decimal_below_pattern(limit: int) -> str:
    """A regex matching the decimal integers 0 .. limit - 1, without leading zeros (a token id
    written as a JSON object key, where no minimum/maximum applies)."""
    top = str(limit - 1)
    alternatives = ["0"] if len(top) > 1 else []
    if len(top) > 2:
        alternatives.append(f"[1-9][0-9]{{0,{len(top) - 2}}}")
    elif len(top) == 2:
        alternatives.append("[1-9]")
    # Numbers as long as ``top`` and at most it: agree on a prefix, then a smaller digit.
    for i, digit in enumerate(top):
        low = "1" if i == 0 and len(top) > 1 else "0"
        if digit > low:
            high = str(int(digit) - 1)
            rest = len(top) - i - 1
            alternatives.append(top[:i] + (f"[{low}-{high}]" if high != low else low)
                                + (f"[0-9]{{{rest}}}" if rest else ""))
    alternatives.append(top)
    return "^(" + "|".join(alternatives) + ")$"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run_server(eargs, host: str = "127.0.0.1", port: int = 8000, api_key: Optional[str] = None,
               served_model_name: Optional[str] = None, log_level: str = "info",
               shutdown_timeout: float = 30.0, allowed_origins: Optional[list[str]] = None,
               chat_template: Optional[str] = None) -> None:
    """Build the engine from ``eargs`` (EngineArgs) and serve it until interrupted (SIGTERM or
    Ctrl-C: a graceful shutdown of up to ``shutdown_timeout`` seconds, server/shutdown.py)."""
    import uvicorn

    from kvserve.async_engine import AsyncLLMEngine
    from kvserve.engine import LLMEngine

    logger.setLevel(log_level.upper())
    template = load_chat_template(chat_template) if chat_template is not None else None
    engine = LLMEngine(eargs)
    logger.info("loaded %s in %.1f s; %s; %s; %s", eargs.model, engine.load_time_s,
                engine.describe_kv_cache(), engine.describe_kernels(), engine.describe_memory())
    if template is not None:
        engine.tokenizer.hf.chat_template = template
    if not engine.tokenizer.has_chat_template:
        logger.warning("%s has no chat template: /v1/chat/completions and /v1/responses will "
                       "answer 400 (serve it with --chat-template FILE|STRING); /v1/completions "
                       "and /v1/embeddings work, and the page at / sends plain prompts",
                       eargs.model)
    # What the load made lives as long as the server: out of the cyclic collector's way, a full
    # collection while serving walks only what serving made (Gemma 3's ~370k startup objects
    # took 0.15-0.27 s per full collection: a stall of every stream).
    gc.freeze()
    server: Optional[uvicorn.Server] = None

    def on_dead(reason: str) -> None:
        # In-flight requests have their error; stop serving (uvicorn drains for up to 5 s).
        logger.error("engine stopped (%s); shutting the server down", reason)
        if server is not None:
            server.should_exit = True

    async_engine = AsyncLLMEngine(engine, on_dead=on_dead)
    async_engine.start()
    try:
        app = create_app(async_engine, served_model_name or eargs.model, api_key=api_key,
                         max_waiting_requests=eargs.max_waiting_requests,
                         allowed_origins=allowed_origins)
        if not api_key and not _is_loopback(host):
            logger.warning("serving on %s without --api-key: anyone who can reach this port "
                           "can use the model", host)
        logger.info("serving %s on http://%s:%d/v1 (OpenAPI spec at /openapi.json)",
                    served_model_name or eargs.model, host, port)
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(),
                                timeout_graceful_shutdown=5)
        server = DrainingServer(config, app.state.drain, shutdown_timeout, async_engine.abort_all)
        server.run()
    finally:
        async_engine.shutdown_engine()
    if async_engine.dead_reason is not None:
        raise EngineStopped(async_engine.dead_reason)


class EngineStopped(RuntimeError):
    """The server stopped because the engine could not run any more (the CLI exits 1)."""


__all__ = ["create_app", "run_server", "EngineStopped"]
