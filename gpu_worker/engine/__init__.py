"""The engine and its lanes: jobs in, one batched decode step at a time, events out.

core (add / abort / step), scheduler (pure policy), inbox (what other threads hand it), resolver
(how a waiting job's voice becomes ready), decoder (the batched streaming decoder over the lanes),
streams (the shared vocabulary). No Celery, Redis or database inside."""
