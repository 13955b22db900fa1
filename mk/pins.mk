# Every vLLM pin (role vllm_fleet's default, inventories, model profiles) has a wheel on its
# index for the nodes' Python and platform: read from the index's listing.
.PHONY: check-pins
check-pins: venv
	$(BIN)/python tools/check_pins.py

test: check-pins
