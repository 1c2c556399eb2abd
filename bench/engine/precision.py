"""How far a reduced-precision run's output is from fp32 on the same weights, voice, tokens and seed.

    deviation(setup, chunks) -> {chunks, mel_max_abs, mel_mean_abs, mel_range, audio_max_abs,
        audio_snr_db}: voice 0 installed on the bench's decoder (its dtype) and on an fp32 decoder built
        from the same model folder, one stream each with the same seed, `chunks` steady-state chunks;
        the chunk mels (what the flow hands HiFT) and the audio are compared. The setup solve runs in
        each decoder's own dtype, so its rounding is part of the deviation, as it is in a real run.

Only meaningful when the bench's dtype is not fp32; the CLI runs it only then.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

from bench.engine.decode import steady_rows
from bench.engine.workload import BenchSetup
from gpu_worker.checkpoint.load import load_model_folder, prepare_hift
from gpu_worker.engine.decoder import StreamingDecoder
from gpu_worker.voices.prompt import install_voice

SEED = 0


@contextlib.contextmanager
def _chunk_mels(decoder: StreamingDecoder, into: list[torch.Tensor]) -> Iterator[None]:
    """Records the chunk mel of every row the decoder vocodes while the block runs."""
    original = decoder._vocode

    def recording(streams: list[Any], chunk_mels: list[torch.Tensor]) -> Any:
        into.extend(m.detach().float().cpu() for m in chunk_mels)
        return original(streams, chunk_mels)

    decoder._vocode = recording  # type: ignore[method-assign]
    try:
        yield
    finally:
        del decoder._vocode


def decode_chunks(setup: BenchSetup, decoder: StreamingDecoder, chunks: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Voice 0 on `decoder`, one stream (seed 0), `chunks` steady-state chunks: (chunk mels, audio)."""
    prompt = install_voice(setup.host(0), speaker=setup.speaker, decoder=decoder)
    stream = decoder.open_stream(prompt, seed=SEED)
    mels: list[torch.Tensor] = []
    audio = []
    with _chunk_mels(decoder, mels):
        for k in range(chunks):
            audio.append(decoder.step(steady_rows([stream], step=500 + k))[0].float().cpu())
    return torch.cat(mels, dim=2), torch.cat(audio)


def deviation(setup: BenchSetup, chunks: int = 3) -> dict[str, Any]:
    fp32_model = load_model_folder(setup.folder, device=setup.device, dtype=torch.float32, args=setup.args)
    prepare_hift(fp32_model.hift)
    fp32 = StreamingDecoder(fp32_model, device=setup.device, dtype=torch.float32, micro_batch_size=1)
    mel32, audio32 = decode_chunks(setup, fp32, chunks)
    del fp32, fp32_model
    mel, audio = decode_chunks(setup, setup.decoder, chunks)
    mel_diff = (mel - mel32).abs()
    noise = float(((audio - audio32) ** 2).sum())
    signal = float((audio32**2).sum())
    return {
        "dtype": str(setup.dtype).removeprefix("torch."), "chunks": chunks, "frames": mel.size(2),
        "hift_dtype": str(setup.decoder.hift_dtype()).removeprefix("torch."),
        "mel_max_abs": float(mel_diff.max()), "mel_mean_abs": float(mel_diff.mean()),
        "mel_range": float(mel32.max() - mel32.min()),
        "audio_max_abs": float((audio - audio32).abs().max()),
        "audio_snr_db": math.inf if noise == 0 else 10 * math.log10(signal / noise),
    }
