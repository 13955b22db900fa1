# promtool (Prometheus' rule checker) for the monitoring role's rule tests,
# from the very Debian package the role installs on the monitoring host.
# Installing that package here would start a Prometheus service on this host,
# so `apt-get download` fetches the .deb and only usr/bin/promtool is kept, in
# $(VLLM_FLEET_CACHE) keyed by the package version: a rerun costs nothing.
#
#   make promtool        fetch it (needs apt's package lists: apt-get update)
#   make unit            the unit tests get it as $VLLM_FLEET_PROMTOOL
#
# PROMTOOL=/usr/bin/promtool make unit uses another promtool instead. When
# bookworm publishes a newer prometheus, set PROMETHEUS_DEB_VERSION to
# `apt-cache policy prometheus`'s candidate (the archive keeps only that one).

PROMETHEUS_DEB_VERSION ?= 2.42.0+ds-5+deb12u1
PROMTOOL_DIR := $(VLLM_FLEET_CACHE)/promtool/$(PROMETHEUS_DEB_VERSION)
PROMTOOL ?= $(PROMTOOL_DIR)/promtool
export VLLM_FLEET_PROMTOOL := $(PROMTOOL)

.PHONY: promtool
promtool: $(PROMTOOL)

# Built in a scratch directory beside the result and moved in last, so an
# interrupted download never leaves a half-made promtool behind.
$(PROMTOOL):
	@set -euo pipefail; \
	mkdir -p "$(PROMTOOL_DIR)"; \
	tmp=$$(mktemp -d "$(PROMTOOL_DIR)/.fetch.XXXXXX"); \
	trap 'rm -rf "$$tmp"' EXIT; \
	( cd "$$tmp" && apt-get download -q -o APT::Sandbox::User=root \
	    "prometheus=$(PROMETHEUS_DEB_VERSION)" ) || { \
	  echo "promtool: apt-get download prometheus=$(PROMETHEUS_DEB_VERSION) failed." \
	    "Run apt-get update, or set PROMETHEUS_DEB_VERSION to the version" \
	    "'apt-cache policy prometheus' offers." >&2; exit 1; }; \
	dpkg-deb -x "$$tmp"/prometheus_*.deb "$$tmp/root"; \
	install -m 0755 "$$tmp/root/usr/bin/promtool" "$$tmp/promtool"; \
	mv -f "$$tmp/promtool" "$@"; \
	"$@" --version | head -n 1

unit: promtool
