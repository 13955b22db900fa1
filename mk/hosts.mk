# Test hosts (issue 3): podman containers with systemd as PID 1 that stand in
# for fleet nodes in Molecule, the end-to-end tests and the demo.
HOSTS_TOOLS := $(CURDIR)/tools/hosts
# Host-fitted podman settings (runtime, ulimits, cgroup mounts); see
# tools/hosts/containers-conf.sh.
export CONTAINERS_CONF := $(VLLM_FLEET_CACHE)/containers.conf
# The node image, tagged by a hash of its recipe.
export VLLM_FLEET_NODE_IMAGE := $(shell $(HOSTS_TOOLS)/node-image.sh tag)
# One scenario only: make molecule SCENARIO=roles/<role>/molecule/default
SCENARIO ?=
# Demo fleet size. inventory/demo lists 2 nodes; for another size use
# `python -m tests.support.fleet inventory --nodes N` as the inventory.
VLLM_FLEET_NODES ?= 2
# What scenarios need built first (e.g. a wheelhouse): MOLECULE_DEPS += target
MOLECULE_DEPS ?=

.PHONY: hosts molecule fleet-up fleet-down

hosts:
	$(HOSTS_TOOLS)/packages.sh
	$(HOSTS_TOOLS)/containers-conf.sh $(CONTAINERS_CONF)
	$(HOSTS_TOOLS)/node-image.sh ensure

# Second expansion: fragments included after this one may add MOLECULE_DEPS.
.SECONDEXPANSION:
molecule: hosts collections venv $$(MOLECULE_DEPS)
	$(BIN)/python $(HOSTS_TOOLS)/molecule_all.py $(SCENARIO)

fleet-up: hosts venv
	$(BIN)/python -m tests.support.fleet up --nodes $(VLLM_FLEET_NODES)

fleet-down: venv
	$(BIN)/python -m tests.support.fleet down

INTEGRATION_DEPS += hosts
DEMO_DEPS += hosts
