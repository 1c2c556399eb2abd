"""What tests in several folders share: sample audio, the engine's fakes, GPU worker runtimes, free ports.

Plain modules (no fixtures are collected from here, except `runtime`, a pytest plugin the root conftest
loads): a test imports what it needs, so a helper lives in one place whoever uses it.
"""
