"""The broker and the wire contract: the Celery app every process builds (celery_config), task
names, priorities and senders (wire), and what wavefarm asks the broker itself (queues)."""
