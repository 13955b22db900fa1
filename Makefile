# vllm-fleet: every entry point a person or CI uses.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PY ?= python3
VENV := $(CURDIR)/.venv
BIN := $(VENV)/bin
# Heavy artifacts (node image, vLLM wheelhouse, tiny models) live outside the
# clone, keyed by their recipe, so reruns and fresh clones reuse them.
export VLLM_FLEET_CACHE ?= $(HOME)/.cache/vllm-fleet
export PATH := $(BIN):$(PATH)
export ANSIBLE_CONFIG := $(CURDIR)/ansible.cfg
export ANSIBLE_FORCE_COLOR ?= 0
export PYTHONDONTWRITEBYTECODE := 1

# Fragments (mk/*.mk) add their prerequisites to these.
INTEGRATION_DEPS :=
DEMO_DEPS :=

.PHONY: help venv lint unit check integration test demo clean

help:
	@echo "make demo   - deploy the main job on the embedded demo fleet"
	@echo "make test   - lint, unit, Molecule, end-to-end (what CI runs)"
	@echo "make check  - the fast inner loop: lint + unit"

venv: $(VENV)/.stamp
$(VENV)/.stamp: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

lint: venv collections
	$(BIN)/yamllint -s .
	$(BIN)/ansible-lint -q
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

unit: venv
	$(BIN)/pytest -q tests/unit

check: lint unit

include $(sort $(wildcard mk/*.mk))

# A subset: make integration TESTS='tests/integration/test_cli.py -k status'
TESTS ?= tests/integration
integration: venv collections $(INTEGRATION_DEPS)
	$(BIN)/pytest -q --durations=25 $(TESTS)

test: lint unit molecule integration

clean:
	rm -rf $(VENV) .cache .pytest_cache .ruff_cache
