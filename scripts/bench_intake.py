"""The front door under hostile books: what each class costs with the default limits, how fast the API
answers an upload, and what a chapter's assembly needs in memory.

    python scripts/bench_intake.py [--parts parse,api,assembly] [--quick] [--json OUT]

1. parse: each hostile class (tests/support/hostile.py, issue 28), a real 1,000-page PDF made with
   fpdf2 (a 10-pt serif font embedded, compressed streams, an outline of chapters) and a 100,000-cue
   WebVTT file, read by the real child process (`app.books.intake_child` under `app.books.bounded`) with the
   default limits of `Settings()`: the outcome, wall seconds, CPU seconds and the child's peak RSS.
   `--quick` leaves out the two PDFs that run to the CPU limit (about 2 minutes each).
2. api: `wavefarm serve` on SQLite and the local Redis (databases 3, 4 and 15, emptied first): POST
   /v1/books with uploads of 1, 16 and 63 MB (the limit is 64 MB), the seconds from sending to the 202,
   and the API process's RSS before and its peak (VmHWM) after each.
3. assembly: a dense 1-hour chapter (1,800 segments) and a timed 48-hour one (three cues), each in a
   process of its own: seconds and peak RSS.
Prints a table per part; `--json` writes every figure with the CPU model and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from app.books.bounded import run_child  # noqa: E402
from app.books.intake import JOB_FILE, LOG_FILE, parse_job  # noqa: E402
from app.books.intake_child import OUTCOME  # noqa: E402
from app.books.submission import BookOptions, Submission  # noqa: E402
from app.settings import Settings  # noqa: E402
from tests.support import hostile  # noqa: E402

PORT = 8767
REDIS_DBS = (3, 4, 15)


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


# 1. parse ----------------------------------------------------------------------------------------

def thousand_page_pdf() -> bytes:
    """A 1,000-page A5 novel: chapters of random prose, each with an outline entry."""
    import random

    from fpdf import FPDF

    rng = random.Random(1)
    words = ("the of and a to in was he that it his her with as for had you not be on at by which "
             "lighthouse keeper storm harbour evening window silence letters morning distant").split()
    pdf = FPDF(format=(148, 210))
    font = Path("/usr/share/fonts/truetype/dejavu/DejaVuSerif.ttf")
    family = "serif" if font.is_file() else "Times"
    if font.is_file():
        pdf.add_font("serif", fname=str(font))
    chapter = 0
    while pdf.page_no() < 1000:
        chapter += 1
        pdf.add_page()
        pdf.start_section(f"Chapter {chapter}")
        pdf.set_font(family, size=16)
        pdf.cell(0, 12, f"Chapter {chapter}", new_x="LMARGIN", new_y="NEXT")
        pdf.set_font(family, size=10)
        for _ in range(rng.randint(20, 60)):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(40, 120))).capitalize() + "."
            pdf.multi_cell(0, 5, text, new_x="LMARGIN", new_y="NEXT")
            pdf.ln(2)
            if pdf.page_no() >= 1000:
                break
    return bytes(pdf.output())


def many_cues(n: int = 100_000) -> bytes:
    lines = ["WEBVTT", ""]
    for i in range(n):
        s = i * 3
        lines += [f"{s // 3600:02d}:{s // 60 % 60:02d}:{s % 60:02d}.000 --> "
                  f"{s // 3600:02d}:{s // 60 % 60:02d}:{s % 60 + 2:02d}.000", f"Line {i} of the film.", ""]
    return "\n".join(lines).encode()


def cases(quick: bool) -> list[tuple[str, bytes, dict[str, Any]]]:
    md = b"# Book\n\n## One\n\nSome text to read.\n"
    out = [
        ("VTT cue at 99,999 h (timed)", hostile.timed_subtitles("vtt", 99_999),
         {"filename": "s.vtt", "timed": True}),
        ("SRT hour that overflows", hostile.timed_subtitles("srt", 10**15), {"filename": "s.srt"}),
        ("PDF outline 20,000 deep", hostile.deep_outline_pdf(20_000), {"filename": "b.pdf"}),
        ("DOCX DTD in UTF-32", hostile.docx_declaring(encoding="utf-32"), {"filename": "b.docx"}),
        ("DOCX DTD in a .bin part", hostile.docx_declaring(encoding="utf-8", part="word/x.bin"),
         {"filename": "b.docx"}),
        ("DOCX bad CRC", hostile.docx_bad_crc("word/styles.xml"), {"filename": "b.docx"}),
        ("lexicon JSON 30,000 deep", md, {"filename": "b.md", "lexicon": hostile.deep_json()}),
        ("lexicon YAML 30,000 deep", md, {"filename": "b.md", "lexicon": hostile.deep_yaml()}),
        ("cast YAML 20,000 deep", md, {"filename": "b.md", "cast": hostile.deep_yaml(20_000)}),
        ("lexicon of 2,000 patterns", md, {"filename": "b.md", "lexicon": hostile.many_patterns(2000)}),
        ("100,000-cue WebVTT", many_cues(), {"filename": "s.vtt"}),
        ("1,000-page PDF (fpdf2)", thousand_page_pdf(), {"filename": "novel.pdf"}),
    ]
    if not quick:
        out += [("PDF stream inflating to 26 MB", hostile.inflating_pdf(26), {"filename": "b.pdf"}),
                ("PDF of 5,000 pages on one stream", hostile.shared_stream_pdf(5000, 0.5),
                 {"filename": "b.pdf"})]
    return out


def read_one(settings: Settings, folder: Path, data: bytes, options: dict[str, Any]) -> dict[str, Any]:
    folder.mkdir(parents=True)
    (folder / "source").write_bytes(data)
    for name in ("lexicon", "cast"):
        if name in options:
            (folder / name).write_bytes(options[name])
    submission = Submission(options=BookOptions(timed=bool(options.get("timed"))),
                            filename=options["filename"])
    (folder / "request.json").write_text(submission.to_json())
    job = parse_job(settings, folder, "a" * 64, 0)
    (folder / JOB_FILE).write_text(job.to_json())
    ended = run_child("app.books.intake_child", [str(folder / JOB_FILE)],
                      wall_s=settings.book_parse_timeout_s, stderr=folder / LOG_FILE)
    from app.books.intake import death_reason

    outcome = json.loads((folder / OUTCOME).read_text()) if (folder / OUTCOME).exists() else None
    if outcome is None:
        result = f"refused: {death_reason(ended, job.limits, settings)}"
    elif outcome["ok"]:
        result = f"planned: {sum(len(c[2]) for c in outcome['chapters'])} segments"
    else:
        result = f"refused: {outcome['error']}"
    return {"bytes": len(data), "outcome": result, "wall_s": round(ended.wall_s, 2),
            "cpu_s": round(ended.cpu_s, 2), "peak_rss_mb": round(ended.max_rss_mb, 1)}


def part_parse(quick: bool) -> dict[str, Any]:
    settings = Settings()
    limits = {"wall_s": settings.book_parse_timeout_s, "cpu_s": settings.book_parse_cpu_s,
              "memory_mb": settings.book_parse_memory_mb, "output_mb": settings.book_parse_output_mb,
              "lexicon_budget_s": settings.lexicon_budget_s, "timed_span_s": settings.book_max_timed_span_s}
    print(f"limits: {limits}")
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, data, options) in enumerate(cases(quick)):
            rows[name] = read_one(settings, Path(tmp) / str(i), data, options)
            r = rows[name]
            print(f"{name:34s} {r['bytes'] / 2**20:7.2f} MB  wall {r['wall_s']:7.2f} s  "
                  f"CPU {r['cpu_s']:7.2f} s  peak {r['peak_rss_mb']:7.1f} MB  {r['outcome'][:90]}",
                  flush=True)
    return {"limits": limits, "cases": rows}


# 2. api ------------------------------------------------------------------------------------------

def _rss_mb(pid: int) -> tuple[float, float]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def part_api() -> dict[str, Any]:
    import httpx

    from app.dev import services
    from scripts.service_stack import bench_settings, env_of, flush_redis

    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        settings = bench_settings(Path(tmp), preset="tiny", slots=1, threads=1, redis_dbs=REDIS_DBS,
                                  queue="bench-intake")
        flush_redis(settings)
        proc = services.start_cli(["serve", "--port", str(PORT)], env=env_of(settings),
                                  log_path=Path(tmp) / "api.log")
        try:
            if not services.wait_until(lambda: services.port_open("127.0.0.1", PORT), 120):
                raise RuntimeError(services.log_tail(Path(tmp) / "api.log"))
            reference = (REPO / "app/dev/samples/voice_a.wav").read_bytes()
            with httpx.Client(base_url=f"http://127.0.0.1:{PORT}", timeout=600) as client:
                voice = client.post("/v1/voices", files={"file": ("a.wav", reference)}).json()["id"]
                for mb in (1, 16, 63):
                    data = os.urandom(mb * 2**20)
                    before, _ = _rss_mb(proc.pid)
                    start = time.perf_counter()
                    response = client.post("/v1/books", data={"voice_id": voice},
                                           files={"book": ("upload.pdf", data)})
                    seconds = time.perf_counter() - start
                    after, peak = _rss_mb(proc.pid)
                    rows[f"{mb} MB"] = {"status": response.status_code,
                                        "book_status": response.json().get("status"),
                                        "seconds": round(seconds, 3), "rss_before_mb": round(before, 1),
                                        "rss_after_mb": round(after, 1), "peak_rss_mb": round(peak, 1)}
                    r = rows[f"{mb} MB"]
                    print(f"POST /v1/books {mb:3d} MB: {r['status']} {r['book_status']} in {seconds:.3f} s; "
                          f"API RSS {before:.0f} -> {after:.0f} MB, peak so far {peak:.0f} MB", flush=True)
        finally:
            services.stop_process(proc)
            flush_redis(settings)
    return rows


# 3. assembly -------------------------------------------------------------------------------------

ASSEMBLE = """
import json, resource, sys, time, numpy as np, soundfile as sf
from pathlib import Path
from app.books.writing.assemble import assemble_chapter
from app.books.planning.plan import PlanChapter, PlanSegment
case, folder = sys.argv[1], Path(sys.argv[2])
rng = np.random.default_rng(0)
count, seconds, gap_ms = (1800, 1.7, 0) if case == "dense" else (3, 2.0, 24 * 3600_000)
audio, segments = {}, []
for i in range(count):
    path = folder / f"s{i}.wav"
    wave = (rng.standard_normal(int(24000 * seconds)) * 0.1).astype(np.float32)
    sf.write(path, wave, 24000, subtype="FLOAT")
    audio[f"k{i}"] = path
    segments.append(PlanSegment(key=f"k{i}", kind="text", text="x", tokens=None, audio=None, est_tokens=1,
                                pause_after_ms=300, paragraph=i, start_ms=i * gap_ms if gap_ms else -1))
start = time.perf_counter()
chapter = assemble_chapter(PlanChapter(0, "c", tuple(segments)), audio, folder / "out.flac",
                           timed=bool(gap_ms))
print(json.dumps({"audio_h": round(chapter.samples / 24000 / 3600, 2),
                  "seconds": round(time.perf_counter() - start, 1),
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}))
"""


def part_assembly() -> dict[str, Any]:
    rows = {}
    for case in ("dense", "timed"):
        with tempfile.TemporaryDirectory() as tmp:
            done = subprocess.run([sys.executable, "-c", ASSEMBLE, case, tmp], capture_output=True, text=True,
                                  cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, check=True)
        rows[case] = json.loads(done.stdout.strip().splitlines()[-1])
        r = rows[case]
        print(f"assemble a {case} chapter of {r['audio_h']} h: {r['seconds']} s, "
              f"peak RSS {r['peak_rss_mb']} MB", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="parse,api,assembly")
    parser.add_argument("--quick", action="store_true",
                        help="leave out the two PDFs that run to the CPU limit")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    report: dict[str, Any] = {"command": " ".join(sys.argv), "cpu": cpu_model(), "cores": os.cpu_count(),
                              "load_before": os.getloadavg()}
    parts = {"parse": lambda: part_parse(args.quick), "api": part_api, "assembly": part_assembly}
    for name in args.parts.split(","):
        print(f"== {name}", flush=True)
        report[name] = parts[name]()
    report["load_after"] = os.getloadavg()
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
