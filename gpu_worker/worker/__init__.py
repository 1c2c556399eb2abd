"""The GPU worker process around the engine: the Celery worker (process), one synth
task's body (job), the composition root (runtime), the engine thread (loop), the feature-store and
inline-preparation adapters, the database bookkeeping, metrics and the watchdog."""
