"""Artifact root: content-addressed references, atomic writes, no client names, orphans."""

import hashlib
import os
import time
import uuid

import pytest

from app.storage.artifacts import ArtifactStore


def test_reference_is_stored_under_its_content_hash(artifacts: ArtifactStore):
    data = b"RIFF fake wav bytes"
    rel = artifacts.put_reference(data, "WAV")
    assert rel == f"references/{hashlib.sha256(data).hexdigest()}.wav"
    assert artifacts.read_bytes(rel) == data
    assert artifacts.put_reference(data, "WAV") == rel  # same bytes, same file
    assert list((artifacts.root / "tmp").iterdir()) == []


def test_unknown_formats_are_refused(artifacts: ArtifactStore):
    with pytest.raises(ValueError):
        artifacts.put_reference(b"x", "EXE")


@pytest.mark.parametrize(
    "relpath",
    [
        "../etc/passwd",
        "/etc/passwd",
        "references/../../x.wav",
        "references/abc.wav",
        "outputs/evil.sh",
        "outputs/6b5500c9-b004-4ec5-9117-8b563ff17021.exe",
        "tmp/x",
    ],
)
def test_paths_outside_the_layout_are_refused(artifacts: ArtifactStore, relpath: str):
    with pytest.raises(ValueError):
        artifacts.path(relpath)


def test_outputs_are_named_by_job_id_only(artifacts: ArtifactStore):
    job = str(uuid.uuid4())
    assert artifacts.output_path(job, "flac") == artifacts.root / "outputs" / f"{job}.flac"
    for bad in ("../../x", job.upper(), job.replace("-", "")):
        with pytest.raises(ValueError):
            artifacts.output_path(bad, "wav")
    with pytest.raises(ValueError):
        artifacts.output_path(job, "mp3")


def test_a_failed_write_leaves_neither_the_file_nor_its_temp(artifacts: ArtifactStore):
    rel = artifacts.output_relpath(str(uuid.uuid4()), "wav")
    with pytest.raises(RuntimeError), artifacts.writing(rel) as tmp:
        assert tmp.parent == artifacts.root / "tmp"
        tmp.write_bytes(b"half a file")
        raise RuntimeError("encoder died")
    assert not artifacts.path(rel).exists()
    assert list((artifacts.root / "tmp").iterdir()) == []


def test_readers_never_see_a_partial_file(artifacts: ArtifactStore):
    rel = artifacts.output_relpath(str(uuid.uuid4()), "wav")
    with artifacts.writing(rel) as tmp:
        tmp.write_bytes(b"first half")
        assert not artifacts.path(rel).exists()
        with open(tmp, "ab") as f:
            f.write(b", second half")
    assert artifacts.read_bytes(rel) == b"first half, second half"


def test_token_lists_round_trip(artifacts: ArtifactStore):
    job = str(uuid.uuid4())
    rel = artifacts.put_tokens(job, [0, 4218, 6560])
    assert rel == f"tokens/{job}.json" and artifacts.read_tokens(rel) == [0, 4218, 6560]


def _age(path, seconds: float) -> None:
    old = time.time() - seconds
    os.utime(path, (old, old))


def test_orphans_are_old_unreferenced_files(artifacts: ArtifactStore):
    kept = artifacts.put_reference(b"kept", "WAV")
    orphan = artifacts.put_reference(b"orphan", "FLAC")
    fresh = artifacts.put_reference(b"fresh", "OGG")
    job = str(uuid.uuid4())
    output = artifacts.output_relpath(job, "wav")
    artifacts.write_bytes(output, b"audio")
    stale_tmp = artifacts.temp_path(".wav")
    stale_tmp.write_bytes(b"partial")
    for rel in (kept, orphan, output):
        _age(artifacts.path(rel), 7200)
    _age(stale_tmp, 7200)
    orphans = artifacts.list_orphans(referenced={kept}, older_than_s=3600)
    assert orphans == sorted([artifacts.path(orphan), artifacts.path(output), stale_tmp])
    assert artifacts.path(fresh) not in orphans
    assert artifacts.remove(orphan) and not artifacts.remove(orphan)
