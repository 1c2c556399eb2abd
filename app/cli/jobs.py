"""Client commands for jobs and voices: submit, status, cancel, jobs, voices.

They speak HTTP to the API, or with `--local` run the same services in this process (`app.api.client`);
either way they print the API's JSON shapes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from app.cli.audio_out import output_plan, write_output
from app.cli.common import add_client_options, client, finished_well, print_json, read_file, voice_id_for
from app.errors import BadInput
from app.speech import OutputFormat


def add_commands(sub: Any) -> None:
    def command(name: str, help_: str, handler: Any) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_)
        add_client_options(p)
        p.set_defaults(handler=handler)
        return p

    submit = command("submit", "submit a job: a voice (id or reference file) and speech tokens or text",
                     cmd_submit)
    submit.add_argument("--voice", help="voice id (sha256), name or a reference audio file (required, "
                        "except for a --batch file whose items each name their voice_id)")
    what = submit.add_mutually_exclusive_group(required=True)
    what.add_argument("--tokens", type=Path, help="JSON file: [ids] or {\"tokens\": [ids]}")
    what.add_argument("--batch", type=Path, metavar="PATH", help="many jobs: a JSON-lines file or JSON array "
                      "of job requests, or a folder of token files; one line per result, then a summary")
    what.add_argument("--text", help="text to speak (through the guide voice), up to about 10 minutes of "
                      "speech (WAVEFARM_MAX_TEXT_JOB_S); a longer text is refused: render it as a book, "
                      "wavefarm book render FILE.txt; @FILE reads the text from a file")
    submit.add_argument("--language", help="the text's language tag (default en), e.g. en-GB, de")
    submit.add_argument("-o", "--output", type=Path, help="where to write the audio (implies --wait); "
                        "its extension chooses the container: .wav, .flac, .mp3, .opus, .ogg, .m4a")
    submit.add_argument("--seed", type=int)
    submit.add_argument("--format", dest="output_format", choices=[f.value for f in OutputFormat],
                        help="the job's own audio format (default wav; with -o, its extension's)")
    submit.add_argument("--priority", type=int, default=0)
    submit.add_argument("--idempotency-key", help="with --batch: the prefix of each item's key")
    submit.add_argument("--wait", action="store_true", help="follow progress until the job finishes")
    command("status", "show a job", cmd_status).add_argument("job_id")
    command("cancel", "cancel a job", cmd_cancel).add_argument("job_id")
    jobs = command("jobs", "list recent jobs", cmd_jobs)
    jobs.add_argument("--status")
    jobs.add_argument("--voice-id")
    jobs.add_argument("--limit", type=int, default=20, help="jobs a page (default 20)")
    jobs.add_argument("--after", metavar="CURSOR", help="the page after this cursor (printed after a page)")
    jobs.add_argument("--all", action="store_true", help="page through every job, newest first")
    voices = command("voices", "list voices, upload one with --add, name one with --name", cmd_voices)
    voices.add_argument("--add", type=Path, metavar="FILE", help="upload a reference audio file")
    voices.add_argument("--name", help="a unique name for the voice (with --add, or with --voice)")
    voices.add_argument("--voice", metavar="VOICE", help="the stored voice to name (id, name or id prefix)")


def cmd_submit(args: argparse.Namespace) -> int:
    from app.api.client import follow
    from app.api.schemas import parse_tokens

    if args.batch is not None:
        return _submit_batch(args)
    if args.voice is None:
        raise BadInput("--voice is required (except with --batch)")
    text = _text_of(args.text)
    if args.language is not None and text is None:
        raise BadInput("--language goes with --text")
    output_format = output_plan(args.output, args.output_format) if args.output else args.output_format
    tokens = None if args.tokens is None else parse_tokens(read_file(args.tokens, "tokens file"))
    api = client(args)
    job = api.submit(voice=voice_id_for(api, args.voice), tokens=tokens, text=text, language=args.language,
                     seed=args.seed, output_format=output_format or OutputFormat.WAV.value,
                     priority=args.priority, idempotency_key=args.idempotency_key)
    print(job["id"])
    if not (args.wait or args.output):
        return 0
    job = follow(api, job["id"])
    if not finished_well("job", job):
        return 1
    if args.output:
        write_output(args.output, api.audio(job["id"]))
        print(f"audio written to {args.output}")
    return 0


def _submit_batch(args: argparse.Namespace) -> int:
    from app.cli import batch

    if args.wait or args.output or args.language:
        raise BadInput("--wait, -o and --language go with one job, not --batch")
    items = batch.read_items(args.batch)
    api = client(args)
    voice = voice_id_for(api, args.voice) if args.voice else None
    return batch.submit_all(api, batch.with_defaults(items, args, voice))


def _text_of(value: str | None) -> str | None:
    """--text's value: the text itself, or with a leading @ the UTF-8 file it names."""
    if value is None or not value.startswith("@"):
        return value
    try:
        return read_file(Path(value[1:]), "text file").decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadInput(f"{value[1:]} is not UTF-8 text ({exc})") from exc


def cmd_status(args: argparse.Namespace) -> int:
    print_json(client(args).job(args.job_id))
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    job = client(args).cancel(args.job_id)
    print(f"job {job['id']}: {job['status']}")
    return 0


def cmd_jobs(args: argparse.Namespace) -> int:
    if args.status is not None:  # the models (SQLAlchemy) are loaded only to check a given status
        from app.db.models import JobStatus

        if args.status not in tuple(JobStatus):
            raise BadInput(f"--status {args.status!r} is not one of {', '.join(JobStatus)}")
    api, after = client(args), args.after
    while True:
        page, after = api.jobs_page(status=args.status, voice_id=args.voice_id, after=after, limit=args.limit)
        for job in page:
            done, total = job["progress"]["frames_done"], job["progress"]["frames_total"]
            print(f"{job['id']}  {job['status']:<10} {done:>7}/{total:<7} voice {job['voice_id'][:12]}")
        if after is None:
            return 0
        if not args.all:
            print(f"more: --after {after} (or --all)", file=sys.stderr)
            return 0


def cmd_voices(args: argparse.Namespace) -> int:
    api = client(args)
    if args.add and args.voice:
        raise BadInput("give --add FILE or --voice VOICE, not both")
    if args.voice and not args.name:
        raise BadInput("--voice names the voice to rename: give --name too")
    if args.add:
        voice = api.add_voice(read_file(args.add, "reference audio file"))
        print_json(api.rename_voice(voice["id"], args.name) if args.name else voice)
        return 0
    if args.voice:
        print_json(api.rename_voice(args.voice, args.name))
        return 0
    for voice in api.voices():
        print(f"{voice['id']}  {voice.get('name') or '-':<16} {voice['status']:<9} uses {voice['uses']}")
    return 0
