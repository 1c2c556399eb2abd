"""Planning: `SourceBook` -> `BookPlan` (chapters -> segments with content keys), the cast,
the lexicon, chapter selection, each segment's token source, and what a read-along shows."""
