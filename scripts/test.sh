#!/usr/bin/env bash
# The project's one test command (README "Test it"; CI runs it through .ci/run).
# Installs what a fresh machine lacks, then: fmt, clippy -D warnings, every test, a fuzz
# smoke run, and a trace check of the eviction policy. Exits non-zero on the first failure.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }

step "toolchain"
if ! command -v cargo >/dev/null; then
    echo "cargo not found: install Rust with rustup first" >&2
    exit 1
fi
# The compression crates (zstd, xz, bzip2) build C sources; the node tests drive a real
# memcached (the baseline of `fallow bench pages`) and an independent Python client; the
# NBD compliance suite (tests/compliance/nbd/) drives qemu-img/qemu-io, nbdinfo/nbdcopy/
# nbdfuse, nbdsh, fio and nbdkit, and mounts ext4 through FUSE; the cluster fault tests
# (crates/fallow/tests/netns_faults.rs) partition a node with nft.
packages=()
command -v cc >/dev/null || packages+=(build-essential)
command -v memcached >/dev/null || packages+=(memcached)
command -v python3 >/dev/null || packages+=(python3)
command -v qemu-img >/dev/null || packages+=(qemu-utils)
command -v nbdinfo >/dev/null || packages+=(libnbd-bin)
command -v nbdsh >/dev/null || packages+=(python3-libnbd)
command -v nbdkit >/dev/null || packages+=(nbdkit)
command -v fio >/dev/null || packages+=(fio)
command -v fusermount3 >/dev/null || packages+=(fuse3)
command -v nft >/dev/null || packages+=(nftables)
# The crash-state test of ext4 (crates/fallow/tests/crash_states.rs) makes the image with
# mke2fs, replays each state's journal and checks it with e2fsck, and reads files with
# debugfs (Debian's e2fsprogs, present on most installs).
command -v debugfs >/dev/null || packages+=(e2fsprogs)
# TLS (crates/fallow-tls) links the system OpenSSL through pkg-config; the TLS tests make
# their certificates with the openssl tool, as docs/security.md tells users to.
command -v openssl >/dev/null || packages+=(openssl)
command -v pkg-config >/dev/null || packages+=(pkg-config)
[ -e /usr/include/openssl/ssl.h ] || packages+=(libssl-dev)
# deploy/prometheus: the alerting rules are checked and unit-tested with promtool
# (crates/fallow/tests/deploy_rules.rs, scripts/check-deploy.sh), which comes with
# Debian's Prometheus server; the server itself must not start (below).
promtool_packages=()
command -v promtool >/dev/null || promtool_packages+=(prometheus)
# The package test (crates/fallow/tests/package.rs, scripts/package-test.sh) builds a .deb
# with cargo-deb (its Depends from dpkg-shlibdeps), verifies the units with systemd-analyze
# (ExecReload names /bin/kill), installs it (adduser) and purges it.
command -v systemd-analyze >/dev/null || packages+=(systemd)
command -v adduser >/dev/null || packages+=(adduser)
command -v dpkg-shlibdeps >/dev/null || packages+=(dpkg-dev)
[ -x /bin/kill ] || packages+=(procps)
# The RADOS store (cargo feature `rados`) links against librados, and its tests start a
# throwaway single-node Ceph cluster (tests/ceph/): a monitor, an OSD and the ceph/rados
# tools. Installed without recommends, which would add a manager and an MDS.
ceph_packages=()
command -v ceph-mon >/dev/null || ceph_packages+=(ceph-mon)
command -v ceph-osd >/dev/null || ceph_packages+=(ceph-osd)
command -v rados >/dev/null || ceph_packages+=(ceph-common)
[ -e /usr/include/rados/librados.h ] || ceph_packages+=(librados-dev)
if ((${#packages[@]} + ${#ceph_packages[@]} + ${#promtool_packages[@]})) ||
    ! apt-cache policy busybox-static | grep -q 'Candidate: [0-9]'; then
    apt-get -o DPkg::Lock::Timeout=600 update
fi
if ((${#packages[@]})); then
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y "${packages[@]}"
fi
if ((${#promtool_packages[@]})); then
    # policy-rc.d exiting 101 is Debian's "start no service": the package would otherwise
    # start a Prometheus server on machines without systemd.
    policy=/usr/sbin/policy-rc.d
    added_policy=0
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 0755 "$policy" && added_policy=1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y \
        --no-install-recommends "${promtool_packages[@]}"
    if ((added_policy)); then rm -f "$policy"; fi
fi
# The guest tests (crates/fallow/tests/guest.rs) boot Debian's cloud kernel under
# qemu-system-x86_64, with an initramfs put together from `apt-get download`ed packages
# (hence the check above that apt's lists are current) and a static tool built with the
# C compiler.
command -v qemu-system-x86_64 >/dev/null || bash scripts/install-qemu.sh qemu-system-x86
if ((${#ceph_packages[@]})); then
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y \
        --no-install-recommends "${ceph_packages[@]}"
fi
# cargo-deb builds liblzma's C sources, so after the C compiler is in.
command -v cargo-deb >/dev/null || cargo install --locked cargo-deb@3.8.0
# Optional parts that the tests cover; a plain `cargo build` leaves them out.
features=(--features fallow-backing/rados,fallow/rados)
for component in rustfmt clippy; do
    if ! rustup component list --installed 2>/dev/null | grep -q "^$component"; then
        rustup component add "$component"
    fi
done
cargo --version

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy -D warnings"
cargo clippy --workspace --all-targets --locked "${features[@]}" -- -D warnings
# The crates with a `rados` feature, without it: what `cargo build` compiles.
cargo clippy -p fallow-backing -p fallow --all-targets --locked -- -D warnings

step "cargo test"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
# The guest tests fail, instead of skipping, if QEMU or nbdkit is missing here.
FALLOW_REQUIRE_GUESTS=1 cargo test --workspace --locked "${features[@]}" 2>&1 | tee "$log"

step "fuzz smoke"
# Every fuzz target (fuzz/, a workspace of its own) for 10 s from its seed corpus, on the
# stable toolchain: a decoder change that panics or breaks a checked property on an input
# the corpus holds fails here, not weeks later in a long run (docs/reliability.md,
# "Fuzzing"; about 4 minutes from a clean checkout, most of it the build).
bash scripts/fuzz.sh smoke

step "trace check"
bash scripts/trace-check.sh

# One closing line for the whole run, summed over every test binary of the workspace.
awk '/^test result:/ { p += $4; f += $6 } END { printf "tests: %d passed, %d failed\n", p, f }' "$log"
