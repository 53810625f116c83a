#!/usr/bin/env bash
# The Debian package, end to end: scripts/package-test.sh BIN
#
# Packages BIN (a fallow binary already built, e.g. target/debug/fallow: no release build
# here) with cargo-deb and the [package.metadata.deb] of crates/fallow/Cargo.toml, checks
# the .deb (files, modes, conffiles, maintainer scripts, units through
# `systemd-analyze verify`), then installs it, checks what the install made (the binary,
# the fallow user, /etc/fallow with a secret only that user can read, enabled units),
# runs the installed node and `fallow nbd` (on the sample NBD config) as that user,
# reinstalls, removes and purges the package, and checks that nothing is left.
#
# Installing needs root and dpkg. Without them, or without cargo-deb, or on a machine that
# already has a fallow package, user, group or file that this would overwrite or delete,
# the script skips with a message and exits 0; with FALLOW_REQUIRE_GUESTS=1 (as
# scripts/test.sh runs the tests) it fails instead. Whatever happens after the install,
# an EXIT trap purges the package and removes what it made, so the machine is left as it
# was found. crates/fallow/tests/package.rs runs this with the binary under test.
set -eEuo pipefail
cd "$(dirname "$0")/.."
# A command that fails where no check expected it: name it before the EXIT trap runs.
trap 'printf "package-test: FAILED: line %s: %s\n" "$LINENO" "$BASH_COMMAND" >&2' ERR

if (($# != 1)) || [ ! -x "$1" ]; then
    echo "usage: scripts/package-test.sh BIN (an executable fallow binary)" >&2
    exit 2
fi
bin=$(realpath "$1")
cargo=${CARGO:-cargo}

say() { printf 'package-test: %s\n' "$*"; }
fail() {
    printf 'package-test: FAILED: %s\n' "$*" >&2
    exit 1
}
skip() {
    if [ "${FALLOW_REQUIRE_GUESTS:-}" = 1 ]; then
        fail "$* (FALLOW_REQUIRE_GUESTS=1: not skipping)"
    fi
    say "skipped: $*"
    exit 0
}

# What the package installs, and what its maintainer scripts and systemd make besides.
units=(/lib/systemd/system/fallow-node.service "/lib/systemd/system/fallow-nbd@.service")
conffiles=(/etc/fallow/node.toml /etc/fallow/nbd/example.toml)
wants_link=/etc/systemd/system/multi-user.target.wants/fallow-node.service
helper_state=/var/lib/systemd/deb-systemd-helper-enabled
made_by_install=(/usr/bin/fallow "${units[@]}" /etc/fallow /var/lib/fallow "$wants_link"
    "$helper_state/fallow-node.service.dsh-also"
    "$helper_state/multi-user.target.wants/fallow-node.service"
    /var/lib/systemd/deb-systemd-helper-masked/fallow-node.service)

command -v dpkg-deb >/dev/null || skip "dpkg-deb not found (not a Debian system)"
"$cargo" deb --version >/dev/null 2>&1 ||
    skip "cargo-deb not found (cargo install --locked cargo-deb)"

tmp=$(mktemp -d)
node_pid=
nbd_pid=
installed=0
# Runs on every exit: stops the node and the NBD server this script started, purges the
# package if it got installed, and as a last resort removes by hand what the install made
# (every path and name there was checked absent before the install, so nothing else is
# touched).
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    for pid in $node_pid $nbd_pid; do
        kill -KILL "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    if ((installed)); then
        if [ "$(pkg_state)" != absent ]; then
            say "cleanup: purging the package"
            dpkg --purge fallow >/dev/null 2>&1 || true
        fi
        if [ "$(pkg_state)" != absent ]; then
            say "cleanup: purge failed; purging without the maintainer scripts"
            rm -f /var/lib/dpkg/info/fallow.prerm /var/lib/dpkg/info/fallow.postrm
            dpkg --purge --force-all fallow >/dev/null 2>&1 || true
        fi
        if getent passwd fallow >/dev/null; then userdel fallow || true; fi
        if getent group fallow >/dev/null; then groupdel fallow || true; fi
        rm -rf "${made_by_install[@]}"
        ((rc != 0)) || rc=1
    fi
    rm -rf "$tmp"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# dpkg's state of the package fallow: "installed", "config-files", …, or "absent".
pkg_state() {
    local state
    state=$(dpkg-query -W -f='${db:Status-Status}' fallow 2>/dev/null) || state=
    case $state in "" | not-installed) echo absent ;; *) echo "$state" ;; esac
}

# Checks that the file listing $1 has a line matching the extended regex $2.
has_line() { grep -Eq -- "$2" "$1" || fail "$3"; }

# `systemd-analyze verify` of the units in directory $1 (the instance unit as
# fallow-nbd@test.service): any complaint at all fails, as it only warns about unknown
# keys and misspelt values.
verify_units() {
    local dir=$1 out
    command -v systemd-analyze >/dev/null || {
        [ "${FALLOW_REQUIRE_GUESTS:-}" = 1 ] && fail "systemd-analyze not found"
        say "systemd-analyze not found: units not verified"
        return 0
    }
    out=$(systemd-analyze verify "$dir/fallow-node.service" \
        "$dir/fallow-nbd@.service:fallow-nbd@test.service" 2>&1) ||
        fail "systemd-analyze verify $dir: $out"
    [ -z "$out" ] || fail "systemd-analyze verify $dir complained: $out"
}

say "building the .deb around $bin"
# cargo-deb reads `target/release/fallow` in the asset list as "the binary in Cargo's
# target directory": a target directory of our own holding BIN packages BIN, without a
# build and without touching the workspace's target directory (which the running
# `cargo test` holds). --no-dbgsym --strip --fast: what a release build's package
# contains, minus the debug-symbols package and the slow compression.
mkdir -p "$tmp/target/release"
cp "$bin" "$tmp/target/release/fallow"
deb=$tmp/fallow.deb
CARGO_TARGET_DIR=$tmp/target "$cargo" deb -p fallow --no-build --no-dbgsym --strip --fast \
    --quiet -o "$deb" >"$tmp/cargo-deb.log" 2>&1 ||
    fail "cargo deb: $(cat "$tmp/cargo-deb.log")"

say "checking the .deb's control data and files"
dpkg-deb --info "$deb" >"$tmp/info"
has_line "$tmp/info" '^ Package: fallow$' "no Package: fallow in dpkg-deb --info"
has_line "$tmp/info" '^ Depends: .*\badduser\b' "Depends lacks adduser (postinst uses it)"
for script in postinst prerm postrm; do
    has_line "$tmp/info" "^ +[0-9]+ bytes, +[0-9]+ lines +\* +$script +#!/bin/sh" \
        "maintainer script $script missing or not executable"
done
dpkg-deb --info "$deb" conffiles >"$tmp/conffiles"
for f in "${conffiles[@]}"; do
    has_line "$tmp/conffiles" "^$f\$" "$f is not a conffile"
done
dpkg-deb --contents "$deb" >"$tmp/contents"
has_line "$tmp/contents" '^-rwxr-xr-x (root/root|0/0) .* \./usr/bin/fallow$' \
    "no /usr/bin/fallow, root's, mode 0755"
for f in "${conffiles[@]}" "${units[@]}"; do
    has_line "$tmp/contents" "^-rw-r--r-- (root/root|0/0) .* \\.$f\$" "no $f, root's, mode 0644"
done
if grep -Eq ' \./etc/fallow/secret$' "$tmp/contents"; then
    fail "the package ships a secret: every host would share it"
fi
dpkg-deb --extract "$deb" "$tmp/root"
cmp -s deploy/fallow-node.toml "$tmp/root/etc/fallow/node.toml" ||
    fail "/etc/fallow/node.toml differs from deploy/fallow-node.toml"
want_version=$("$bin" --version)
[ "$("$tmp/root/usr/bin/fallow" --version)" = "$want_version" ] ||
    fail "the packaged binary is not BIN ($want_version)"
dpkg-deb --ctrl-tarfile "$deb" | tar -x -C "$tmp" ./postinst ./prerm ./postrm
for script in postinst prerm postrm; do
    sh -n "$tmp/$script" || fail "$script: syntax error"
done

say "verifying the packaged units (ExecStart pointed at the packaged binary)"
mkdir "$tmp/units"
for unit in "${units[@]}"; do
    sed "s|/usr/bin/fallow|$tmp/root/usr/bin/fallow|" "$tmp/root$unit" >"$tmp/units/${unit##*/}"
done
verify_units "$tmp/units"
grep -q '^User=fallow$' "$tmp/units/fallow-node.service" ||
    fail "fallow-node.service: not User=fallow"
grep -q '^ExecStart=.* nbd --config /etc/fallow/nbd/%i.toml$' "$tmp/units/fallow-nbd@.service" ||
    fail "fallow-nbd@.service: ExecStart does not run fallow nbd --config /etc/fallow/nbd/%i.toml"

# Installing: only as root, with dpkg, on a machine without anything of ours.
(($(id -u) == 0)) || skip "not root: the .deb was built and checked, not installed"
command -v dpkg >/dev/null || skip "dpkg not found"
command -v setpriv >/dev/null || skip "setpriv (util-linux) not found"
command -v adduser >/dev/null || skip "adduser not found (the package depends on it)"
if [ "$(pkg_state)" != absent ]; then
    skip "a package fallow is already here ($(pkg_state)): not touching it"
fi
for name in passwd group; do
    if getent "$name" fallow >/dev/null; then
        skip "this machine has a $name entry fallow: not touching it"
    fi
done
for path in "${made_by_install[@]}"; do
    if [ -e "$path" ] || [ -L "$path" ]; then
        skip "$path exists: not touching it"
    fi
done

# The paths the package, its maintainer scripts and deb-systemd-helper may make: the same
# list after the purge as before the install, or something was left behind. (Where other
# packages keep files too, only names with fallow in them.)
snapshot() {
    find /etc/fallow /etc/systemd/system /var/lib/systemd/deb-systemd-helper-enabled \
        /var/lib/systemd/deb-systemd-helper-masked -print 2>/dev/null | sort || true
    find /lib/systemd/system /usr/lib/systemd/system /usr/bin /usr/share/doc /var/lib \
        -maxdepth 1 -name '*fallow*' -print 2>/dev/null | sort || true
}
snapshot >"$tmp/before"

say "installing"
installed=1
dpkg -i "$deb" >"$tmp/dpkg.log" 2>&1 || fail "dpkg -i: $(cat "$tmp/dpkg.log")"
[ "$(pkg_state)" = installed ] || fail "after dpkg -i, the package is $(pkg_state)"
[ "$(/usr/bin/fallow --version)" = "$want_version" ] || fail "/usr/bin/fallow --version"
IFS=: read -r _ _ uid gid _ home shell < <(getent passwd fallow) || fail "no user fallow"
((uid < 1000)) || fail "user fallow is not a system user (uid $uid)"
[ "$(getent group fallow | cut -d: -f3)" = "$gid" ] || fail "fallow's group is not fallow"
[ "$home" = /nonexistent ] || fail "user fallow has home $home"
case $shell in */nologin | */false) ;; *) fail "user fallow has a login shell, $shell" ;; esac
dpkg-query -W -f='${Conffiles}\n' fallow >"$tmp/installed-conffiles"
for f in "${conffiles[@]}"; do
    [ -f "$f" ] || fail "$f not installed"
    has_line "$tmp/installed-conffiles" "^ $f [0-9a-f]{32}\$" "dpkg lists no conffile $f"
done
[ "$(stat -c '%U:%G %a' /etc/fallow/secret)" = "root:fallow 640" ] ||
    fail "/etc/fallow/secret is $(stat -c '%U:%G %a' /etc/fallow/secret), not root:fallow 640"
(($(tr -d '[:space:]' </etc/fallow/secret | wc -c) >= 16)) || fail "/etc/fallow/secret is too short"
secret_sum=$(sha256sum </etc/fallow/secret)
for unit in "${units[@]}"; do
    [ -f "$unit" ] || fail "$unit not installed"
done
verify_units /lib/systemd/system
if command -v deb-systemd-helper >/dev/null; then
    [ -L "$wants_link" ] || fail "fallow-node.service is not enabled ($wants_link)"
fi
if [ -d /run/systemd/system ]; then
    state=$(systemctl is-active fallow-node.service || true)
    say "systemd runs here: fallow-node.service is $state"
fi

# Starts `CMD...` as user fallow, from /, with its output in file $2, and waits up to 10 s
# for a line from which the sed expression $3 prints something, which goes into $found.
# $1 names it in messages. Its process ID goes into $started (setpriv execs: the PID is the
# command's own).
start_as_fallow() {
    local name=$1 log=$2 expr=$3
    shift 3
    (cd / && exec setpriv --reuid=fallow --regid=fallow --init-groups "$@") \
        </dev/null >"$log" 2>&1 &
    started=$!
    found=
    for _ in $(seq 100); do
        found=$(sed -n "$expr" "$log" | head -1)
        [ -n "$found" ] && return 0
        kill -0 "$started" 2>/dev/null || fail "$name exited: $(cat "$log")"
        sleep 0.1
    done
    fail "$name did not start within 10 s: $(cat "$log")"
}

# Stops process $2 with SIGTERM, as systemctl stop does, and checks that it exits 0 within
# 30 s. $1 names it, $3 is its log.
stop_cleanly() {
    local name=$1 pid=$2 log=$3 rc=0
    kill -TERM "$pid"
    for _ in $(seq 300); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
        fail "$name still runs 30 s after SIGTERM: $(tail -5 "$log")"
    fi
    wait "$pid" || rc=$?
    ((rc == 0)) || fail "$name exited $rc on SIGTERM: $(tail -5 "$log")"
}

say "running the installed node as user fallow on /etc/fallow/node.toml"
# Only the listen and metrics addresses differ from the unit's command: free ports, so as
# not to clash with anything on this host.
start_as_fallow "the node" "$tmp/node.log" 's/.*listening on TCP addr=\([^ ]*\).*/\1/p' \
    env FALLOW_LOG=info /usr/bin/fallow node --config /etc/fallow/node.toml \
    --listen 127.0.0.1:0 --metrics 127.0.0.1:0
node_pid=$started
addr=$found
# A client as user fallow, with the same secret: the node accepts it.
setpriv --reuid=fallow --regid=fallow --init-groups /usr/bin/fallow stat --node "$addr" \
    --secret-file /etc/fallow/secret >"$tmp/stat.log" 2>&1 ||
    fail "fallow stat against the installed node: $(cat "$tmp/stat.log")"
# Anyone else cannot read the secret.
if setpriv --reuid=nobody --regid=nogroup --clear-groups cat /etc/fallow/secret \
    >/dev/null 2>&1; then
    fail "user nobody can read /etc/fallow/secret"
fi

say "running fallow nbd as user fallow on /etc/fallow/nbd/example.toml, against that node"
# What fallow-nbd@example.service runs, but with flags (which win over the file) for the
# node's address and a free port. /var/lib/fallow is made as StateDirectory= makes it.
grep -q '^pool = "fallow://127.0.0.1:7400"$' /etc/fallow/nbd/example.toml ||
    fail "example.toml no longer names the pool this test replaces"
args=(--config /etc/fallow/nbd/example.toml --pool "fallow://$addr" --listen 127.0.0.1:0)
install -d -o fallow -g fallow -m 0750 /var/lib/fallow
start_as_fallow "fallow nbd" "$tmp/nbd.log" 's/^fallow nbd: serving \(.*\)/\1/p' \
    env FALLOW_LOG=info /usr/bin/fallow nbd "${args[@]}"
nbd_pid=$started
say "fallow nbd served $found"
stop_cleanly "fallow nbd" "$nbd_pid" "$tmp/nbd.log"
nbd_pid=
stop_cleanly "the node" "$node_pid" "$tmp/node.log"
node_pid=
# The disk image and the cache's state are the administrator's to remove: purge keeps a
# /var/lib/fallow that is not empty. The state shows the clean stop was recorded.
grep -q '"spec"' /var/lib/fallow/nbd-example.state/state.json ||
    fail "fallow nbd recorded no clean stop in its --state-dir"
rm -rf /var/lib/fallow/disk.img /var/lib/fallow/nbd-example.state

say "reinstalling (postinst again: the user and the secret stay)"
dpkg -i "$deb" >"$tmp/dpkg.log" 2>&1 || fail "dpkg -i again: $(cat "$tmp/dpkg.log")"
[ "$(getent passwd fallow | cut -d: -f3)" = "$uid" ] || fail "the reinstall changed fallow's uid"
[ "$(sha256sum </etc/fallow/secret)" = "$secret_sum" ] || fail "the reinstall changed the secret"

say "removing (conffiles, secret and user stay until purge)"
dpkg --remove fallow >"$tmp/dpkg.log" 2>&1 || fail "dpkg --remove: $(cat "$tmp/dpkg.log")"
[ ! -e /usr/bin/fallow ] || fail "/usr/bin/fallow left after remove"
for unit in "${units[@]}"; do
    [ ! -e "$unit" ] || fail "$unit left after remove"
done
[ -f /etc/fallow/node.toml ] && [ -f /etc/fallow/secret ] || fail "remove deleted configuration"
getent passwd fallow >/dev/null || fail "remove deleted the user"

say "purging"
dpkg --purge fallow >"$tmp/dpkg.log" 2>&1 || fail "dpkg --purge: $(cat "$tmp/dpkg.log")"
[ "$(pkg_state)" = absent ] || fail "after purge, the package is $(pkg_state)"
for path in "${made_by_install[@]}"; do
    if [ -e "$path" ] || [ -L "$path" ]; then
        fail "$path left after purge"
    fi
done
for name in passwd group; do
    if getent "$name" fallow >/dev/null; then
        fail "$name entry fallow left after purge"
    fi
done
snapshot >"$tmp/after"
diff -u "$tmp/before" "$tmp/after" >"$tmp/diff" ||
    fail "the purge left the machine different from before the install: $(cat "$tmp/diff")"
installed=0
say "ok: built, checked, installed, ran the node as fallow, reinstalled, removed, purged"
