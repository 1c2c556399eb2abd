"""The engine and its lanes: jobs in, one batched decode step at a time, events out.

core (add / abort / fetch_features / step), live (its record of a job, its knobs), scheduler (pure
policy), inbox (what the input side hands it: jobs, aborts, the feature store's answers, read before a
step), resolver (how a waiting job's voice becomes ready), decoder (the batched streaming decoder over the
lanes), streams (the shared vocabulary). No Celery, Redis or database inside `step()`: the store is read
through the `FeatureSource` it is given, on the input side."""
