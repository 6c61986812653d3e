"""Exit codes shared by `trainer-svc` and `rollout-svc`, so scripts and systemd can tell
outcomes apart. Values follow sysexits.h where one fits."""

OK = 0  # done: the run finished, or the worker stopped on SIGTERM or idle exit
INTERNAL_ERROR = 1  # a bug or an unexpected failure: read the log (a worker whose heartbeat failed exits so too)
USAGE = 2  # bad command line, config, data or model directory: nothing expensive was started
GATE_REFUSED = 3  # a launch gate refused the run; its message says what to change
TRIPWIRE = 4  # the collapse tripwire stopped the run; the checkpoint it pinned is kept
OUT_OF_MEMORY = 71  # EX_OSERR: a training step ran out of device memory; the message says what to change, then relaunch
ROLLOUT_UNAVAILABLE = 69  # EX_UNAVAILABLE: no rollout worker serves the spool
CANNOT_WRITE = 74  # EX_IOERR: a full disk or quota (ENOSPC, EDQUOT, EFBIG) failed a write; free space, then relaunch
RESUMABLE_STOP = 75  # EX_TEMPFAIL: stopped at a step boundary (SIGTERM, wall-clock limit); relaunch to resume
