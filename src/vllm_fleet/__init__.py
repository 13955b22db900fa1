"""vllm-fleet: drive the toolkit's playbooks through ansible-runner, with live progress."""

__version__ = "0.1.0"
