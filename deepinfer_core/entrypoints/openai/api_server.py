"""``deepinfer serve``: the OpenAI-compatible HTTP server (FastAPI on uvicorn) over an AsyncLLM.

Routes: ``/v1/completions``, ``/v1/chat/completions`` (JSON or server-sent events), ``/v1/models``,
``/health``, ``/metrics`` (Prometheus), ``/version``. Errors use OpenAI's shape. With an API key every
route but ``/health`` and ``/metrics`` (open as vLLM's are, unless asked otherwise) needs
``Authorization: Bearer KEY``. A request body over ``max_request_body_bytes`` is answered 413 unread.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hmac
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from starlette.routing import Match, Router

from deepinfer_core.entrypoints.async_llm import AsyncLLM
from deepinfer_core.entrypoints.openai.metrics import ServerMetrics
from deepinfer_core.entrypoints.openai.protocol import APIError, ChatCompletionRequest, CompletionRequest
from deepinfer_core.entrypoints.openai.serving import OpenAIServing

logger = logging.getLogger(__name__)
OPEN_ROUTES = ("/health",)  # never need the API key; /metrics too unless require_api_key_for_metrics
UNCOUNTED_ROUTES = ("/health", "/metrics")  # probes and scrapes: not in deepinfer_requests (vLLM leaves them out)
UNMATCHED_ROUTE = "unmatched"  # the route label of every path no route takes, so unknown paths add one series
# 16 MiB: room for the longest context DeepSeek supports (1M tokens) as text or as a JSON list of token ids
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 << 20


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        parts.append(f"{loc or 'body'}: {err.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts)


def route_template(router: Router, scope: Any) -> str:
    """The path template of the route that takes ``scope`` (``/v1/models/{model_id:path}``), whatever the
    method; ``UNMATCHED_ROUTE`` for a path no route takes."""
    partial = None
    for route in router.routes:
        match, _ = route.matches(scope)
        if match == Match.FULL:
            return route.path
        if match == Match.PARTIAL and partial is None:
            partial = route.path
    return partial or UNMATCHED_ROUTE


class _AuthAndCount:
    """ASGI middleware: the bearer key on every route but the open ones, and a count of responses by route
    template and code. (Plain ASGI rather than BaseHTTPMiddleware, so streaming and disconnect detection
    pass through.)"""

    def __init__(self, app: Any, api_key: str | None, metrics: ServerMetrics, router: Router,
                 open_routes: tuple[str, ...]):
        self.app, self.metrics, self.router, self.open_routes = app, metrics, router, open_routes
        self.expected = f"Bearer {api_key}".encode() if api_key is not None else None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = route_template(self.router, scope)
        code = []

        async def counted_send(message: Any) -> None:
            if message["type"] == "http.response.start":
                code.append(message["status"])
            await send(message)

        try:
            if self.expected is not None and route not in self.open_routes:
                given = dict(scope.get("headers") or []).get(b"authorization", b"")
                if not hmac.compare_digest(given, self.expected):
                    exc = APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                   code="invalid_api_key")
                    await JSONResponse(exc.body(), status_code=401)(scope, receive, counted_send)
                    return
            await self.app(scope, receive, counted_send)
        finally:
            if route not in UNCOUNTED_ROUTES:
                self.metrics.requests.labels(route, str(code[0] if code else 499)).inc()


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than this server's limit of {limit} bytes "
                         "(deepinfer serve --max-request-body-bytes)", code="request_too_large")


class _LimitBody:
    """ASGI middleware: a body over ``limit`` bytes is answered 413. A declared ``Content-Length`` over it
    is refused before any of the body is read; a body without one (chunked) is counted as it arrives and
    refused once it passes the limit (the HTTPException goes to the app's handler, as the route reads it)."""

    def __init__(self, app: Any, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await JSONResponse(_too_large(self.limit).body(), status_code=413)(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Any:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise StarletteHTTPException(413, _too_large(self.limit).message)
            return message

        await self.app(scope, limited_receive, send)


def build_app(async_llm: AsyncLLM, model_name: str, api_key: str | None = None, default_thinking: bool = False,
              max_model_len: int | None = None,
              max_request_body_bytes: int | None = DEFAULT_MAX_REQUEST_BODY_BYTES,
              require_api_key_for_metrics: bool = False) -> FastAPI:
    """The ASGI app; starts the engine thread on startup and stops it on shutdown.

    ``max_request_body_bytes``: larger bodies get 413 (None: no limit). ``/metrics`` is open, as vLLM's is,
    unless ``require_api_key_for_metrics``."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_llm.start()
        yield
        async_llm.shutdown()

    app = FastAPI(title="deepinfer", lifespan=lifespan)
    metrics = ServerMetrics(async_llm, model_name, max_model_len)
    serving = OpenAIServing(async_llm, [model_name], metrics, default_thinking)
    app.state.async_llm, app.state.metrics, app.state.serving = async_llm, metrics, serving
    created = int(time.time())

    def error(exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return error(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error(APIError(400, _validation_message(exc)))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error(APIError(exc.status_code, str(exc.detail)))

    if max_request_body_bytes is not None:
        app.add_middleware(_LimitBody, limit=max_request_body_bytes)
    open_routes = OPEN_ROUTES if require_api_key_for_metrics else (*OPEN_ROUTES, "/metrics")
    # added last, so outermost: the key is checked before any body is read, and a 413 is counted
    app.add_middleware(_AuthAndCount, api_key=api_key, metrics=metrics, router=app.router, open_routes=open_routes)

    @app.get("/health")
    async def health() -> Response:
        if async_llm.dead_reason is not None:
            return error(APIError(503, async_llm.dead_reason, code="engine_dead"))
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict[str, str]:
        from deepinfer_core import __version__

        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "deepinfer",
                "root": model_name, "max_model_len": max_model_len}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        serving.check_model(model_id)
        return model_card()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        return await serving.create_completion(req, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        return await serving.create_chat_completion(req, request)

    return app


# --- the command line ------------------------------------------------------------------------------


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    from deepinfer_core.entrypoints.cli_generate import add_engine_arguments

    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="checkpoint folder (same as --model; default: the embedded tiny model)")
    s = parser.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    s.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health and /metrics")
    s.add_argument("--require-api-key-for-metrics", action="store_true",
                   help="/metrics needs the API key too (default: open, as vLLM's is)")
    s.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES, metavar="N",
                   help="larger request bodies are answered 413 (default: 16 MiB)")
    s.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the model path, or deepseek-v41-tiny)")
    s.add_argument("--max-pending-requests", type=int, default=1024, metavar="N",
                   help="sequences queued or running at once, a request counting its n; more are answered "
                        "429 (default: 1024)")
    s.add_argument("--default-thinking", action="store_true",
                   help="chat requests think unless they turn it off (default: chat mode)")
    s.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    add_engine_arguments(parser)
    e = parser.add_argument_group("engine (more)")
    e.add_argument("--seed", type=int, default=None, help="engine seed for requests without one (default: 0)")
    e.add_argument("--batch-invariant", action="store_true", help="same outputs alone or in any batch")
    e.add_argument("--async-scheduling", action="store_true", help="schedule step N+1 while N runs")
    e.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    e.add_argument("--quantization", default=None, choices=("fp8",), help="weight quantization")


def serve_engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineArgs keywords for ``args`` (``UsageError`` for a bad value)."""
    from deepinfer_core.entrypoints.cli_generate import UsageError, engine_kwargs

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise UsageError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    kwargs = engine_kwargs(args)
    if args.seed is not None:
        kwargs["seed"] = args.seed
    for flag in ("batch_invariant", "async_scheduling", "enforce_eager"):
        if getattr(args, flag):
            kwargs[flag] = True
    if args.quantization is not None:
        kwargs["quantization"] = args.quantization
    return kwargs


def default_model_name(model: Any) -> str:
    if model is None:
        from deepinfer_core.default_model import default_model_path

        return default_model_path().name
    return str(model)


def run_serve(args: argparse.Namespace) -> int:
    from deepinfer_core.entrypoints.cli_generate import UsageError, fail

    try:
        kwargs = serve_engine_kwargs(args)
        if not 0 < args.port < 65536:
            raise UsageError(f"--port must be in 1..65535, got {args.port}")
        if args.max_pending_requests < 1:
            raise UsageError(f"--max-pending-requests must be >= 1, got {args.max_pending_requests}")
        if args.max_request_body_bytes < 1:
            raise UsageError(f"--max-request-body-bytes must be >= 1, got {args.max_request_body_bytes}")
    except UsageError as exc:
        return fail("serve", str(exc))
    import uvicorn

    from deepinfer_core.engine.args import EngineArgs
    from deepinfer_core.engine.factory import make_engine
    from deepinfer_core.plugins import PluginError

    try:
        engine = make_engine(EngineArgs(**kwargs))
    except (ValueError, TypeError, FileNotFoundError, PluginError) as exc:
        return fail("serve", f"cannot build the engine: {exc}")
    if engine.tokenizer is None:
        logger.warning("the model has no tokenizer: only token-id prompts to /v1/completions will work")
    name = args.served_model_name or default_model_name(kwargs.get("model"))
    max_len = getattr(getattr(engine, "scheduler_config", None), "max_model_len", None)
    async_llm = AsyncLLM(engine, max_pending_requests=args.max_pending_requests)
    app = build_app(async_llm, name, api_key=args.api_key, default_thinking=args.default_thinking,
                    max_model_len=max_len, max_request_body_bytes=args.max_request_body_bytes,
                    require_api_key_for_metrics=args.require_api_key_for_metrics)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("binding to %s: the server is reachable from other machines%s", args.host,
                       "" if args.api_key else " and has no --api-key")
    print(f"deepinfer serve: {name} on http://{args.host}:{args.port}/v1", flush=True)
    # the engine's startup heap (weights, graphs, pools) lives as long as the server: keep the collector's full
    # passes, which would walk it inside a step, to what requests allocate (as vLLM does)
    gc.collect()
    gc.freeze()
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
