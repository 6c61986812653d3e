"""The rollout side: the calls the trainer sends through the spool (client), the worker it may
spawn and where, and each step's sampling (first sampling, spares, retries, advantages)."""
