"""Reading sources: each book format -> `SourceBook` (text, Markdown, EPUB, HTML, PDF, DOCX,
subtitles, a JSON manifest), within the limits on client input; the publication details they carry."""
