"""Which voice each of the decoder's voice slots holds (`model/lanes.py`: `Lanes.voices`).

Every open stream reads its voice's setup frames from a slot. A slot keeps its frames after its last
stream has gone, so the next stream of that voice reads them without a copy, until another voice needs
the slot (an empty or dead one first, else the least recently used). It holds only a weak reference to
the voice, so a voice the cache evicted frees its own memory; a slot whose voice has gone is free.
Single-threaded: the decoder's.
"""

from __future__ import annotations

import weakref
from typing import Any

from gpu_worker.model.lanes import Lanes
from gpu_worker.voices.prompt import VoicePrompt


class VoiceSlots:
    """The voice each of the lanes' voice slots holds, its users and when it was last attached."""

    def __init__(self) -> None:
        self._held: list[Any] = []  # weakref to the voice, or None
        self._users: list[int] = []
        self._used: list[int] = []
        self._tick = 0

    def attach(self, lanes: Lanes, voice: VoicePrompt) -> int:
        """The slot with `voice`'s frames (copied in unless a slot still holds them); one more user."""
        self._tick += 1
        self._grow(lanes.voice_slots)
        for i, ref in enumerate(self._held):
            if ref is not None and ref() is voice:
                self._users[i] += 1
                self._used[i] = self._tick
                return i
        free = [i for i, n in enumerate(self._users) if n == 0]
        if not free:
            lanes.reserve(lanes.capacity, 2 * lanes.voice_slots)
            self._grow(lanes.voice_slots)
            free = [i for i, n in enumerate(self._users) if n == 0]
        index = min(free, key=lambda i: (self._alive(i), self._used[i]))  # an empty or dead one, else LRU
        lanes.put_voice(index, voice.estimator_att_cache)
        self._held[index], self._users[index], self._used[index] = weakref.ref(voice), 1, self._tick
        return index

    def detach(self, index: int) -> None:
        self._users[index] = max(0, self._users[index] - 1)

    def _alive(self, i: int) -> bool:
        ref = self._held[i]
        return ref is not None and ref() is not None

    def _grow(self, slots: int) -> None:
        extra = slots - len(self._held)
        self._held += [None] * extra
        self._users += [0] * extra
        self._used += [0] * extra
