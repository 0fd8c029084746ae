"""The Serve app's ASGI middleware: request bodies bounded while they are read, and the API key checked
before anything is parsed."""
from __future__ import annotations

import hmac
import json
import os
from dataclasses import dataclass

from flexdraft.serving.openai_api import APIError


@dataclass(frozen=True)
class GuardSettings:
    max_body_bytes: int = 1 << 20
    api_key_env: str = "FLEXDRAFT_API_KEY"  # the environment variable holding the API key (unset: no key)


class Guard:
    """ASGI middleware in front of every route: bodies over `max_body_bytes` get 413 before they are read whole,
    and every /v1/ route needs the API key when `$api_key_env` is set (401 before the body is parsed). The app is
    built at import, before any config: a replica hands its settings over with `Guard.configure` (one replica
    per process), and each request reads the settings in force when it arrived."""

    settings = GuardSettings()

    def __init__(self, asgi):
        self.asgi = asgi

    @classmethod
    def configure(cls, settings: GuardSettings) -> None:
        cls.settings = settings

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.asgi(scope, receive, send)
        settings = self.settings
        path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
        key, headers = os.environ.get(settings.api_key_env), dict(scope["headers"])
        if key and path.startswith("/v1/"):
            given = headers.get(b"authorization", b"").removeprefix(b"Bearer ").strip()
            if not hmac.compare_digest(given, key.encode()):
                return await _send_error(send, APIError(401, "invalid or missing API key (Authorization: Bearer ...)",
                                                        kind="authentication_error", code="invalid_api_key"))
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > settings.max_body_bytes):
            return await _send_error(send, _too_large(settings))
        body, more = [], True
        while more:  # read the body here, bounded, and hand it on whole
            message = await receive()
            if message["type"] != "http.request":
                return await self.asgi(scope, _replay([message], receive), send)
            body.append(message.get("body", b""))
            more = message.get("more_body", False)
            if sum(map(len, body)) > settings.max_body_bytes:
                return await _send_error(send, _too_large(settings))
        await self.asgi(scope, _replay([{"type": "http.request", "body": b"".join(body), "more_body": False}],
                                       receive), send)


def _too_large(settings: GuardSettings) -> APIError:
    return APIError(413, f"the request body exceeds {settings.max_body_bytes} bytes", code="request_too_large")


def _replay(messages: list, receive):
    async def replayed():
        return messages.pop(0) if messages else await receive()
    return replayed


async def _send_error(send, e: APIError) -> None:
    body = json.dumps(e.body()).encode()
    await send({"type": "http.response.start", "status": e.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
