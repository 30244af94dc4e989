"""ASGI middleware in front of every route: the body-size limit, the Host guard and the bearer key."""

from __future__ import annotations

import hmac
import ipaddress

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gptkit.serving.schemas import anthropic_error, error_body

BODY_KEY = "gptkit.body"  # where BodyLimit leaves the request's body in its ASGI scope


class BodyLimit:
    """ASGI middleware: a request body larger than limit bytes gets 413 before the app parses it.

    The body is read here in full (it is at most limit bytes) and handed on as one message, so that a chunked
    upload without a Content-Length is refused as soon as it passes the limit; it is also left in the scope under
    BODY_KEY.
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            await self._reject(scope, receive, send)
            return
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending its body
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.limit:
                await self._reject(scope, receive, send)
                return
        body = scope[BODY_KEY] = bytes(body)  # kept for the error handlers (a body too deeply nested to parse)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls wait for the disconnect, as streaming responses expect

        await self.app(scope, replay, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"request body exceeds the server's limit of {self.limit} bytes"
        response = JSONResponse(error_body(message, code="request_too_large"), status_code=413)
        await response(scope, receive, send)


def is_loopback(host: str) -> bool:
    """Whether a bind address or Host name means this machine only (localhost, 127.0.0.0/8, ::1)."""
    host = host.lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class HostGuard:
    """ASGI middleware: a request whose Host header names neither a loopback name nor an allowed host gets 403.

    A server on a loopback address is reachable from the user's browser; a web page whose DNS name the attacker
    rebinds to 127.0.0.1 sends its own name as Host, and is refused here (Jupyter's guard)."""

    def __init__(self, app: ASGIApp, allowed: tuple[str, ...]) -> None:
        self.app, self.allowed = app, {name.lower() for name in allowed}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        header = dict(scope.get("headers", [])).get(b"host")
        if scope["type"] in ("http", "websocket") and header is not None:
            name = _host_name(header.decode("latin-1"))
            if not (is_loopback(name) or name in self.allowed):
                message = (
                    f"Host {name!r} is not served: this server answers loopback names only; start it with "
                    f"--allowed-host {name} to serve that name"
                )
                response = JSONResponse(error_body(message, code="host_not_allowed"), status_code=403)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _host_name(host: str) -> str:
    """The name part of a Host header: without its port, an IPv6 address without its brackets."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


class BearerAuth:
    """ASGI middleware: API and playground routes answer 401 unless the request carries the key (as a bearer token or
    as x-api-key)."""

    GUARDED = ("/v1/", "/playground/", "/tokenize", "/detokenize", "/tokenizer_info", "/metrics", "/props")

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self.GUARDED) and not self._authorised(scope):
            message = "missing or wrong API key: send the header 'Authorization: Bearer <key>' (or 'x-api-key: <key>')"
            anthropic = scope["path"].startswith("/v1/messages")  # Anthropic's clients read their API's error shape
            body = anthropic_error(401, message) if anthropic else error_body(message, code="invalid_api_key")
            response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorised(self, scope: Scope) -> bool:
        headers = dict(scope["headers"])
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            return True
        # Anthropic's clients send the key as x-api-key.
        return b"x-api-key" in headers and hmac.compare_digest(headers[b"x-api-key"].strip(), self.key)
