"""Model folder loading: round trips through the released layout, both checkpoint styles, refusals."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from app.errors import ModelLoadError
from gpu_worker.checkpoint.load import (
    HIFT_FLOAT32_PARTS,
    fuse_weight_norm,
    load_dummy,
    load_hift,
    load_model_folder,
    normalize_hift_state,
    prepare_hift,
    read_flow_config,
)
from gpu_worker.checkpoint.write import hift_checkpoint_state, render_flow_yaml, write_official_layout
from gpu_worker.model import Code2Wav
from gpu_worker.model.config import FlowArgs, ModelArgs

TINY = ModelArgs.tiny()


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> tuple[Path, Code2Wav]:
    folder = tmp_path_factory.mktemp("token2wav")
    model = write_official_layout(folder, TINY, seed=7, tokenizer=False)
    yield folder, model
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def folder_copy(tiny_folder, tmp_path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(tiny_folder[0], copy)
    return copy


def _vocode(model: Code2Wav) -> torch.Tensor:
    mel = torch.randn(1, 80, 12, generator=torch.Generator().manual_seed(0)) - 4.0
    with torch.inference_mode():
        audio, _ = model.hift(mel, generators=[torch.Generator().manual_seed(1)])
    return audio


def test_round_trip_restores_every_tensor_and_the_vocoder_output(tiny_folder):
    folder, written = tiny_folder
    loaded = load_model_folder(folder, args=TINY)
    ours, theirs = loaded.state_dict(), written.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert not any(p.is_meta or p.requires_grad for p in loaded.parameters())
    assert torch.equal(_vocode(loaded), _vocode(written))
    assert loaded.args == TINY


@pytest.mark.parametrize("old_style", [True, False])
@pytest.mark.parametrize("prefix", [True, False])
def test_hift_checkpoint_styles_all_load_to_the_same_weights(folder_copy, tiny_folder, old_style, prefix):
    state = hift_checkpoint_state(tiny_folder[1].hift.state_dict(), old_style_weight_norm=old_style,
                                  generator_prefix=prefix)
    assert any(k.endswith("weight_g") for k in state) == old_style
    assert all(k.startswith("generator.") for k in state) == prefix
    torch.save(state, folder_copy / "hift.pt")
    loaded = load_hift(folder_copy / "hift.pt", TINY.hift)
    expected = tiny_folder[1].hift.state_dict()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in expected.items())


def test_fused_weight_norm_keeps_the_vocoder_output(tiny_folder):
    hift = load_hift(tiny_folder[0] / "hift.pt", TINY.hift)
    mel = torch.randn(1, 80, 12, generator=torch.Generator().manual_seed(0)) - 4.0
    noise = hift.draw_noise([torch.Generator().manual_seed(1)], 12)
    with torch.inference_mode():
        before, _ = hift(mel, noise=noise)
        fuse_weight_norm(hift)
        after, _ = hift(mel, noise=noise)
    assert "conv_pre.weight" in hift.state_dict()
    assert torch.equal(before, after)  # the same weights, computed once instead of per call


def test_prepare_hift_keeps_fp32_bits_and_casts_only_the_body_to_bf16(tiny_folder):
    mel = torch.randn(2, 80, 12, generator=torch.Generator().manual_seed(0)) - 4.0
    noise = tiny_folder[1].hift.draw_noise([torch.Generator().manual_seed(i) for i in (1, 2)], 12)
    outputs = {}
    for dtype in (None, torch.float32, torch.bfloat16):
        hift = load_hift(tiny_folder[0] / "hift.pt", TINY.hift)
        if dtype is not None:
            assert prepare_hift(hift, dtype) is hift
        with torch.inference_mode():
            outputs[dtype], _ = hift(mel if dtype is None else mel.to(dtype), noise=noise)
        if dtype == torch.bfloat16:
            kept = {f"{part}." for part in HIFT_FLOAT32_PARTS}
            for name, p in hift.state_dict().items():
                assert p.dtype == (torch.float32 if name.startswith(tuple(kept)) else torch.bfloat16), name
    assert torch.equal(outputs[None], outputs[torch.float32])  # fp32: only the weight norm folded
    bf16, fp32 = outputs[torch.bfloat16], outputs[torch.float32]
    assert bf16.dtype == torch.float32 and torch.isfinite(bf16).all()  # the iSTFT runs in float32
    snr = 10 * torch.log10((fp32**2).sum() / ((bf16 - fp32) ** 2).sum())
    assert 15 < snr.item() < 200  # near fp32, not equal to it (a bf16 body really ran)


def test_normalize_hift_state_maps_old_weight_norm_names():
    state = {"generator.conv_pre.weight_g": torch.ones(1), "generator.conv_pre.weight_v": torch.zeros(1),
             "m_source.l_linear.bias": torch.ones(1)}
    assert set(normalize_hift_state(state)) == {"conv_pre.parametrizations.weight.original0",
                                                "conv_pre.parametrizations.weight.original1",
                                                "m_source.l_linear.bias"}


def test_load_casts_to_the_requested_dtype_and_keeps_hift_in_float32(tiny_folder):
    loaded = load_model_folder(tiny_folder[0], args=TINY, dtype=torch.bfloat16)
    assert {p.dtype for p in loaded.flow.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in loaded.hift.parameters()} == {torch.float32}


def test_written_flow_yaml_parses_as_the_full_architecture(tmp_path):
    path = tmp_path / "flow.yaml"
    path.write_text(render_flow_yaml(FlowArgs()))
    assert read_flow_config(path) == ModelArgs.full().flow
    assert "!new:cosyvoice2.flow.decoder_dit.DiT" in path.read_text()


def _edit_yaml(folder: Path, old: str, new: str) -> None:
    path = folder / "flow.yaml"
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


@pytest.mark.parametrize(("old", "new", "named"), [
    ("attention_heads: 2", "attention_heads: 4", "flow.encoder.attention_heads"),
    ("num_heads: 2", "num_heads: 4", "flow.decoder.estimator.num_heads"),
    ("vocab_size: 6561", "vocab_size: 4096", "flow.vocab_size"),
    ("key_bias: true", "key_bias: 1", "flow.encoder.key_bias"),
    ("output_type: 'mel'", "output_type: 'linear'", "flow.output_type"),
    ("    inference_cfg_rate: 0.7\n", "    inference_cfg_rate: 0.7\n        sigma_min: 1.0e-06\n",
     "flow.decoder.sigma_min"),
    ("    depth: 2\n", "    depth: 2\n            use_flash: true\n", "flow.decoder.estimator.use_flash"),
    ("    num_blocks: 2\n", "\n", "flow.encoder.num_blocks"),
    ("!new:cosyvoice2.flow.decoder_dit.DiT", "!new:cosyvoice2.flow.decoder.ConditionalDecoder",
     "flow.decoder.estimator"),
])
def test_unsupported_flow_yaml_is_refused_naming_the_field_and_file(folder_copy, old, new, named):
    _edit_yaml(folder_copy, old, new)
    with pytest.raises(ModelLoadError, match=named) as err:
        load_model_folder(folder_copy, args=TINY)
    assert "flow.yaml" in str(err.value)


def test_full_architecture_is_the_default_and_refuses_a_tiny_folder(tiny_folder):
    with pytest.raises(ModelLoadError, match="input_size = 64 is not supported"):
        load_model_folder(tiny_folder[0])


@pytest.mark.parametrize("payload", [
    "!!python/object/apply:os.system ['touch {marker}']",
    "!!python/object:os.system {{}}",
    "!!python/name:os.system",
    "!apply:os.system ['touch {marker}']",
])
def test_flow_yaml_code_tags_are_refused_and_never_run(folder_copy, tmp_path, payload):
    marker = tmp_path / "pwned"
    text = (folder_copy / "flow.yaml").read_text()
    (folder_copy / "flow.yaml").write_text(text + f"evil: {payload.format(marker=marker)}\n")
    with pytest.raises(ModelLoadError, match="flow.yaml"):
        load_model_folder(folder_copy, args=TINY)
    (folder_copy / "flow.yaml").write_text(f"flow: {payload.format(marker=marker)}\n")
    with pytest.raises(ModelLoadError, match="flow.yaml"):
        load_model_folder(folder_copy, args=TINY)
    assert not marker.exists()


@pytest.mark.parametrize("name", ["flow.yaml", "flow.pt", "hift.pt"])
def test_missing_file_is_named(folder_copy, name):
    (folder_copy / name).unlink()
    with pytest.raises(ModelLoadError, match=rf"{name}: (missing|cannot be read)"):
        load_model_folder(folder_copy, args=TINY)


def test_missing_folder_is_refused(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        load_model_folder(tmp_path / "nowhere", args=TINY)


def test_truncated_flow_pt_is_refused(folder_copy):
    data = (folder_copy / "flow.pt").read_bytes()
    (folder_copy / "flow.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="flow.pt: cannot be read"):
        load_model_folder(folder_copy, args=TINY)


def test_legacy_non_zip_checkpoint_still_loads(folder_copy, tiny_folder):
    state = torch.load(folder_copy / "hift.pt", weights_only=True)
    torch.save(state, folder_copy / "hift.pt", _use_new_zipfile_serialization=False)
    loaded = load_hift(folder_copy / "hift.pt", TINY.hift)
    assert torch.equal(loaded.conv_post.parametrizations.weight.original1,
                       tiny_folder[1].hift.conv_post.parametrizations.weight.original1)


def test_oversized_or_binary_flow_yaml_is_refused(folder_copy):
    (folder_copy / "flow.yaml").write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ModelLoadError, match="flow.yaml"):
        load_model_folder(folder_copy, args=TINY)
    (folder_copy / "flow.yaml").write_text("flow: 1\n" + "#" * 70_000)
    with pytest.raises(ModelLoadError, match="too large"):
        load_model_folder(folder_copy, args=TINY)


def test_pickled_object_in_a_checkpoint_is_refused(folder_copy):
    torch.save({"weights": logging.getLogger("x")}, folder_copy / "hift.pt")
    with pytest.raises(ModelLoadError, match="hift.pt"):
        load_model_folder(folder_copy, args=TINY)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda s: s.update({"encoder_proj.weight": torch.zeros(3, 3)}),
     r"encoder_proj.weight has shape \(3, 3\)"),
    (lambda s: s.update({"encoder_proj.weight": s["encoder_proj.weight"].long()}), "dtype torch.int64"),
    (lambda s: s.pop("encoder_proj.bias"), r"missing \['encoder_proj.bias'\]"),
    (lambda s: s.update({"extra.weight": torch.zeros(1)}), r"unexpected \['extra.weight'\]"),
])
def test_flow_weights_that_do_not_fit_are_refused(folder_copy, edit, message):
    state = torch.load(folder_copy / "flow.pt", weights_only=True)
    edit(state)
    torch.save(state, folder_copy / "flow.pt")
    with pytest.raises(ModelLoadError, match=f"flow.pt: .*{message}"):
        load_model_folder(folder_copy, args=TINY)


def test_wrong_hift_shape_is_refused(folder_copy):
    state = torch.load(folder_copy / "hift.pt", weights_only=True)
    state["generator.conv_pre.weight_v"] = torch.zeros(1, 2, 3)
    torch.save(state, folder_copy / "hift.pt")
    with pytest.raises(ModelLoadError, match=r"hift.pt: conv_pre\.parametrizations\.weight\.original1 has"):
        load_hift(folder_copy / "hift.pt", TINY.hift)


def test_dummy_is_seeded_and_warns_loudly(caplog):
    with caplog.at_level(logging.WARNING, logger="gpu_worker.checkpoint.load"):
        a, b = load_dummy(TINY, seed=3), load_dummy(TINY, seed=3)
    assert any("NOISE" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    pairs = zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    assert all(torch.equal(x, y) for x, y in pairs)
    c = load_dummy(TINY, seed=4)
    assert not torch.equal(a.flow.input_embedding.weight, c.flow.input_embedding.weight)


def test_dummy_leaves_the_global_rng_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    load_dummy(TINY, seed=9)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("preset", ["full", "tiny"])
def test_reference_driver_reads_our_flow_yaml_into_a_module_with_our_state_dict(preset):
    """The reference Token2wav builds its flow with HyperPyYAML from flow.yaml; built on meta here."""
    token2wav = pytest.importorskip("stepaudio2.token2wav")
    from gpu_worker.model.flow import Flow

    token2wav._setup_cosyvoice2_alias()
    args = ModelArgs.preset(preset).flow
    with torch.device("meta"):
        reference = token2wav.load_hyperpyyaml(render_flow_yaml(args))["flow"]
        ours = Flow(args)
    shapes = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    assert shapes == {k: tuple(v.shape) for k, v in ours.state_dict().items()}
