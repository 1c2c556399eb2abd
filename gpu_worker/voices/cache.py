"""The installed-voice cache of one GPU worker: prepared prompts, pins, LRU eviction; and the install lane.

An installed voice is the device half's output (`VoicePrompt`: speaker embedding, prompt length and the
setup caches), shared read-only by every stream of that voice. Each live job pins its voice; unpinned
voices stay installed (another job with the same voice skips preparation) until the cache is over its
capacity, when the least recently used unpinned ones are evicted and their device memory freed.

An install is `build_many` (make the prompts, any thread) then `adopt` (keep them, the engine thread).
On a CUDA device `build_many` runs the device half on a side stream and records an event; the first
decode step that uses the voice makes the main stream wait on it (`wait_ready`), a device-side wait with
no host sync. The published tensors are `record_stream`-ed on the main stream so the caching allocator
does not hand their memory to the side stream while the main stream still reads them. The call itself
runs on the install lane (`install_lane`: a side thread): on CUDA always, since an install has a CPU half
(CAM++ on onnxruntime's CPU where TensorRT is missing, the host side of a setup solve's thousands of
launches) that would otherwise stall every live stream's decode step; on a CPU when asked, as the CPU's
stand-in for the side stream. Without a lane the engine thread runs it (`install`, `install_many`).

This module does no preparation maths itself: the installer callable (`gpu_worker.voices.prompt`) does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch

from app.voices.features import PromptHostFeatures

log = logging.getLogger(__name__)


def install_lane(device: torch.device, asked: bool) -> ThreadPoolExecutor | None:
    """The engine's install lane (module docstring): on CUDA always; on a CPU only when `asked`
    (WAVEFARM_INSTALL_LANE: there it takes cores from the decode)."""
    if device.type == "cuda" or asked:
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix="wavefarm-install-lane")
    return None


class Installable(Protocol):
    """What the cache needs of an installed prompt (`gpu_worker.voices.prompt.VoicePrompt` satisfies it)."""

    @property
    def voice_id(self) -> str: ...

    def nbytes(self) -> int: ...

    def tensors(self) -> Iterator[torch.Tensor]: ...


Installer = Callable[[PromptHostFeatures], Installable]
# several voices, one setup solve
BatchInstaller = Callable[[list[PromptHostFeatures]], Sequence[Installable]]


class Built(NamedTuple):
    """A prompt the device half made, not yet kept (`VoiceCache.build_many`)."""

    prompt: Installable
    install_s: float  # host seconds of the call that made it
    ready_event: Any  # torch.cuda.Event on the side stream after its work; None on a CPU or one stream


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
                 batch_installer: BatchInstaller | None = None, side_stream: bool = True) -> None:
        if max_voices < 1:
            raise ValueError(f"max_voices must be >= 1, got {max_voices}")
        self._installer = installer
        self._batch_installer = batch_installer
        self.device = torch.device(device)
        self.max_voices = max_voices
        self._clock = clock or time.perf_counter
        self._voices: dict[str, InstalledVoice] = {}
        self._tick = 0
        cuda = self.device.type == "cuda"
        # the stream the engine decodes on (every thread's current stream unless it sets one) and the one
        # installs run on; `side_stream=False`: installs on the main stream (the GPU check's one-stream run)
        self._main_stream = torch.cuda.current_stream(self.device) if cuda else None
        self._side_stream = torch.cuda.Stream(self.device) if cuda and side_stream else None

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
    def build_many(self, hosts: list[PromptHostFeatures]) -> list[Built]:
        """The device half of `hosts`, not kept: one call of the batch installer (one batched setup solve;
        without one, or for a single voice, the installer per voice). Any thread may call it (the install
        lane's does): on CUDA the work goes on the side stream, with one event recorded after it and the
        tensors `record_stream`-ed on the main stream, whichever thread launched it. Each `Built`'s
        seconds are the whole call's host time."""
        start = self._now()
        if self._side_stream is None:  # a CPU, or CUDA on one stream: in order with the decode
            prompts = self._run_installer(hosts)
            seconds = self._now() - start
            return [Built(prompt, seconds, None) for prompt in prompts]
        with torch.cuda.stream(self._side_stream):
            prompts = self._run_installer(hosts)
            event = torch.cuda.Event()
            event.record(self._side_stream)
        main: Any = self._main_stream  # set wherever the side stream is
        for prompt in prompts:
            for tensor in prompt.tensors():
                tensor.record_stream(main)
        seconds = self._now() - start
        return [Built(prompt, seconds, event) for prompt in prompts]

    def build_each(self, hosts: list[PromptHostFeatures]) -> dict[str, Built | Exception]:
        """`build_many`, and if it fails for several voices, each voice alone, so that one voice's bad
        features fail that voice only: voice id -> what was built, or why not. Any thread may call it."""
        try:
            return {built.prompt.voice_id: built for built in self.build_many(hosts)}
        except Exception as exc:  # which voice is bad is found one by one below
            if len(hosts) == 1:
                return {hosts[0].voice_id: exc}
            log.warning("batched install of %d voices failed (%s); installing them one by one",
                        len(hosts), exc)
        out: dict[str, Built | Exception] = {}
        for host in hosts:
            try:
                out[host.voice_id] = self.build_many([host])[0]
            except Exception as exc:  # this voice's features are unusable
                out[host.voice_id] = exc
        return out

    def adopt(self, built: Built) -> InstalledVoice:
        """Keep a prompt `build_many` made (in this thread or another)."""
        prompt = built.prompt
        assert prompt.voice_id not in self._voices, f"voice {prompt.voice_id} installed twice"
        entry = InstalledVoice(voice_id=prompt.voice_id, prompt=prompt, nbytes=int(prompt.nbytes()),
                               install_s=built.install_s, ready_event=built.ready_event)
        self._voices[prompt.voice_id] = entry
        self._touch(entry)
        return entry

    def install(self, host: PromptHostFeatures) -> InstalledVoice:
        """Run the device half for `host` (on the side stream on CUDA) and keep the result."""
        return self.install_many([host])[0]

    def install_many(self, hosts: list[PromptHostFeatures]) -> list[InstalledVoice]:
        """`build_many` in this thread, and keep the results."""
        for host in hosts:
            assert host.voice_id not in self._voices, f"voice {host.voice_id} installed twice"
        return [self.adopt(built) for built in self.build_many(hosts)]

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
