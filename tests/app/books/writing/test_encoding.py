"""Encoder choices: what the encoders cannot honour is refused with the reason; what is asked is what the
files hold (read back with mutagen) and what chapters.json records; a new choice re-encodes only them."""

import json

import mutagen.mp3
import mutagen.mp4
import pytest

from app.books.planning.plan import plan_book
from app.books.reading.text import parse_markdown
from app.books.writing.encoding import Encoding
from app.books.writing.output import BookOutput, assemble_book
from app.errors import BadInput
from tests.app.books.conftest import MARKDOWN_BOOK
from tests.app.books.writing.test_output import VOICE, render


@pytest.mark.parametrize(("encoding", "reason"), [
    (Encoding(bitrate_kbps=65), "bitrate 65 kbit/s is not one of"),
    (Encoding(mp3_bitrate_kbps=1000), "MP3 bitrate 1000 kbit/s is not one of"),
    (Encoding(sample_rate=11025), "sample rate 11025 Hz is not one of"),
    (Encoding(mp3_bitrate_kbps=192), "an MP3 at 24000 Hz takes at most 160 kbit/s"),
    (Encoding(bitrate_kbps=192), "AAC at 24000 Hz mono takes at most 144 kbit/s"),
])
def test_choices_the_encoders_cannot_honour_are_refused_with_the_reason(encoding, reason):
    with pytest.raises(BadInput, match=reason):
        encoding.check()


def test_the_defaults_and_the_acx_mp3_are_accepted():
    Encoding().check()
    Encoding(mp3_bitrate_kbps=192, sample_rate=44100).check()


def test_the_files_hold_the_encoding_asked_and_the_index_records_it(tmp_path):
    plan = plan_book(parse_markdown(MARKDOWN_BOOK.encode()), voice_id=VOICE)
    audio = render(plan, tmp_path / "segments")
    first = assemble_book(plan, audio, tmp_path / "out", output=BookOutput(mp3=True))
    assert mutagen.mp4.MP4(first.m4b).info.sample_rate == 24000  # the default: as rendered
    assert mutagen.mp3.MP3(first.mp3s[0]).info.bitrate == pytest.approx(64000, abs=500)
    acx = Encoding(bitrate_kbps=96, mp3_bitrate_kbps=192, sample_rate=44100)
    out = assemble_book(plan, audio, tmp_path / "out", output=BookOutput(mp3=True, encoding=acx))
    assert out.reused == (0, 1, 2) and not out.m4b_reused and out.mp3s_reused == ()  # chapters stay
    for path, chapter in zip(out.mp3s, out.chapters, strict=True):
        info = mutagen.mp3.MP3(path).info
        assert (info.sample_rate, info.channels) == (44100, 1)
        assert info.bitrate == pytest.approx(192000, abs=500)  # mutagen divides the size by the length
        assert info.bitrate_mode in (mutagen.mp3.BitrateMode.CBR, mutagen.mp3.BitrateMode.UNKNOWN)
        assert info.length == pytest.approx(chapter.duration, abs=0.06)  # resampled, not cut or stretched
    m4b = mutagen.mp4.MP4(out.m4b).info
    assert m4b.sample_rate == 44100
    assert m4b.length == pytest.approx(sum(c.duration for c in out.chapters), abs=0.1)
    index = json.loads(out.index_json.read_text())
    assert index["encoding"] == {
        "m4b": {"codec": "aac", "bitrate_kbps": 96, "sample_rate": 44100, "channels": 1},
        "mp3": {"codec": "mp3", "bitrate_kbps": 192, "mode": "cbr", "sample_rate": 44100, "channels": 1}}
    again = assemble_book(plan, audio, tmp_path / "out", output=BookOutput(mp3=True, encoding=acx))
    assert again.m4b_reused and again.mp3s_reused == (0, 1, 2)
