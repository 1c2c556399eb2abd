"""Audiobooks, the pipeline-independent half: a book file in, chapter audio and an M4B out.

    source       `SourceBook` (chapters of paragraphs or items), the limits on input, and what every
                 reader shares (decoding text, finishing a book)
    parse        text, Markdown, EPUB or a JSON manifest -> `SourceBook` (picks the reader)
      epub         EPUB 2/3 reader (spine order, TOC titles, cover); safezip: its zip-bomb guards
      manifest     JSON manifest of speech tokens (API) or source audio files (CLI)
    plan         `SourceBook` -> `BookPlan` (chapters -> segments, each with a content key; the text's
                 normalisation, segmentation and guide voice are `app.text`'s, shared with text jobs)
    tokens       a segment's token source: its own tokens, text through the guide voice, or speech to
                 re-voice -> S3 tokens
    assemble     rendered segments -> chapter WAV/FLAC and one M4B with chapter markers
      index        the chapter index: JSON and WebVTT with segment timings
      output       `assemble_book`: all of it in one folder, reusing chapters whose inputs are unchanged
    files        a book's files under the artifact root (plan, meta, cover, outputs)
    service      submit, cancel, segment jobs: what the API, the CLI and `tasks.books` call
    render       a chapter's file once its segments are done, and the whole book's at the end
    status       progress per book and chapter, from the database

Languages: English text is normalised (numbers, ordinals, years, decimals, currency, common
abbreviations, punctuation). Text in any other language passes through unnormalised (Unicode and
whitespace clean-up only) and is split on sentence punctuation; the guide voice speaks it with the
espeak-ng voice named by the book's language.

Nothing here imports Celery or the GPU worker: `tasks/books.py` schedules this work, and tasks are sent by
name. Reading a book, planning it and assembling audio touch no database or Redis; `service`, `render`
and `status` keep a book's state in the database. Refusals of client input raise `app.errors.BadInput`
with the reason.
"""
