"""OpenAI-style error bodies, and the handlers that turn every failure into one.

Every error the server returns has the shape OpenAI clients parse:
``{"error": {"message", "type", "param", "code"}}``.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.request import EngineBusy, RequestRejected

logger = logging.getLogger("kvserve")

RETRY_AFTER_SECONDS = 1


class APIError(Exception):
    """An error answered with an OpenAI error body; raise it anywhere in a handler."""

    def __init__(self, status_code: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def error_body(message: str, type: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_rejection(exc: RequestRejected) -> APIError:
    if isinstance(exc, EngineBusy):
        return APIError(429, str(exc), type="rate_limit_error", code="rate_limit_exceeded",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    return bad_request(str(exc))


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}

# What to use instead, for parameters other servers take under another name.
_INSTEAD = {
    **{f"guided_{kind}": "structured_outputs" for kind in ("json", "regex", "choice", "grammar", "json_object",
                                                           "decoding_backend", "whitespace_pattern")},
    "functions": "tools", "function_call": "tool_choice",
}


def _unknown_parameter(path: str) -> str:
    instead = _INSTEAD.get(path.rsplit(".", 1)[-1])
    return (f"Unrecognized request argument supplied: {path} (kvserve does not implement it, and "
            f"refuses rather than ignores a parameter{'; use ' + instead if instead else ''})")


def _describe_validation_error(err: dict) -> tuple[str, Optional[str]]:
    """One readable line and the offending parameter for one pydantic error."""
    if err.get("type") == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "")
        return f"malformed JSON body{': ' + detail if detail else ''}", None
    # loc is ("body", field, index, ...); union members append their type ("str",
    # "list[int]", "ContentPart"), which means nothing to a client: the path stops there.
    loc = list(err.get("loc", ()))[1:]
    parts = []
    for p in loc:
        if isinstance(p, str) and (p in _TYPE_TAGS or not p.isidentifier() or p[:1].isupper()):
            break
        parts.append(str(p))
    if err.get("type") == "extra_forbidden" and loc:
        # The unknown key itself, whatever it looks like ("max-tokens", "Temperature").
        if len(parts) == len(loc):
            parts = parts[:-1]
        path = ".".join(parts + [str(loc[-1])])
        return _unknown_parameter(path), path
    path = ".".join(parts)
    message = err.get("msg", "invalid value")
    if err.get("type") in ("string_too_short", "too_short") and \
            (err.get("ctx") or {}).get("min_length") == 1 and path:
        return f"{path} is empty ({message.split(' after validation')[0].lower()})", path
    if not loc:
        message = f"the request body must be a JSON object (Content-Type: application/json): {message}"
    return (f"{path}: {message}" if path else message), (path or None)


def _drop_other_union_branches(errors: list[dict]) -> list[dict]:
    """A value of a union type that fails gets one error per member. Where the value had a
    member's type but broke its constraints (an empty string for a string-or-list prompt),
    that error is the one to report, not "should be a list" from the other members."""
    def field(err: dict) -> tuple:
        return tuple(p for p in err.get("loc", ()) if not (isinstance(p, str) and (
            p in _TYPE_TAGS or not p.isidentifier() or p[:1].isupper() or "[" in p)))

    constraint_fields = {field(e) for e in errors if not str(e.get("type", "")).endswith("_type")}
    kept = [e for e in errors
            if not (str(e.get("type", "")).endswith("_type") and field(e) in constraint_fields)]
    return kept or errors


def install_error_handlers(app: FastAPI, on_server_rejection: Optional[Callable[[], None]] = None,
                           counted_paths: tuple[str, ...] = ()) -> None:
    """``on_server_rejection`` is called for each request on ``counted_paths`` that the
    server refuses itself (the engine counts the refusals it makes)."""

    def count(request: Request, status_code: int) -> None:
        if on_server_rejection is not None and 400 <= status_code < 500 \
                and request.url.path in counted_paths:
            on_server_rejection()

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        count(request, exc.status_code)
        return exc.response()

    @app.exception_handler(RequestRejected)
    async def _rejected(_: Request, exc: RequestRejected) -> JSONResponse:
        return from_rejection(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        count(request, 400)
        # OpenAI answers bad parameters with 400, not FastAPI's 422.
        errors = list(exc.errors())
        # An unknown key is the one to name: in a union (tool_choice) the other members'
        # complaints about the same value say nothing useful.
        errors = [e for e in errors if e.get("type") == "extra_forbidden"] or _drop_other_union_branches(errors)
        described = [_describe_validation_error(e) for e in errors] or [("invalid request", None)]
        message = "; ".join(dict.fromkeys(m for m, _ in described))
        return bad_request(message, param=described[0][1]).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = "not_found" if exc.status_code == 404 else None
        message = str(exc.detail)
        if exc.status_code == 400 and message == "There was an error parsing the body":
            # FastAPI's answer to a body that is not even text, e.g. invalid UTF-8.
            message = "could not parse the request body: it must be UTF-8 encoded JSON"
        count(request, exc.status_code)
        return APIError(exc.status_code, message, type=kind, code=code,
                        headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error while serving a request")
        return APIError(500, f"internal server error: {type(exc).__name__}: {exc}",
                        type="server_error").response()
