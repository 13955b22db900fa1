# `make demo` is the main job on the demo fleet (mk/service.mk: demo-fleet).
# `make demo-patch`: only the view play (quant-config patch), on a generated
# Kimi-K2.5-NVFP4-shaped checkpoint on this machine (no containers needed).
DEMO_DIR := $(VLLM_FLEET_CACHE)/demo
DEMO_STORAGE := $(DEMO_DIR)/models

# Prerequisites appended by fragments included after this one still count.
.SECONDEXPANSION:
demo: venv $$(DEMO_DEPS) demo-fleet

demo-patch: venv
	rm -rf $(DEMO_STORAGE)
	$(BIN)/python tests/support/kimi_checkpoint.py $(DEMO_STORAGE)/tiny-kimi > /dev/null
	$(BIN)/ansible-playbook -i inventory/local/hosts.yml playbooks/demo_patch.yml --diff \
	  -e vllm_fleet_storage_root=$(DEMO_STORAGE)
