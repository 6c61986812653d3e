"""rollout_svc: a rollout worker that serves generation requests from a spool.

Guarantees (tested in tests/unit/test_worker.py, tests/unit/test_engine_host.py, tests/e2e/ and,
on a GPU, tests/gpu/):
- every request it claims ends with exactly one published result, or goes back to requests/
  (SIGTERM), or is recovered by another worker after the lease (SIGKILL);
- a bad request gets an error result and is kept in bad/; the worker keeps serving;
- it heartbeats into workers/<id>.json and stops publishing when that heartbeat fails;
- it exits 0 on SIGTERM and after --idle-exit seconds without requests;
- its vLLM engine lives in a process of its own: a rebuild or an exit ends that process and all
  it started, and waits until they are gone (their device memory with them);
- with --sleep-when-idle, an idle engine gives its device memory back and the status file says
  "sleeping" until a request wakes it.
"""

__version__ = "0.1.0"
