"""CAM++ and S3 tokenizer wrappers on stand-in ONNX files written by checkpoint_io.

The tokenizer stand-in is written in float16 to halve its 0.5 GB (s3tokenizer converts any float
initializers into its float32 modules); the released file is float32, which `write_official_layout`
writes by default.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import s3tokenizer
import torch

from app.errors import ModelLoadError
from app.speech import CAMPPLUS_ONNX, TOKENIZER_ONNX
from app.voices.features import host_half
from gpu_worker.accel.tensorrt import on_tensorrt
from gpu_worker.checkpoint.write import write_campplus_onnx, write_s3_tokenizer_onnx
from gpu_worker.voices.speaker import CampPlus, S3Quantizer, SpeakerFrontend, quantize_and_embed


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("speaker")
    write_campplus_onnx(path / CAMPPLUS_ONNX, seed=1)
    write_s3_tokenizer_onnx(path / TOKENIZER_ONNX, seed=1, dtype=np.float16)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def tokenizer(folder) -> S3Quantizer:
    return S3Quantizer.load(folder / TOKENIZER_ONNX)


def _wave(seconds: float, sr: int, seed: int = 0) -> torch.Tensor:
    t = torch.arange(int(seconds * sr)) / sr
    noise = torch.randn(t.numel(), generator=torch.Generator().manual_seed(seed))
    return (0.3 * torch.sin(2 * torch.pi * 180 * t) * torch.sin(2 * torch.pi * 3 * t) + 0.02 * noise).float()


def test_campplus_maps_any_length_fbank_to_one_192_dim_embedding(folder):
    campplus = CampPlus(folder / CAMPPLUS_ONNX, intra_op_threads=2)
    assert on_tensorrt(campplus) is campplus  # a CPU device: onnxruntime it stays
    short, long = torch.randn(50, 80), torch.randn(1, 598, 80)
    a, b = campplus(short), campplus(long)
    assert a.shape == b.shape == (1, 192) and a.dtype == torch.float32
    assert torch.equal(campplus(short), a) and not torch.equal(a, b)


def test_campplus_refuses_wrong_shapes(folder):
    campplus = CampPlus(folder / CAMPPLUS_ONNX)
    for bad in (torch.randn(10, 40), torch.randn(0, 80), torch.randn(2, 10, 80)):
        with pytest.raises(ValueError, match="fbank"):
            campplus(bad)


def test_unreadable_or_missing_onnx_files_are_named(tmp_path):
    with pytest.raises(ModelLoadError, match=f"{CAMPPLUS_ONNX}: missing"):
        CampPlus(tmp_path / CAMPPLUS_ONNX)
    (tmp_path / CAMPPLUS_ONNX).write_bytes(b"not onnx")
    with pytest.raises(ModelLoadError, match=f"{CAMPPLUS_ONNX}: not a readable ONNX"):
        CampPlus(tmp_path / CAMPPLUS_ONNX)
    (tmp_path / TOKENIZER_ONNX).write_bytes(b"not onnx either")
    with pytest.raises(ModelLoadError, match=f"{TOKENIZER_ONNX}: not a readable S3 tokenizer"):
        S3Quantizer.load(tmp_path / TOKENIZER_ONNX)


def test_s3tokenizer_load_model_reads_the_written_file_like_our_wrapper(folder, tokenizer):
    reference = s3tokenizer.load_model(str(folder / TOKENIZER_ONNX))
    mel = s3tokenizer.log_mel_spectrogram(_wave(2.0, 16000))  # [128, 200]
    codes, lengths = reference.quantize(mel[None], torch.tensor([mel.size(1)]))
    assert lengths.tolist() == [50]
    assert codes.min() >= 0 and codes.max() <= 6560 and codes.unique().numel() > 1
    ours = tokenizer(mel)
    assert ours.dtype == torch.int64 and ours.shape == (1, 50)
    assert torch.equal(ours, codes.long())


def test_s3_quantizer_refuses_a_wrong_log_mel(tokenizer):
    with pytest.raises(ValueError, match="128"):
        tokenizer(torch.zeros(80, 100))


def test_quantize_and_embed_turns_host_features_of_a_6s_prompt_into_150_tokens(folder, tokenizer):
    features = host_half(_wave(6.0, 24000, seed=3).numpy(), voice_id="v" * 64)
    campplus = CampPlus(folder / CAMPPLUS_ONNX)
    tokens, embedding = quantize_and_embed(features.logmel128, features.fbank80, tokenizer, campplus)
    assert tokens.shape == (1, 150) and tokens.dtype == torch.int64
    assert 0 <= int(tokens.min()) and int(tokens.max()) <= 6560
    assert embedding.shape == (1, 192) and embedding.device == tokens.device
    again = SpeakerFrontend(tokenizer, campplus).quantize_and_embed(features.logmel128, features.fbank80)
    assert torch.equal(again[0], tokens) and torch.equal(again[1], embedding)


def test_s3_quantizer_batch_gives_each_segment_the_tokens_it_gets_alone(tokenizer):
    # Lengths that are not multiples of 4 frames, one over twice another: padding is most of a short row
    mels = [s3tokenizer.log_mel_spectrogram(_wave(s, 16000, seed=i), n_mels=128)
            for i, s in enumerate((1.0, 0.31, 1.7, 0.62))]
    batched = tokenizer.batch(mels)
    alone = [tokenizer(mel)[0] for mel in mels]
    assert [t.numel() for t in batched] == [-(-m.size(1) // 4) for m in mels]
    assert all(torch.equal(b, a) for b, a in zip(batched, alone, strict=True))
    # The lengths are what keeps padding out: the short row read as if it were padded speech differs
    padded = torch.zeros(1, 128, mels[2].size(1))
    padded[0, :, : mels[1].size(1)] = mels[1]
    codes, _ = tokenizer.module.quantize(padded, torch.tensor([padded.size(2)], dtype=torch.int32))
    assert not torch.equal(codes[0, : alone[1].numel()].long(), alone[1])
    assert tokenizer.batch([]) == []
