"""protocol: the only code the trainer and the rollout service share.

- messages: the request, result and worker-status types (msgspec), with their validation;
- spool: the crash-safe filesystem spool (its docstring lists the guarantees and which spool_*
  module holds each part);
- watch: file events as hints that wake a scanner;
- client: submit and wait with deadlines;
- evaluation, jsonl: eval jobs through the spool, and the JSONL reading they share with the trainer;
- weights_dir: the weights-directory contract (step names, the manifest, content ids) that the
  trainer writes and workers read; weight_delta: sparse deltas between two publishes (numpy);
  weight_slots: weights published into shared-memory slots, with readers' leases (the same-host path);
- cli: `spoolctl`, the operator's view of a spool.
"""

__version__ = "0.1.0"
