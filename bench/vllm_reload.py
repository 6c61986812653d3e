"""In-place weight reload against an engine rebuild, in one process, same model shape.

    .venvs/rollout/bin/python -m bench.vllm_reload [--hidden 128 --layers 2] [--reloads 10] [--json OUT]

The engine is rollout_svc's VllmEngine, so each reload includes what the worker does: inspect
the directory, reload_weights in place, reset the prefix cache, and verify the live tensors
against the files. A rebuild is closing the engine and building it again for the other
weights. Target: median reload <= 1/20 of a rebuild.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import report
from bench.engines import make_engine
from bench.models import build_models, parameter_count

TARGET_RATIO = 1 / 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--reloads", type=int, default=10)
    parser.add_argument("--rebuilds", type=int, default=2)
    parser.add_argument("--json")
    parser.add_argument("--tiny", action="store_true", help="a check of the script: no engine (loads read the files)")
    args = parser.parse_args()
    if args.tiny:
        args.hidden, args.layers, args.reloads, args.rebuilds = 64, 1, 2, 1

    from rollout_svc.weights import WeightsPolicy

    root = Path(tempfile.mkdtemp(prefix="bench-reload-"))
    models = build_models(root, ["a", "b"], hidden=args.hidden, layers=args.layers)
    engine = make_engine(args.tiny, policy=WeightsPolicy([str(root)]))
    first_build = engine.ensure_weights(str(models["a"]))
    rebuilds = []
    for i in range(args.rebuilds):
        engine.close()
        rebuilds.append(engine.ensure_weights(str(models["b" if i % 2 == 0 else "a"])))
    reloads = []
    held = "a" if args.rebuilds % 2 == 0 else "b"  # the rebuilds alternate b, a, b, ...
    for _ in range(args.reloads):
        # Always the checkpoint the engine does not hold: a request for the held one loads nothing.
        held = "b" if held == "a" else "a"
        started = time.monotonic()
        load = engine.load(str(models[held]))
        reloads.append(time.monotonic() - started)
        assert load.bytes > 0, "a reload that loaded nothing would time a no-op"
    engine.close()
    rebuild = statistics.median(rebuilds)
    reload = statistics.median(reloads)
    report(
        "vllm_reload",
        {
            "parameters": parameter_count(models["a"]),
            "first_build_s": round(first_build, 3),
            "rebuild_s_median": round(rebuild, 3),
            "reload_s_median": round(reload, 4),
            "reload_s_max": round(max(reloads), 4),
            "reload_over_rebuild": round(reload / rebuild, 5),
            "target_ratio": TARGET_RATIO,
            "met": reload / rebuild <= TARGET_RATIO,
        },
        args.json,
    )


if __name__ == "__main__":
    main()
