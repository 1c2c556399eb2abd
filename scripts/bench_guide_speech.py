"""The CPU worker's half of a text segment, in CPU seconds per second of speech: espeak-ng (the guide
voice), int16 framing and safetensors encoding (`app.text.tokens.segment_speech`, `GuideSpeech.encode`),
as `book.tokenize` and `job.tokenize` run it. The S3 tokenizer runs on the GPU worker and is not here;
Celery, database and Redis round trips are not either.

    python scripts/bench_guide_speech.py [--repeat 15]

Prints one line: segments, seconds of speech, CPU seconds (`time.process_time`, this process) and their
ratio. docs/SCALING.md's row "CPU worker per text segment" is this figure.
"""

from __future__ import annotations

import argparse
import time

from app.text.tokens import segment_speech

SENTENCES = ["The ferry left at dawn, and the gulls followed it out past the harbour wall.",
             "She counted the lights along the shore until the fog took them one by one.",
             "Nobody on the deck spoke; the engine's beat was the only sound for an hour.",
             "At noon the island rose out of the grey, greener than anyone had promised."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=15, help="times the four sentences are spoken")
    args = parser.parse_args()
    segment_speech("Warm up.", "en")  # loads espeak-ng once, outside the measurement
    texts = SENTENCES * args.repeat
    started, audio_s = time.process_time(), 0.0
    for text in texts:
        speech = segment_speech(text, "en")
        speech.encode()
        audio_s += speech.segments[0].size / 16000
    cpu_s = time.process_time() - started
    print(f"segments={len(texts)} audio_s={audio_s:.1f} cpu_s={cpu_s:.3f} "
          f"cpu_s_per_audio_s={cpu_s / audio_s:.5f}")


if __name__ == "__main__":
    main()
