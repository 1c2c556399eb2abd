"""Writing outputs: chapter files, M4B and MP3s with their tags, loudness, the chapter index
(JSON, WebVTT), Audiobookshelf's files and the read-along EPUB 3 with its Media Overlays."""
