"""Hypothesis strategies that build real upload content: audio files (WAV, FLAC: extreme levels, rates,
channels, lengths, sample formats, cut short), EPUBs (DTDs and entities, encodings, deep nesting, many
chapters, zip tricks) and Markdown books. Each draws a small recipe and renders it to bytes, so a failing
example shrinks to a readable recipe.

    audio_files()   -> bytes of a WAV or FLAC file
    epubs()         -> bytes of an EPUB (well-formed or deliberately not)
    markdown_books() -> bytes of a Markdown book
    loud_float_wav(), entity_epub(): the known bad inputs of issue 18, for `@example`
"""

from __future__ import annotations

import io
import warnings
import zipfile

import numpy as np
import soundfile as sf
from hypothesis import strategies as st

RATES = (1, 4000, 7999, 8000, 16000, 22050, 24000, 44100, 48000, 96000, 96001, 192000)
VALID_RATES = (8000, 16000, 22050, 24000, 44100, 48000, 96000)
LEVELS = (0.0, 1e-6, 1e-4, 0.3, 1.0, 2.0, 32767.0, 1e18, 3e38)
MAX_SAMPLES = 1_500_000  # per file, all channels: keeps an example well under a second


@st.composite
def audio_files(draw: st.DrawFn) -> bytes:
    """Half the files are within every limit but the level (so preparation runs on them: the loud ones
    must still give finite features); the other half are wild in rate, channels, length and content."""
    wild = draw(st.booleans())
    container = draw(st.sampled_from(["WAV", "FLAC"]))
    subtypes = ["PCM_16", "PCM_24"] + (["FLOAT", "DOUBLE", "PCM_U8"] if container == "WAV" else [])
    subtype = draw(st.sampled_from(subtypes))
    rate = draw(st.sampled_from(RATES if wild else VALID_RATES))
    channels = draw(st.integers(1, 10) if wild else st.integers(1, 8))
    seconds = draw(st.sampled_from([0.0, 0.01, 0.4, 0.6, 2.0, 7.0] if wild else [0.6, 2.0, 7.0]))
    frames = min(int(seconds * rate), MAX_SAMPLES // channels)
    level = draw(st.sampled_from(LEVELS if wild else LEVELS[1:] + (1e18, 3e38)))  # loud ones twice
    t = np.arange(frames)[:, None] / max(rate, 1)
    wave = level * np.sin(2 * np.pi * draw(st.sampled_from([50.0, 220.0, 3000.0])) * t + np.arange(channels))
    if wild and frames and draw(st.booleans()):  # a NaN, an infinity or a spike somewhere
        wave[draw(st.integers(0, frames - 1)), 0] = draw(st.sampled_from([np.nan, np.inf, -np.inf, 1e30]))
    buf = io.BytesIO()
    try:
        sf.write(buf, wave.astype(np.float64), max(rate, 1), format=container, subtype=subtype)
    except (sf.LibsndfileError, ValueError, RuntimeError, AssertionError):  # what the writer refuses
        return b"RIFF" + bytes(40)
    data = buf.getvalue()
    cut = draw(st.sampled_from([None, None, 0.5, 0.99])) if wild else None  # cut short in transit
    return data if cut is None else data[: int(len(data) * cut)]


def loud_float_wav(peak: float = 1e18) -> bytes:
    """A float WAV of a 220 Hz tone peaking at `peak` (what made NaN features and a ready voice)."""
    t = np.arange(48_000) / 16000
    buf = io.BytesIO()
    tone = (peak * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    sf.write(buf, tone, 16000, format="WAV", subtype="FLOAT")
    return buf.getvalue()


# -- EPUB ----------------------------------------------------------------------------------------------
_CONTAINER = ('<?xml version="1.0"?><container version="1.0" '
              'xmlns="urn:oasis:names:tc:opendocument:xmlns:container"><rootfiles>'
              '<rootfile full-path="{opf}" media-type="application/oebps-package+xml"/>'
              "</rootfiles></container>")
DOCTYPES = (
    "",
    '<!DOCTYPE package [<!ENTITY a "{big}">]>',
    '<!DOCTYPE package [<!ENTITY a "x"><!ENTITY b "&a;&a;&a;&a;&a;&a;&a;&a;">]>',
    '<!DOCTYPE package [<!ENTITY % p SYSTEM "file:///etc/passwd"> %p;]>',
    '<!DOCTYPE package SYSTEM "file:///etc/passwd">',
    '<!DOCTYPE package PUBLIC "-//NISO//DTD ncx 2005-1//EN" "http://www.daisy.org/z3986/2005/ncx-2005-1.dtd">',
    '<!DOCTYPE package [<!ATTLIST package version CDATA "3.0">]>',
)
TITLES = ("Tales", "", "&a;" * 50, "&b;", "T" * 600, "Ünïcødé 書", "<b>bold</b>", "&amp;&lt;", "\x01")


@st.composite
def _chapter_doc(draw: st.DrawFn, index: int) -> str:
    depth = draw(st.sampled_from([0, 1, 5, 200]))
    body = "<div>" * depth + f"<p>Chapter {index} text, sentence one. Two.</p>" + "</div>" * depth
    extra = draw(st.sampled_from(["", "<script>x()</script>", "<p>&nbsp;&#8212;&#x0;&bogus;</p>",
                                  "<svg><text>no</text></svg>", "<p>" + "word " * 2000 + "</p>"]))
    return ('<?xml version="1.0" encoding="utf-8"?><html xmlns="http://www.w3.org/1999/xhtml"><head>'
            f"<title>c{index}</title></head><body>{body}{extra}</body></html>")


def _package(title: str, doctype: str, chapters: int, hrefs: list[str]) -> str:
    items = "".join(f'<item id="d{i}" href="{h}" media-type="application/xhtml+xml"/>'
                    for i, h in enumerate(hrefs))
    refs = "".join(f'<itemref idref="d{i}"/>' for i in range(chapters))
    return (f'<?xml version="1.0" encoding="{{encoding}}"?>{doctype}'
            '<package xmlns="http://www.idpf.org/2007/opf" version="3.0"><metadata xmlns:dc="http://purl.org/dc/elements/1.1/">'
            f"<dc:title>{title}</dc:title><dc:language>en</dc:language></metadata>"
            f"<manifest>{items}</manifest><spine>{refs}</spine></package>")


@st.composite
def epubs(draw: st.DrawFn) -> bytes:
    chapters = draw(st.sampled_from([0, 1, 3, 40, 2001]))
    doctype = draw(st.sampled_from(DOCTYPES)).replace("{big}", "A" * draw(st.sampled_from([10, 100_000])))
    encoding = draw(st.sampled_from(["utf-8", "utf-16", "iso-8859-1", "ascii"]))
    comment = "<!--" + "c" * draw(st.sampled_from([0, 70_000])) + "-->"
    odd = [draw(st.sampled_from([f"t/c{i}.xhtml", f"../../c{i}.xhtml", f"/abs/c{i}.xhtml", "t/c0.xhtml",
                                 f"t/c%2e{i}.xhtml"])) for i in range(min(chapters, 5))]
    hrefs = odd + [f"t/c{i}.xhtml" for i in range(len(odd), chapters)]
    opf = _package(draw(st.sampled_from(TITLES)), doctype, chapters, hrefs).replace("{encoding}", encoding)
    opf = opf.replace("?>", "?>" + comment, 1)
    try:
        opf_bytes = opf.encode(encoding)
    except UnicodeEncodeError:
        opf_bytes = opf.encode("utf-8")
    buf = io.BytesIO()
    method = draw(st.sampled_from([zipfile.ZIP_DEFLATED, zipfile.ZIP_STORED]))
    with warnings.catch_warnings(), zipfile.ZipFile(buf, "w", method) as z:
        warnings.simplefilter("ignore", UserWarning)  # the duplicate entry below is on purpose
        if draw(st.booleans()):
            z.writestr("mimetype", "application/epub+zip")
        opf_path = draw(st.sampled_from(["OEBPS/content.opf", "content.opf", "../content.opf",
                                         "OEBPS/missing.opf"]))
        z.writestr("META-INF/container.xml", _CONTAINER.replace("{opf}", opf_path))
        z.writestr(opf_path.replace("missing", "other"), opf_bytes)
        for i in range(min(chapters, 50)):  # past 50 the spine names files that are not there
            z.writestr(f"OEBPS/t/c{i}.xhtml", draw(_chapter_doc(i)))
        if draw(st.booleans()):
            z.writestr("OEBPS/t/c0.xhtml", "a second entry of the same name")
        if draw(st.booleans()):  # a bomb-shaped entry: 2 MiB of one byte
            z.writestr("OEBPS/pad.bin", b"\0" * (2 * 1024 * 1024), compress_type=zipfile.ZIP_DEFLATED)
    data = buf.getvalue()
    trick = draw(st.sampled_from([None, None, "truncate", "flip"]))
    if trick == "truncate":
        return data[: len(data) * 2 // 3]
    if trick == "flip" and len(data) > 200:
        return data[:100] + bytes(b ^ 0x55 for b in data[100:140]) + data[140:]
    return data


def entity_epub() -> bytes:
    """A 70 KB comment, then an entity its title uses 95 times (the shape of the 760 MiB title)."""
    opf = _package("&a;" * 95, '<!DOCTYPE package [<!ENTITY a "' + "A" * 10_000 + '">]>', 1, ["t/c0.xhtml"])
    opf = opf.replace("{encoding}", "utf-8").replace("?>", "?><!--" + "c" * 70_000 + "-->", 1)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("mimetype", "application/epub+zip")
        z.writestr("META-INF/container.xml", _CONTAINER.replace("{opf}", "OEBPS/content.opf"))
        z.writestr("OEBPS/content.opf", opf)
        z.writestr("OEBPS/t/c0.xhtml", "<html><body><p>Some text to read.</p></body></html>")
    return buf.getvalue()


# -- Markdown ------------------------------------------------------------------------------------------
_MD_PARTS = st.sampled_from([
    "# Title\n", "## Chapter\n", "Chapter 1\n=========\n", "---\ntitle: " + "T" * 600 + "\n---\n",
    "---\ntitle: Front\nlang: de\n---\n", "```\ncode\n", "```\n", "[link](http://x)\n", "[" * 500 + "\n",
    "*" * 300 + "\n", "<!-- unclosed\n", "<div>html</div>\n", "- item\n- item\n", "> quote\n", "\n\n",
    "A sentence. Another one, longer, with 12 numbers and $3.50.\n", "x" * 120_000 + "\n", "\x00\x01\x02\n",
    "#" * 7 + " seven\n", "#" + " " + "h" * 600 + "\n",
])


@st.composite
def markdown_books(draw: st.DrawFn) -> bytes:
    text = "".join(draw(st.lists(_MD_PARTS, min_size=0, max_size=12)))
    return text.encode(draw(st.sampled_from(["utf-8", "utf-16", "latin-1"])), "replace")
