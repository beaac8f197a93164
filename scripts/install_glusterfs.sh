#!/usr/bin/env bash
# Install GlusterFS (server and FUSE client, Debian/Ubuntu packages) for the tests of
# replicas on a shared volume (tests/test_gluster.py, tests/test_engine_gluster.py make a
# volume on the local disk and mount it twice). Idempotent and non-interactive: nothing is
# done when both are installed.
set -euo pipefail
PATH="$PATH:/usr/sbin:/sbin"
if command -v glusterd >/dev/null 2>&1 && command -v mount.glusterfs >/dev/null 2>&1; then
    exit 0
fi
APT=(env DEBIAN_FRONTEND=noninteractive apt-get)
if [ "$(id -u)" -ne 0 ]; then
    APT=(sudo -n "${APT[@]}")  # the tests mount volumes, so they run as root anyway
fi
"${APT[@]}" update -qq
"${APT[@]}" install -y -qq -o Dpkg::Options::=--force-confdef \
    -o Dpkg::Options::=--force-confold glusterfs-server glusterfs-client >/dev/null
command -v glusterd >/dev/null && command -v mount.glusterfs >/dev/null
