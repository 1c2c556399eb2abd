"""Voices on the device: the device half of prompt preparation (prompt, speaker models),
the installed-voice cache (pins, LRU eviction, side-stream installs) and the lanes' voice slots."""
