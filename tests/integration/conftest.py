"""Fixtures of the in-process integration tests (crashes, cancellation stages): `sessions` on the
test's SQLite file and `make_runtime` (GPU worker runtimes, tiny preset), defined once with the GPU
worker's tests and shared from there. They override the root conftest's PostgreSQL `sessions` in
this folder."""

from tests.gpu_worker.test_worker import make_runtime, sessions  # noqa: F401 - fixtures for pytest
