"""`wavefarm model check` and `wavefarm model pull` (`app.cli.model`, `gpu_worker.checkpoint.check`), never on
the
network: check lists every problem of a folder at once; pull fails at once offline with nothing cached and
resolves a pre-filled Hugging Face cache offline.

The check runs in a child process of the command (app never imports gpu_worker), so its lines are read
from the file descriptors (capfd). Pull runs as a child process of the test, so huggingface_hub reads the
test's HF_* variables when it is imported (its constants are fixed then)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import onnx
import pytest
import torch
from onnx import TensorProto, helper

from app.cli.model import OFFLINE_ROUTE
from app.s3 import S3_MELS
from app.speech import FLOW_PT, FLOW_YAML, HIFT_PT, TOKENIZER_ONNX
from gpu_worker.checkpoint import check as model_check
from gpu_worker.checkpoint.write import write_official_layout
from gpu_worker.model.config import ModelArgs
from tests.app.cli.helpers import run
from tests.conftest import REPO
from tests.support.net import free_port

REPO_ID = "stepfun-ai/Step-Audio-2-mini"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def write_tokenizer_interface(path: Path, mels: int = S3_MELS) -> None:
    """An ONNX file with only the S3 tokenizer's interface, log-mel [B, mels, T] in: checkpoint_io's
    stand-in is 0.5 GB (s3tokenizer's fixed size), and the check reads only the interface."""
    graph = helper.make_graph([helper.make_node("Identity", ["feats"], ["codes"])], "tokenizer_interface",
                              [helper.make_tensor_value_info("feats", TensorProto.FLOAT, ["B", mels, "T"])],
                              [helper.make_tensor_value_info("codes", TensorProto.FLOAT, None)])
    onnx.save(helper.make_model(graph), str(path))


def write_tiny_folder(folder: Path) -> Path:
    write_official_layout(folder, ModelArgs.tiny(), seed=5, tokenizer=False)
    write_tokenizer_interface(folder / TOKENIZER_ONNX)
    return folder


@pytest.fixture
def tiny_folder(tmp_path: Path) -> Path:
    return write_tiny_folder(tmp_path / "token2wav")


def pull(tmp_path: Path, *argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    hf_home = tmp_path / "hf"
    hub_env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(hf_home), "HF_HUB_CACHE": str(hf_home / "hub"), **env}
    return subprocess.run([sys.executable, "-m", "app.cli", "model", "pull", *argv], cwd=REPO,
                          env={**os.environ, **hub_env}, capture_output=True, text=True, timeout=120)


def test_a_complete_folder_passes_with_its_preset(tiny_folder: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    # In process (a child costs seconds of imports): the command's exit 0 is the pull test's.
    assert model_check.main([str(tiny_folder)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"ok: {tiny_folder} is a complete token2wav folder (preset tiny)"]


def test_every_problem_of_a_broken_folder_is_listed_at_once(tiny_folder: Path,
                                                            capfd: pytest.CaptureFixture[str]) -> None:
    (tiny_folder / HIFT_PT).unlink()
    yaml_text = (tiny_folder / FLOW_YAML).read_text()
    (tiny_folder / FLOW_YAML).write_text(yaml_text.replace("depth: 2", "depth: 3"))
    state = torch.load(tiny_folder / FLOW_PT, weights_only=True)
    renamed = sorted(state)[0]
    state[renamed + "_old"] = state.pop(renamed)
    reshaped = next(k for k in sorted(state) if state[k].dim() == 2)
    state[reshaped] = torch.zeros(state[reshaped].shape[0] + 1, state[reshaped].shape[1])
    torch.save(state, tiny_folder / FLOW_PT)
    write_tokenizer_interface(tiny_folder / TOKENIZER_ONNX, mels=80)

    assert run("model", "check", str(tiny_folder)) == 1
    lines = capfd.readouterr().out.splitlines()
    flow_pt, tokenizer = tiny_folder / FLOW_PT, tiny_folder / TOKENIZER_ONNX
    # The preset comes from the weights when flow.yaml is refused, so they are judged as tiny.
    assert lines == [f"{tiny_folder / HIFT_PT}: missing",
                     f"{tiny_folder / FLOW_YAML}: flow.decoder.estimator.depth = 3 is not supported "
                     "(expected 2)",
                     f"{flow_pt}: missing key {renamed}",
                     f"{flow_pt}: unexpected key {renamed}_old",
                     f"{flow_pt}: shape mismatch {reshaped}: {tuple(state[reshaped].shape)}, expected "
                     f"({state[reshaped].shape[0] - 1}, {state[reshaped].shape[1]})",
                     f"{tokenizer}: expected a first input (B, 128, T) of log-mel frames, got inputs "
                     f"feats ['B', 80, 'T']",
                     f"{tiny_folder}: 6 problem(s) (preset tiny)"]


def test_many_mismatches_are_summarised(tiny_folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert model_check.main([str(tiny_folder), "--preset", "full"]) == 1  # in process: the same lines
    lines = capsys.readouterr().out.splitlines()
    shapes = [line for line in lines if line.startswith(f"{tiny_folder / FLOW_PT}: shape mismatch")]
    assert len(shapes) == 5
    assert any(line.startswith(f"{tiny_folder / FLOW_PT}: ... and ") and line.endswith(" shape mismatches)")
               for line in lines)
    assert lines[-1].endswith("(preset full)") and len(lines) < 40


def test_pull_offline_with_an_empty_cache_fails_at_once(tmp_path: Path) -> None:
    started = time.monotonic()
    done = pull(tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == (f"wavefarm: ModelLoadError: {REPO_ID}: token2wav/ is not in the Hugging "
                                   f"Face cache ({tmp_path / 'hf' / 'hub'}), and HF_HUB_OFFLINE is set, so "
                                   f"nothing is downloaded. {OFFLINE_ROUTE}")
    assert time.monotonic() - started < 60  # a child's imports; no retries, no waiting on a network


def test_pull_without_a_reachable_hub_says_so(tmp_path: Path) -> None:
    done = pull(tmp_path, HF_HUB_OFFLINE="0", HF_ENDPOINT=f"http://127.0.0.1:{free_port()}")  # refused
    assert done.returncode == 2, done.stderr
    message = done.stderr.strip()
    assert message.startswith(f"wavefarm: ModelLoadError: {REPO_ID}: token2wav/ is not in the Hugging Face "
                              "cache") and "the Hub cannot be reached" in message
    assert len(message.splitlines()) == 1
    assert "HF_HUB_OFFLINE=1" in message and "docs/MODEL_SETUP.md" in message  # what to do about it


def test_check_of_a_path_that_is_not_a_folder_answers_without_starting_the_check(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from app.cli import model

    def no_child(*args: object, **kwargs: object) -> None:
        raise AssertionError("the check's child process (torch) was started")

    monkeypatch.setattr(model.subprocess, "run", no_child)
    for path in (tmp_path / "nonexistent", tmp_path / "a-file"):
        if path.name == "a-file":
            path.write_text("x")
        assert run("model", "check", str(path)) == 1
        assert capsys.readouterr().out.splitlines() == [f"{path}: not a folder",
                                                        f"{path}: 1 problem(s) (preset full)"]


def test_check_of_an_empty_folder_answers_as_the_check_would_without_starting_it_or_torch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Nothing to read: the five missing files are said at once, word for word what the check's child
    says (it imports torch first: 13 to 16 s on a loaded 2-core machine against 0.2 s)."""
    from app.cli import model

    expected = model_check.check_folder(tmp_path, preset=None)
    calls: list[object] = []
    monkeypatch.setattr(model.subprocess, "run", lambda *a, **k: calls.append(a))
    assert run("model", "check", str(tmp_path)) == 1
    assert calls == []
    assert capsys.readouterr().out.splitlines() == [
        *expected.problems, f"{tmp_path}: {len(expected.problems)} problem(s) (preset {expected.preset})"]
    assert run("model", "check", str(tmp_path), "--preset", "tiny") == 1
    assert capsys.readouterr().out.splitlines()[-1] == f"{tmp_path}: 5 problem(s) (preset tiny)"
    monkeypatch.undo()  # model.subprocess is the subprocess module: its run was the fake
    done = subprocess.run([sys.executable, "-c", "import sys; from app import cli; "
                           f"rc = cli.main(['model', 'check', {str(tmp_path)!r}]); "
                           "sys.exit(10 if 'torch' in sys.modules or 'numpy' in sys.modules else rc)"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 1, (done.returncode, done.stderr)  # 10: torch or numpy was imported


def test_pull_offline_resolves_a_filled_cache(tmp_path: Path) -> None:
    from huggingface_hub import snapshot_download

    cache = tmp_path / "hf" / "hub"
    repo_cache = cache / f"models--{REPO_ID.replace('/', '--')}"
    snapshot = repo_cache / "snapshots" / COMMIT
    write_tiny_folder(snapshot / "token2wav")
    (repo_cache / "refs").mkdir()
    (repo_cache / "refs" / "main").write_text(COMMIT)
    resolved = snapshot_download(REPO_ID, allow_patterns=["token2wav/*"], cache_dir=cache,
                                 local_files_only=True)
    assert Path(str(resolved)) == snapshot  # the layout is the one the library reads

    done = pull(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    folder = snapshot / "token2wav"
    assert lines == [f"ok: {folder} is a complete token2wav folder (preset tiny)",
                     f"WAVEFARM_MODEL_DIR={folder}", "WAVEFARM_MODEL_PRESET=tiny"]
    assert model_check.check_folder(lines[1].split("=", 1)[1]).ok
