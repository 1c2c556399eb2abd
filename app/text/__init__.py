"""Text to speech tokens, shared by text jobs (`app.submission.jobs`, `tasks/text.py`) and books
(`app.books`):

    normalise    English normalisation (numbers: `numbers`); sentence and paragraph segmentation, each
                 segment with the pause after it
    numbers      numerals spelt out for the guide voice (cardinals, ordinals, years, decimals, currency)
    guide_voice  espeak-ng speaks a segment's text at 16 kHz (the S3 tokenizer reads it)
    tokens       a text job's speech: `check_text` at submission (cheap), `text_speech` on a CPU worker
    guide_speech a text job's guide speech on its way to the GPU worker, which tokenizes it

It imports neither `app.submission.jobs` nor `app.books`, so both can import it.
"""
