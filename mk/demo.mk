# Interim `make demo`: the quant-config patch play on a generated
# Kimi-K2.5-NVFP4-shaped checkpoint on this machine. A later issue replaces it
# with the full deploy on the demo fleet.
DEMO_DIR := $(VLLM_FLEET_CACHE)/demo
DEMO_STORAGE := $(DEMO_DIR)/models

# Prerequisites appended by fragments included after this one still count.
.SECONDEXPANSION:
demo: venv $$(DEMO_DEPS)
	rm -rf $(DEMO_STORAGE)
	$(BIN)/python tests/support/kimi_checkpoint.py $(DEMO_STORAGE)/tiny-kimi > /dev/null
	$(BIN)/ansible-playbook -i inventory/local/hosts.yml playbooks/demo_patch.yml --diff \
	  -e vllm_fleet_storage_root=$(DEMO_STORAGE)
