# containers.podman ships inside the `ansible` wheel on PyPI; Galaxy is
# unreachable here, so take the collection from there, keyed by version.
ANSIBLE_WHEEL_VERSION := 12.3.0
COLLECTIONS_DIR := $(CURDIR)/.cache/collections/ansible_collections

.PHONY: collections
collections: $(COLLECTIONS_DIR)/containers/podman/MANIFEST.json
$(COLLECTIONS_DIR)/containers/podman/MANIFEST.json: mk/collections.mk | venv
	$(BIN)/python tools/extract_collections.py --ansible-version $(ANSIBLE_WHEEL_VERSION) \
	  --cache $(VLLM_FLEET_CACHE)/wheels --dest $(COLLECTIONS_DIR) containers.podman ansible.posix
