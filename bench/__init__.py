"""The benchmarks behind docs/BENCHMARKS.md, one script each, run from the repository root as
`python -m bench.NAME` (bench/README.md lists them, with what each needs). Each has a tiny mode,
`--tiny`, that `make test` runs (tests/unit/test_bench_tiny.py, tests/trainer/test_bench_tiny.py)."""
