"""Voices and their features: the voice service (store a reference once, queue its preparation),
names (a name, an id or a unique prefix finds a voice), the host half of prompt preparation
(features) and the unit of work that runs it (preparation)."""
