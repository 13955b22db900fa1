#!/usr/bin/env bash
# Install the Debian packages the container test hosts need, only if missing:
# podman runs the nodes; runc because crun refuses this host's hybrid cgroups;
# debootstrap builds the node image without a registry; uidmap, slirp4netns and
# fuse-overlayfs are podman's usual companions.
set -euo pipefail

PACKAGES=(podman runc debootstrap uidmap slirp4netns fuse-overlayfs)

missing=()
for pkg in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$pkg")
  fi
done
if ((${#missing[@]} == 0)); then
  echo "hosts: packages present: ${PACKAGES[*]}"
  exit 0
fi
if ((EUID != 0)); then
  echo "hosts: missing packages ${missing[*]}; run as root (rootful podman)" >&2
  exit 1
fi
echo "hosts: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends "${missing[@]}"
