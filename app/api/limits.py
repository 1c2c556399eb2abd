"""Refuse request bodies larger than the API could ever accept, before anything is parsed or spooled.

Starlette spools multipart files to disk without a size limit; this middleware stops a huge upload
at the door (413), by its Content-Length or, for a chunked body, as the bytes arrive: the 413 is sent
the moment the limit is crossed, and whatever the app answers after that is dropped.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyTooLarge(Exception):
    pass


class BodyLimit:
    """`max_bytes` for every path, except paths under a prefix of `per_prefix` (e.g. book uploads)."""

    def __init__(self, app: ASGIApp, max_bytes: int, per_prefix: dict[str, int] | None = None) -> None:
        self.app, self.default_max = app, max_bytes
        self.per_prefix = per_prefix or {}

    def _limit(self, path: str) -> int:
        for prefix, limit in self.per_prefix.items():
            if path.startswith(prefix):
                return limit
        return self.default_max

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        max_bytes = self._limit(scope.get("path", ""))
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > max_bytes:
            await self._refuse(send, max_bytes)
            return
        seen = 0
        started = refused = False

        async def counted() -> Message:
            nonlocal seen, refused
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > max_bytes:
                    # Answer now: a parser that turns any error of its stream into its own answer
                    # (FastAPI's form fields: 400) must not replace the 413, so it is dropped below.
                    if not started and not refused:
                        refused = True
                        await self._refuse(send, max_bytes)
                    raise BodyTooLarge
            return message

        async def tracked(message: Message) -> None:
            nonlocal started
            if refused:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except BodyTooLarge:
            pass  # answered (413) when the limit was crossed, unless a response had started already

    @staticmethod
    async def _refuse(send: Send, max_bytes: int) -> None:
        body = json.dumps({"error": "TooLarge",
                           "reason": f"request body is larger than {max_bytes} bytes"}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
