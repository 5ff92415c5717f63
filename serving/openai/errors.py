"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with an HTTP status.

The router's gRPC status decides the HTTP one: INVALID_ARGUMENT -> 400, UNAUTHENTICATED ->
401 (the router's bearer token is the API key), RESOURCE_EXHAUSTED -> 429, UNAVAILABLE (the
router loading, draining or unreachable) -> 503, DEADLINE_EXCEEDED -> 504, anything else ->
500. A request body pydantic refuses is 400 with the field as `param` (not FastAPI's 422); the
framework's own answers (404 no route, 405, malformed JSON, 413 from edge.BodyLimit) and an
unexpected failure (500) have the same shape. A router's UNAVAILABLE text loses any address in it
(a channel's "failed to connect to ... 10.0.0.5:50051"): no internal address reaches a client.
Once a stream has started (HTTP 200 sent), an error goes out as one SSE event holding the
same JSON (what OpenAI's clients raise from).
"""

from __future__ import annotations

import re

import grpc
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from serving.openai.schemas import ErrorBody, ErrorResponse

# gRPC status -> (HTTP status, OpenAI error type, code)
_BY_GRPC = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error", None),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable", "router_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout", "deadline_exceeded"),
}
# an address in a channel's error text: ipv4:/ipv6:/unix: targets, [v6]:port, host:port
_ADDRESS = re.compile(r"(?:ipv4:|ipv6:|unix:|dns:/*)\S+|\[[0-9A-Fa-f:.]+\](?::\d+)?|\b[\w.-]+:\d{2,5}\b")


class OpenAIError(Exception):
    """An answer to send as OpenAI's error JSON with `status`."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorBody(message=self.message, type=self.type, param=self.param, code=self.code))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status)


def invalid(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param)


def from_rpc(e: grpc.aio.AioRpcError) -> OpenAIError:
    """The router's failure as the OpenAI error a client should see."""
    status, type_, code = _BY_GRPC.get(e.code(), (500, "server_error", None))
    message = e.details() or e.code().name.lower()
    if e.code() == grpc.StatusCode.UNAVAILABLE:
        message = f"the router is unavailable: {_ADDRESS.sub('<address>', message)}"
    return OpenAIError(status, message, type_, None, code or e.code().name.lower())


async def on_openai_error(request: Request, e: OpenAIError) -> JSONResponse:
    return e.response()


async def on_validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
    """pydantic's first complaint about the body, as one sentence naming the field."""
    errs = e.errors()
    if not errs:
        return invalid("the request body is not valid").response()
    first = errs[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    what = f"{param}: " if param else ""
    return invalid(f"{what}{first.get('msg', 'invalid value')}", param).response()


_TYPES = {401: "authentication_error", 403: "permission_error", 404: "invalid_request_error",
          429: "rate_limit_error"}


async def on_http_error(request: Request, e: HTTPException) -> JSONResponse:
    """The framework's own refusals (404 no route, 405 wrong method, ...) in OpenAI's shape."""
    if e.status_code == 404:
        message, code = f"no route {request.method} {request.url.path}", "not_found"
    elif e.status_code == 405:
        message, code = f"{request.method} is not allowed on {request.url.path}", "method_not_allowed"
    else:
        message, code = str(e.detail), None
    type_ = _TYPES.get(e.status_code, "server_error" if e.status_code >= 500 else "invalid_request_error")
    resp = OpenAIError(e.status_code, message, type_, code=code).response()
    resp.headers.update(e.headers or {})
    return resp


async def on_unexpected(request: Request, e: Exception) -> JSONResponse:
    """A failure nobody foresaw: 500 without its details (they go to the log)."""
    return OpenAIError(500, "the gateway failed to answer this request", "server_error").response()


def install(app) -> None:
    app.add_exception_handler(OpenAIError, on_openai_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)
