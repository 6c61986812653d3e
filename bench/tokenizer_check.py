"""What a worker's check of a new tokenizer costs before its engine process starts: counting it
through transformers (its import, then AutoTokenizer) against the `tokenizers` library
(rollout_svc.engines.tokenizer_check.tokenizer_size), each in a fresh interpreter, in turn.

    .venvs/rollout/bin/python -m bench.tokenizer_check [--model build/smollm2-135m-instruct] [--rounds 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from bench.common import ROOT, report

TRANSFORMERS = """
import json, sys, time
started = time.perf_counter()
from transformers import AutoTokenizer
imported = time.perf_counter()
size = len(AutoTokenizer.from_pretrained(sys.argv[1]))
print(json.dumps({"import_s": imported - started, "load_s": time.perf_counter() - imported, "size": size}))
"""
TOKENIZERS = """
import json, sys, time
from rollout_svc.engines.tokenizer_check import tokenizer_size
started = time.perf_counter()
size = tokenizer_size(sys.argv[1])
seconds = time.perf_counter() - started
print(json.dumps({"count_s": seconds, "size": size, "transformers": "transformers" in sys.modules}))
"""


def tiny_tokenizer() -> Path:
    """rollout_svc.tiny_model's character tokenizer, alone in a temporary directory."""
    import tempfile

    from rollout_svc.tiny_model import write_tokenizer

    directory = Path(tempfile.mkdtemp(prefix="bench-tokenizer-"))
    write_tokenizer(directory, max_positions=64)
    return directory


def timed(code: str, model: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", code, str(model)], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / "build" / "smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    parser.add_argument("--tiny", action="store_true", help="a check of the script: a tiny tokenizer, one round")
    args = parser.parse_args()
    if args.tiny:
        args.model, args.rounds = tiny_tokenizer(), 1
    rows = [(timed(TRANSFORMERS, args.model), timed(TOKENIZERS, args.model)) for _ in range(args.rounds)]
    assert all(a["size"] == b["size"] for a, b in rows), "the two counts differ"
    figures = {
        "model": str(args.model),
        "tokens": rows[0][0]["size"],
        "transformers_import_s": round(statistics.median(a["import_s"] for a, _ in rows), 3),
        "transformers_load_s": round(statistics.median(a["load_s"] for a, _ in rows), 3),
        "tokenizers_count_s": round(statistics.median(b["count_s"] for _, b in rows), 3),
        "tokenizers_imported_transformers": any(b["transformers"] for _, b in rows),
    }
    report("tokenizer_check", figures, args.json)


if __name__ == "__main__":
    main()
