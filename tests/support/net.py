"""Local ports for the processes a test starts, the API served on one from a thread, and a poll of an
API's /healthz."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from app.settings import Settings


def answers_healthz(url: str) -> bool:
    """Whether the API at `url` answers GET /healthz with 200 now (a poll for `wait_until`)."""
    import httpx

    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def free_port() -> int:
    """A TCP port nothing listens on now (the OS's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


LOOP_THREAD = "uvicorn-event-loop"  # the thread the server's event loop runs on (tests ask)


@contextmanager
def serving(settings: Settings) -> Iterator[str]:
    """The API on `settings` (tasks to a recording sender) under uvicorn in a thread, on a free port;
    yields its base URL once the server listens. Imported here, not above: `free_port` stays cheap."""
    import uvicorn

    from app.api.main import create_app
    from tests.support.runtime import RecordingSender

    port = free_port()
    config = uvicorn.Config(create_app(settings, sender=RecordingSender()), host="127.0.0.1", port=port,
                            log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True, name=LOOP_THREAD)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(30)
