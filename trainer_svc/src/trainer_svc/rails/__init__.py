"""Safety rails: the launch gates and preflight checks, banding, the canary, the collapse tripwire."""
