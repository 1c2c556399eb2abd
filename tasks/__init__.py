"""The Celery app and the CPU tasks: thin adapters over `app/` (ids in, ids out)."""
