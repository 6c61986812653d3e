"""rollout_svc: a rollout worker that serves generation requests from a spool.

Guarantees (tested in tests/unit/test_worker.py and tests/e2e/):
- every request it claims ends with exactly one published result, or goes back to requests/
  (SIGTERM), or is recovered by another worker after the lease (SIGKILL);
- a bad request gets an error result and is kept in bad/; the worker keeps serving;
- it heartbeats into workers/<id>.json and stops publishing when that heartbeat fails;
- it exits 0 on SIGTERM and after --idle-exit seconds without requests.
"""

__version__ = "0.1.0"
