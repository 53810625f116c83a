#!/usr/bin/env bash
# Installs QEMU packages (the arguments, e.g. qemu-system-x86 qemu-block-extra) from
# bookworm-backports, together with qemu-utils from the same release: this machine image
# carries qemu-utils 10.0 from backports, which Debian 12's own qemu-system-common (7.2)
# conflicts with, so installing from bookworm would remove qemu-img. Adds the backports
# source (deb.debian.org) when apt has none, and refreshes apt's lists.
# Used by scripts/test.sh (the guest tests) and bench/vm.sh.
set -euo pipefail
(($#)) || { echo "usage: $0 PACKAGE..." >&2; exit 2; }
if ! grep -rqs bookworm-backports /etc/apt/sources.list /etc/apt/sources.list.d; then
    printf '%s\n' 'Types: deb' 'URIs: http://deb.debian.org/debian' 'Suites: bookworm-backports' \
        'Components: main' 'Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg' \
        >/etc/apt/sources.list.d/fallow-backports.sources
fi
apt-get -o DPkg::Lock::Timeout=600 update
DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y \
    --no-install-recommends -t bookworm-backports "$@" qemu-utils
