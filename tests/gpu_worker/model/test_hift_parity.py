"""HiFTGenerator against the reference vocoder (stepaudio2-minicpmo, test-only oracle), same weights.

The reference draws its source noise from the global RNG; the tests hand it our drawn noise instead
(patching `torch.rand` / `torch.randn_like` for the duration of its call), so whole passes compare.
"""

from __future__ import annotations

import pytest
import torch

from bench.engine.reference import reference_hift
from gpu_worker.checkpoint.write import hift_checkpoint_state
from gpu_worker.model.config import HiftArgs, ModelArgs
from gpu_worker.model.hift import HiFTGenerator, SourceNoise, draw_source_noise

hifigan = pytest.importorskip("stepaudio2.flashcosyvoice.modules.hifigan")
layers = pytest.importorskip("stepaudio2.flashcosyvoice.modules.hifigan_components.layers")

TOL = 1e-5


def _reference(args: HiftArgs) -> torch.nn.Module:
    return reference_hift(args)


def _pair(args: HiftArgs, seed: int = 0) -> tuple[torch.nn.Module, HiFTGenerator]:
    """Reference and ours with the same weights; F0 spread over 0..~250 Hz so both voiced and
    unvoiced frames (threshold 10 Hz) occur."""
    torch.manual_seed(seed)
    ours = HiFTGenerator(args).eval()
    head = ours.f0_predictor.classifier
    with torch.no_grad():
        hidden = ours.f0_predictor.condnet(_mel(40, seed=1)).transpose(1, 2)  # [1, T, C]
        raw = hidden @ head.weight.normal_(0.0, 1.0).t()  # [1, T, 1]
        head.weight.mul_(80.0 / raw.std())
        head.bias.fill_(40.0 - raw.mean().item() * 80.0 / raw.std().item())
    ref = _reference(args)
    ref.load_state_dict(ours.state_dict(), strict=True)
    return ref, ours


def _run_reference(monkeypatch, ref, mel, noise: SourceNoise, cache=None):
    """Reference forward with its random draws replaced by `noise` (the unused branch noise is zero)."""
    draws = iter([noise.noise.transpose(1, 2)])
    monkeypatch.setattr(layers.torch, "rand", lambda *shape, **kw: noise.phase.clone())
    monkeypatch.setattr(layers.torch, "randn_like", lambda x: next(draws, None) if x.shape[-1] > 1
                        else torch.zeros_like(x))
    try:
        return ref(mel) if cache is None else ref(mel, cache)
    finally:
        monkeypatch.undo()


def _mel(frames: int, batch: int = 1, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, 80, frames, generator=torch.Generator().manual_seed(seed)) - 4.0


def test_state_dict_keys_and_shapes_match_reference_for_full_preset():
    args = ModelArgs.full().hift
    with torch.device("meta"):
        ref, ours = _reference(args), HiFTGenerator(args)
    ref_shapes = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == ref_shapes
    assert "conv_pre.parametrizations.weight.original0" in ref_shapes


@pytest.mark.parametrize("preset", ["tiny", "full"])
def test_forward_matches_reference_with_same_injected_noise(preset, monkeypatch):
    args = ModelArgs.preset(preset).hift
    ref, ours = _pair(args)
    mel = _mel(12 if preset == "full" else 40)
    noise = ours.draw_noise([torch.Generator().manual_seed(1234)], mel.shape[2])
    ref_audio, ref_source = _run_reference(monkeypatch, ref, mel, noise)
    with torch.inference_mode():
        audio, source = ours(mel, noise=noise)
    voiced = (ours.f0_predictor(mel) > args.nsf_voiced_threshold).float().mean().item()
    assert 0.2 < voiced < 0.95
    src_diff = (source - ref_source).abs().max().item()
    audio_diff = (audio - ref_audio).abs().max().item()
    print(f"hift {preset}: max|source diff| {src_diff:.3g}, max|audio diff| {audio_diff:.3g}")
    assert audio.shape == (1, mel.shape[2] * 480) and source.shape == (1, 1, mel.shape[2] * 480)
    assert src_diff <= TOL and audio_diff <= TOL


def test_injected_source_and_cache_match_reference_decode(monkeypatch):
    args = ModelArgs.tiny().hift
    ref, ours = _pair(args)
    mel = _mel(30, batch=2)
    source = torch.rand(2, 1, 30 * 480, generator=torch.Generator().manual_seed(3)) - 0.5
    with torch.inference_mode():
        diff = (ours.decode(mel, source) - ref.decode(x=mel, s=source)).abs().max().item()
    assert diff <= TOL
    cache = source[:, :, :3840]
    noise = ours.draw_noise([torch.Generator().manual_seed(7)], 30)
    _, ref_source = _run_reference(monkeypatch, ref, mel[:1], noise, cache[:1])
    with torch.inference_mode():
        _, our_source = ours(mel[:1], cache[:1], noise=noise)
    assert torch.equal(our_source[:, :, :3840], cache[:1])
    assert (our_source - ref_source).abs().max().item() <= TOL


def test_row_output_does_not_depend_on_batch():
    _, ours = _pair(ModelArgs.tiny().hift)
    mel = _mel(20, batch=3, seed=5)
    seeds = [11, 12, 13]
    with torch.inference_mode():
        batched, _ = ours(mel, generators=[torch.Generator().manual_seed(s) for s in seeds])
        for row, seed in enumerate(seeds):
            alone, _ = ours(mel[row:row + 1], generators=[torch.Generator().manual_seed(seed)])
            diff = (batched[row] - alone[0]).abs().max().item()
            print(f"row {row}: batched vs alone max diff {diff:.3g}")
            assert diff <= 1e-4  # float reduction order may differ with batch size; the noise does not


def test_noise_is_reproducible_per_generator_and_differs_across_seeds():
    a = draw_source_noise([torch.Generator().manual_seed(1)], 960, 9)
    b = draw_source_noise([torch.Generator().manual_seed(1)], 960, 9)
    c = draw_source_noise([torch.Generator().manual_seed(2)], 960, 9)
    assert isinstance(a, SourceNoise) and a.phase.shape == (1, 9) and a.noise.shape == (1, 9, 960)
    assert torch.equal(a.noise, b.noise) and torch.equal(a.phase, b.phase)
    assert not torch.equal(a.noise, c.noise)


def test_forward_refuses_to_draw_from_the_global_rng():
    ours = HiFTGenerator(ModelArgs.tiny().hift)
    with pytest.raises(ValueError, match="Generator"):
        ours(_mel(4))


@pytest.mark.parametrize("old_style", [True, False])
def test_reference_loads_the_hift_checkpoint_we_write_as_its_driver_does(old_style):
    """Token2wav strips `generator.` and loads strictly; torch converts weight_g / weight_v itself."""
    args = ModelArgs.tiny().hift
    _, ours = _pair(args)
    state = hift_checkpoint_state(ours.state_dict(), old_style_weight_norm=old_style, generator_prefix=True)
    ref = _reference(args)
    ref.load_state_dict({k.replace("generator.", ""): v for k, v in state.items()}, strict=True)
    assert all(torch.equal(ref.state_dict()[k], v) for k, v in ours.state_dict().items())


def test_snake_inference_path_gives_the_same_bits_as_the_formula():
    """Inference computes Snake in one buffer; with autograd on it is the plain formula."""
    from gpu_worker.model.hift import Snake

    snake = Snake(16)
    with torch.no_grad():
        snake.alpha.uniform_(0.1, 4.0, generator=torch.Generator().manual_seed(0))
    x = torch.randn(3, 16, 500, generator=torch.Generator().manual_seed(1), requires_grad=True)
    formula = snake(x)
    formula.sum().backward()  # the autograd path still differentiates
    assert x.grad is not None and torch.isfinite(x.grad).all()
    kept = x.detach().clone()
    with torch.inference_mode():
        fast = snake(x.detach())
    assert torch.equal(x.detach(), kept)  # the input buffer is left alone
    alpha = snake.alpha.detach()[None, :, None]
    by_hand = x.detach() + torch.sin(x.detach() * alpha).pow(2) / (alpha + 1e-9)
    assert torch.equal(fast, by_hand) and torch.equal(formula.detach(), by_hand)
