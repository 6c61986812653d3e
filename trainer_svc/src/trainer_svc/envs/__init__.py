"""Multi-turn and tool-use episodes: environments users write (api), run in worker processes
(pool), talking with the policy turn by turn through the spool with exact token ids (render,
episodes), as the step sampler's samples (sampler), resumed by replaying a journal (journal).

Importing this package loads only what an environment needs (api): environments import it in
their worker processes.
"""

from .api import Environment, Step, tool

__all__ = ["Environment", "Step", "tool"]
