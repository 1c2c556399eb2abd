"""A job's way in: submit one (jobs) or many (batch), and which GPU worker's queue its
synth goes to (routing)."""
