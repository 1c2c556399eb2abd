"""The installed-voice cache of one GPU worker: prepared prompts, pins, LRU eviction.

An installed voice is the device half's output (`VoicePrompt`: speaker embedding, prompt length and the
setup caches), shared read-only by every stream of that voice. Each live job pins its voice; unpinned
voices stay installed (another job with the same voice skips preparation) until the cache is over its
capacity, when the least recently used unpinned ones are evicted and their device memory freed.

On a CUDA device `install` (and `install_many`, several voices in one batched setup solve) runs the
device half on a side stream and records an event; the first decode step that uses the voice makes the
main stream wait on it (`wait_ready`), a device-side wait with no host sync. The published tensors are
`record_stream`-ed on the main stream so the caching allocator does not hand their memory to the side
stream while the main stream still reads them. On a CPU device installs run in the calling thread: the
engine's, in order, or its install lane's (a side thread, the CPU's stand-in for the side stream), which
builds the prompt with `build` and hands it to `adopt`.

This module does no preparation maths itself: the installer callable (`gpu_worker.prompt`) does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from app.features import PromptHostFeatures

log = logging.getLogger(__name__)


class Installable(Protocol):
    """What the cache needs of an installed prompt (`gpu_worker.prompt.VoicePrompt` satisfies it)."""

    @property
    def voice_id(self) -> str: ...

    def nbytes(self) -> int: ...

    def tensors(self) -> Iterator[torch.Tensor]: ...


Installer = Callable[[PromptHostFeatures], Installable]
# several voices, one setup solve
BatchInstaller = Callable[[list[PromptHostFeatures]], Sequence[Installable]]


@dataclass
class InstalledVoice:
    voice_id: str
    prompt: Installable
    nbytes: int
    install_s: float  # host time spent in the installer (the device work may still be running)
    pins: int = 0
    uses: int = 0  # jobs that finished with it
    last_used: int = 0  # logical time of the last pin or use
    ready_event: Any = None  # torch.cuda.Event until the first step that needs it has waited on it
    reclaim: bool = field(default=False)  # discard once settled (installed for a job that went away)


class VoiceCache:
    """Installed voices of one device, keyed by voice id; not thread-safe (the engine thread owns it)."""

    def __init__(self, installer: Installer, *, device: torch.device | str = "cpu",
                 max_voices: int = 64,
                 clock: Callable[[], float] | None = None,
                 batch_installer: BatchInstaller | None = None) -> None:
        if max_voices < 1:
            raise ValueError(f"max_voices must be >= 1, got {max_voices}")
        self._installer = installer
        self._batch_installer = batch_installer
        self.device = torch.device(device)
        self.max_voices = max_voices
        self._clock = clock or time.perf_counter
        self._voices: dict[str, InstalledVoice] = {}
        self._tick = 0
        self._side_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    # -- queries -------------------------------------------------------------------------------------
    def __contains__(self, voice_id: str) -> bool:
        return voice_id in self._voices

    def __len__(self) -> int:
        return len(self._voices)

    def get(self, voice_id: str) -> InstalledVoice | None:
        return self._voices.get(voice_id)

    def __iter__(self) -> Iterator[str]:
        """The installed voice ids, in install order."""
        return iter(list(self._voices))

    def nbytes(self) -> int:
        return sum(v.nbytes for v in self._voices.values())

    # -- install, pin, wait --------------------------------------------------------------------------
    def build(self, host: PromptHostFeatures) -> tuple[Installable, float]:
        """The device half for `host`, not kept: (prompt, seconds). Any thread may call it (CPU)."""
        start = self._now()
        prompt = self._installer(host)
        return prompt, self._now() - start

    def adopt(self, prompt: Installable, install_s: float, ready_event: Any = None) -> InstalledVoice:
        """Keep a prompt `build` made (in this thread or another)."""
        assert prompt.voice_id not in self._voices, f"voice {prompt.voice_id} installed twice"
        entry = InstalledVoice(voice_id=prompt.voice_id, prompt=prompt, nbytes=int(prompt.nbytes()),
                               install_s=install_s, ready_event=ready_event)
        self._voices[prompt.voice_id] = entry
        self._touch(entry)
        return entry

    def install(self, host: PromptHostFeatures) -> InstalledVoice:
        """Run the device half for `host` (on the side stream on CUDA) and keep the result."""
        return self.install_many([host])[0]

    def install_many(self, hosts: list[PromptHostFeatures]) -> list[InstalledVoice]:
        """The device half of several voices in one call to the batch installer (one batched setup solve;
        without one, or for a single voice, the installer per voice), on the side stream on CUDA with one
        event for them all, and keep the results. Each entry's `install_s` is the whole call's."""
        for host in hosts:
            assert host.voice_id not in self._voices, f"voice {host.voice_id} installed twice"
        start = self._now()
        event = None
        if self._side_stream is None:
            prompts = self._run_installer(hosts)
        else:
            with torch.cuda.stream(self._side_stream):
                prompts = self._run_installer(hosts)
                event = torch.cuda.Event()
                event.record(self._side_stream)
            main = torch.cuda.current_stream(self.device)
            for prompt in prompts:
                for tensor in prompt.tensors():
                    tensor.record_stream(main)
        seconds = self._now() - start
        return [self.adopt(prompt, seconds, ready_event=event) for prompt in prompts]

    def _run_installer(self, hosts: list[PromptHostFeatures]) -> list[Installable]:
        if len(hosts) > 1 and self._batch_installer is not None:
            return list(self._batch_installer(hosts))
        return [self._installer(host) for host in hosts]

    def pin(self, voice_id: str) -> InstalledVoice:
        entry = self._voices[voice_id]
        entry.pins += 1
        entry.reclaim = False
        self._touch(entry)
        return entry

    def unpin(self, voice_id: str) -> None:
        entry = self._voices.get(voice_id)
        if entry is None:
            return
        assert entry.pins > 0, f"voice {voice_id} unpinned more often than pinned"
        entry.pins -= 1
        self._touch(entry)

    def mark_used(self, voice_id: str) -> None:
        entry = self._voices[voice_id]
        entry.uses += 1
        self._touch(entry)

    def wait_ready(self, voice_id: str) -> None:
        """Make the current (main) stream wait for the voice's install; a no-op once done or on CPU."""
        entry = self._voices[voice_id]
        if entry.ready_event is not None:
            torch.cuda.current_stream(self.device).wait_event(entry.ready_event)
            entry.ready_event = None

    # -- reclaim and evict ---------------------------------------------------------------------------
    def reclaim_if_unused(self, voice_id: str) -> None:
        """A job on this voice went away (aborted, failed): drop the install once settled, unless a live
        job pins it or a job has finished with it (then it is a normal LRU entry)."""
        entry = self._voices.get(voice_id)
        if entry is not None and entry.pins == 0 and entry.uses == 0:
            entry.reclaim = True

    def collect(self) -> list[str]:
        """Discard settled reclaims and evict LRU unpinned voices over capacity; returns removed ids."""
        removed = [v.voice_id for v in list(self._voices.values())
                   if v.reclaim and v.pins == 0 and self._settled(v)]
        for voice_id in removed:
            del self._voices[voice_id]
        for entry in sorted(self._voices.values(), key=lambda v: v.last_used):
            if not self._over_capacity():
                break
            if entry.pins == 0 and self._settled(entry):
                del self._voices[entry.voice_id]
                removed.append(entry.voice_id)
        if self._over_capacity():
            log.warning("voice cache over capacity (%d voices, %d bytes): every voice is pinned",
                        len(self._voices), self.nbytes())
        return removed

    def _over_capacity(self) -> bool:
        return len(self._voices) > self.max_voices

    @staticmethod
    def _settled(entry: InstalledVoice) -> bool:
        return entry.ready_event is None or bool(entry.ready_event.query())

    def _touch(self, entry: InstalledVoice) -> None:
        self._tick += 1
        entry.last_used = self._tick

    def _now(self) -> float:
        return self._clock()
