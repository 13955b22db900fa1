#!/usr/bin/env bash
# The test-node image: Debian bookworm with systemd as PID 1, python3 and
# openssh-server, built with debootstrap and `podman import` (no registry).
# Its tag is a hash of its recipe (node-image/), so a changed
# recipe builds a new image and an unchanged one is reused; the rootfs tarball
# is kept under $VLLM_FLEET_CACHE/images/ for later clones.
#
#   node-image.sh tag      print the image reference for the current recipe
#   node-image.sh ensure   build/import it unless already there
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
cache=${VLLM_FLEET_CACHE:-$HOME/.cache/vllm-fleet}/images
name=localhost/vllm-fleet-node

# shellcheck source=node-image/recipe.sh
source "$here/node-image/recipe.sh"

recipe_hash() {
  (cd "$here" && find node-image -type f | LC_ALL=C sort | xargs sha256sum) |
    sha256sum | cut -c1-12
}

# The Debian mirror this machine's apt already uses (reachable here).
host_mirror() {
  local uri
  uri=$(grep -hs -m1 -E '^URIs:.*debian/?$' /etc/apt/sources.list.d/*.sources | awk '{print $2}' || true)
  [[ -z $uri ]] && uri=$(grep -hs -m1 -E '^deb +[^ ]+debian/? ' /etc/apt/sources.list | awk '{print $2}' || true)
  echo "${uri:-http://deb.debian.org/debian}"
}

build_tarball() {
  local tarball=$1
  rootfs=$(mktemp -d "${cache}/rootfs.XXXXXX")
  trap 'rm -rf "$rootfs"' EXIT
  echo "hosts: debootstrap $SUITE from $(host_mirror)"
  debootstrap --variant=minbase --include="$INCLUDE" "$SUITE" "$rootfs" "$(host_mirror)" \
    > "$cache/debootstrap.log" 2>&1 || { tail -n 30 "$cache/debootstrap.log" >&2; return 1; }
  customize_rootfs "$rootfs"
  tar --numeric-owner -C "$rootfs" -cf "$tarball.tmp" .
  mv "$tarball.tmp" "$tarball"
  rm -rf "$rootfs"
}

ensure() {
  local tag ref tarball
  tag=$(recipe_hash)
  ref="$name:$tag"
  tarball="$cache/vllm-fleet-node-$tag.tar"
  mkdir -p "$cache"
  # Several sessions may call this at once: one builds, the others wait.
  exec 9>"$cache/.lock"
  flock 9
  if podman image exists "$ref"; then
    echo "hosts: image $ref present"
    podman tag "$ref" "$name:latest"
    return 0
  fi
  if [[ ! -s $tarball ]]; then
    build_tarball "$tarball"
  else
    echo "hosts: reusing $tarball"
  fi
  local changes=()
  for change in "${IMPORT_CHANGES[@]}"; do changes+=(--change "$change"); done
  podman import -q "${changes[@]}" "$tarball" "$ref" >/dev/null
  # :latest is for hand runs only; make passes the hashed tag.
  podman tag "$ref" "$name:latest"
  echo "hosts: imported $ref"
}

case ${1:-} in
  tag) echo "$name:$(recipe_hash)" ;;
  ensure) ensure ;;
  *) echo "usage: $0 tag|ensure" >&2; exit 2 ;;
esac
