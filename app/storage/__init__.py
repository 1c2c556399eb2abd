"""Where state that is not SQL lives: the Redis feature store and its key names, and the
artifact root on disk (references, token lists, outputs)."""
