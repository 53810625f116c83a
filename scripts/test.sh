#!/usr/bin/env bash
# The project's one test command (README "Test it"; CI runs it through .ci/run).
# Installs what a fresh machine lacks, then: fmt, clippy -D warnings, every test, and a
# trace check of the eviction policy. Exits non-zero on the first failure.
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
# nbdfuse, nbdsh, fio and nbdkit, and mounts ext4 through FUSE.
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
if ((${#packages[@]})); then
    apt-get -o DPkg::Lock::Timeout=600 update
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y "${packages[@]}"
fi
for component in rustfmt clippy; do
    if ! rustup component list --installed 2>/dev/null | grep -q "^$component"; then
        rustup component add "$component"
    fi
done
cargo --version

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "cargo test"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
cargo test --workspace --locked 2>&1 | tee "$log"

step "trace check"
bash scripts/trace-check.sh

# One closing line for the whole run, summed over every test binary of the workspace.
awk '/^test result:/ { p += $4; f += $6 } END { printf "tests: %d passed, %d failed\n", p, f }' "$log"
