"""The content id of a weights directory: what a worker reports in results and what a producer
may demand in a request (`weights_content_id`), so both sides compute it here.

A checkpoint's own `manifest.json` `content_id` wins (the trainer writes a unique one per save).
Without one, the id hashes config.json and each shard's name, size, inode and mtime: it changes
whenever a shard is rewritten, so the same path with new content is told apart, and it costs no
read of the weights.
"""

from __future__ import annotations

import hashlib
import json
import os


def safetensors_shards(directory: str) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.endswith(".safetensors"))


def weights_content_id(directory: str, shards: list[str] | tuple[str, ...] | None = None) -> str:
    try:
        with open(os.path.join(directory, "manifest.json"), "rb") as f:
            declared = json.loads(f.read()).get("content_id")
        if isinstance(declared, str) and declared:
            return declared
    except (OSError, ValueError, AttributeError):
        pass
    digest = hashlib.sha256()
    with open(os.path.join(directory, "config.json"), "rb") as f:
        digest.update(f.read())
    for shard in shards if shards is not None else safetensors_shards(directory):
        st = os.stat(os.path.join(directory, shard))
        digest.update(f"{shard}:{st.st_size}:{st.st_ino}:{st.st_mtime_ns}".encode())
    return "stat-" + digest.hexdigest()[:16]
