"""trainer_svc: the GRPO trainer. It talks to rollout workers only through the spool
(protocol), and never imports rollout_svc."""

__version__ = "0.1.0"
