# Recipe of the test-node image, sourced by ../node-image.sh. The image tag is
# a hash of this directory: change anything here and the next `make hosts`
# builds a new image; leave it and the cached one is reused.
# shellcheck shell=bash

SUITE=bookworm
# python3-apt: Ansible's apt module needs it, as on any real Debian host.
# prometheus: role monitoring installs it (apt); baked in so the test fleet's
# monitoring host needs no download. Its own unit stays off (below).
INCLUDE=systemd,systemd-sysv,dbus,python3,python3-apt,iproute2,procps,openssh-server,sudo,ca-certificates,prometheus
# Image config for `podman import`: boot systemd, and stop it the way it
# wants to be stopped.
IMPORT_CHANGES=(
  'CMD ["/sbin/init"]'
  'STOPSIGNAL SIGRTMIN+3'
  'ENV container=podman'
)

# Adjust the debootstrapped tree ($1) before it is packed.
customize_rootfs() {
  local rootfs=$1
  cp -a "$(dirname "${BASH_SOURCE[0]}")/rootfs/." "$rootfs/"
  # No host keys or machine id baked in: each node makes its own at boot.
  rm -f "$rootfs"/etc/ssh/ssh_host_*
  # (dbus's postinst wrote its own copy; Debian links it to systemd's.)
  : > "$rootfs/etc/machine-id"
  ln -sf /etc/machine-id "$rootfs/var/lib/dbus/machine-id"
  # sshd stays off: nodes share the host network, so each test that wants
  # SSH picks its own port and enables it.
  chroot "$rootfs" systemctl disable ssh.service >/dev/null 2>&1 || true
  # The package enables its own Prometheus (port 9090) on every node: only
  # the monitoring host runs one, under role monitoring's unit.
  chroot "$rootfs" systemctl disable prometheus.service >/dev/null 2>&1 || true
  # Units that need real hardware or a console only fail in a container.
  chroot "$rootfs" systemctl mask getty.target console-getty.service \
    systemd-udevd.service systemd-modules-load.service >/dev/null 2>&1
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/log/*.log
}
