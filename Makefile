# Two separate virtual environments, one per service; protocol is installed in both.
# Every target creates what it needs and does nothing when it is already there.
#
#   make demo        the main job on the embedded default
#   make test        the whole test suite
#   make bench       the benchmarks behind docs/BENCHMARKS.md
#
# TORCH_INDEX_URL: an extra package index for torch wheels (for example PyTorch's CPU index).
# Unset by default, so pip never waits on an index this machine cannot reach.

PYTHON ?= python3
VENVS := .venvs
ROLLOUT := $(VENVS)/rollout
TRAINER := $(VENVS)/trainer
PIP_EXTRA := $(if $(TORCH_INDEX_URL),--extra-index-url $(TORCH_INDEX_URL),)

.PHONY: venvs demo test bench clean

venvs: $(ROLLOUT)/.installed $(TRAINER)/.installed

$(ROLLOUT)/.installed: protocol/pyproject.toml rollout_svc/pyproject.toml
	$(PYTHON) -m venv $(ROLLOUT)
	$(ROLLOUT)/bin/pip install --quiet $(PIP_EXTRA) -e 'protocol[test]' -e rollout_svc
	touch $@

$(TRAINER)/.installed: protocol/pyproject.toml trainer_svc/pyproject.toml
	$(PYTHON) -m venv $(TRAINER)
	$(TRAINER)/bin/pip install --quiet $(PIP_EXTRA) -e 'protocol[test]' -e trainer_svc
	touch $@

demo: venvs
	$(ROLLOUT)/bin/python scripts/demo.py

test: venvs
	$(ROLLOUT)/bin/python -m pytest tests

bench: venvs
	$(ROLLOUT)/bin/python bench/spool_roundtrip.py

clean:
	rm -rf $(VENVS)
