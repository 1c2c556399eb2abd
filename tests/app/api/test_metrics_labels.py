"""The request metrics' labels come from closed sets: whatever method, path or status a client brings
about, /metrics keeps a bounded number of series (each label value is kept for the life of the process)."""

from __future__ import annotations

from http import HTTPStatus

from fastapi.testclient import TestClient

from app.api.metrics import OTHER, UNMATCHED, request_labels


def _made_up_methods(client: TestClient, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        method = f"X{i:04d}" + "Q" * 2000  # a valid token, 2 kB, a new one each time
        assert client.request(method, "/healthz").status_code in (400, 405)
        assert client.request(method, f"/no/such/{i}").status_code in (400, 404, 405)


def test_made_up_methods_do_not_grow_the_metrics(client: TestClient) -> None:
    client.get("/metrics")  # its own series exist before the first look
    _made_up_methods(client, 1)
    before = client.get("/metrics").text
    _made_up_methods(client, 40, start=1)
    after = client.get("/metrics").text
    assert "Q" * 100 not in after and f'method="{OTHER}"' in after
    series = [line.rsplit(" ", 1)[0] for line in after.splitlines() if not line.startswith("#")]
    assert series == [line.rsplit(" ", 1)[0] for line in before.splitlines() if not line.startswith("#")]
    assert f'wavefarm_http_requests_total{{method="{OTHER}",route="{UNMATCHED}",status="404"}} 41.0' in after


def test_request_labels_come_from_closed_sets() -> None:
    assert request_labels({"method": "GET"}, 200) == ("GET", UNMATCHED, "200")
    assert request_labels({"method": "get"}, 999) == (OTHER, UNMATCHED, OTHER)
    assert request_labels({"method": "BREW", "route": object()}, 418) == (OTHER, UNMATCHED, "418")
    # a code HTTP does not define is not a value of its own, even within 100..599 (an app or a proxy
    # behind the route could send any of them)
    assert request_labels({"method": "POST"}, 299) == ("POST", UNMATCHED, OTHER)
    assert {request_labels({"method": "GET"}, code)[2] for code in range(100, 600)} - {OTHER} == {
        str(int(code)) for code in HTTPStatus} | {"499"}  # 499: the API's own answer to a client gone
