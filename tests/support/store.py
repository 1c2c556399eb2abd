"""Feature-store payloads for tests that need stored bytes, not real features."""

from __future__ import annotations

import hashlib

import torch
from safetensors.torch import save

VOICE = hashlib.sha256(b"voice").hexdigest()


def blob(n: int = 4) -> bytes:
    """A small safetensors payload, as the store keeps features."""
    return save({"x": torch.arange(n, dtype=torch.float32)}, metadata={"voice_id": VOICE})
