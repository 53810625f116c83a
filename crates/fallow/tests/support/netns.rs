//! Network namespaces that a test creates and removes itself: a "lab" of hosts, each in a
//! namespace of its own with one veth link (`eth0`, 10.213.SUBNET.N/24) to a bridge that
//! lives in one more namespace (the switch), so that nothing of it touches the root
//! namespace: no address, no route, no firewall rule there. Processes run inside a host
//! with `ip netns exec` ([`Lab::command`]); traffic goes only between the lab's own
//! addresses, or to a namespace's own loopback.
//!
//! Names carry the test process's PID and a tag per test (`fallowt-PID-TAG-HOST`), so
//! parallel runs and parallel tests do not collide; namespaces left by a run that was
//! killed (its PID gone) are removed by the next one. Dropping the lab (also while a
//! panic unwinds) kills what still runs inside its namespaces and deletes them, which
//! takes their links, the bridge and their nft tables with them.
//!
//! [`Lab::new`] returns the reason as an error when namespaces cannot be made here (not
//! root, no `ip`, a container without the permission): the caller then skips.

use std::net::Ipv4Addr;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

/// The first part of every namespace name these tests make.
const PREFIX: &str = "fallowt";

/// One host of a lab: a namespace and its address on the lab's bridge.
#[derive(Debug, Clone)]
pub struct Host {
    /// What the test calls it (`a`, `client`).
    pub name: String,
    /// The namespace.
    pub netns: String,
    /// Its address on `eth0`.
    pub ip: Ipv4Addr,
}

/// Hosts on one bridge, each in its own namespace; see the module documentation.
#[derive(Debug)]
pub struct Lab {
    /// The namespaces made so far, deleted in reverse order when dropped.
    namespaces: Vec<String>,
    hosts: Vec<Host>,
}

/// Runs `ip ARGS`; its output, or an error that quotes the command and its stderr.
fn ip(args: &[&str]) -> Result<Output, String> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("running `ip`: {e} (Debian package iproute2)"))?;
    if out.status.success() {
        Ok(out)
    } else {
        Err(format!(
            "`ip {}` failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// The PIDs of the processes in namespace `netns` (`ip netns pids`).
fn pids_in(netns: &str) -> Vec<String> {
    ip(&["netns", "pids", netns])
        .map(|out| {
            String::from_utf8_lossy(&out.stdout).split_whitespace().map(String::from).collect()
        })
        .unwrap_or_default()
}

/// Kills what runs in `netns` (processes this test started there) and deletes it.
fn remove(netns: &str) {
    // Up to a few rounds: a process may have forked while we killed its parent.
    for _ in 0..5 {
        let pids = pids_in(netns);
        if pids.is_empty() {
            break;
        }
        let _ = Command::new("kill").arg("-KILL").args(&pids).stderr(Stdio::null()).status();
        std::thread::sleep(Duration::from_millis(50));
    }
    if let Err(err) = ip(&["netns", "delete", netns]) {
        eprintln!("netns cleanup: {err}");
    }
}

/// Deletes the namespaces of earlier runs of these tests whose process is gone (a run
/// that was SIGKILLed cannot clean up after itself). Those of live runs stay.
fn remove_stale() {
    let Ok(out) = ip(&["netns", "list"]) else { return };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        // `NAME` or `NAME (id: N)`.
        let Some(name) = line.split_whitespace().next() else { continue };
        let mut parts = name.split('-');
        if parts.next() != Some(PREFIX) {
            continue;
        }
        let Some(pid) = parts.next().and_then(|p| p.parse::<u32>().ok()) else { continue };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            remove(name);
        }
    }
}

impl Lab {
    /// Makes the switch namespace with its bridge, then one namespace per name in
    /// `hosts`, the `i`-th at 10.213.`subnet`.`i + 1` with its loopback up. `tag` tells
    /// apart the labs of one test process. An error says why namespaces cannot be used
    /// here; whatever was made before it is removed.
    pub fn new(tag: &str, subnet: u8, hosts: &[&str]) -> Result<Lab, String> {
        if !super::have("ip") {
            return Err("the `ip` command is missing (Debian package iproute2)".to_string());
        }
        remove_stale();
        let base = format!("{PREFIX}-{}-{tag}", std::process::id());
        let mut lab = Lab { namespaces: Vec::new(), hosts: Vec::new() };
        let switch = format!("{base}-sw");
        ip(&["netns", "add", &switch])?;
        lab.namespaces.push(switch.clone());
        // `ip netns exec` also needs to mount /sys, which some containers refuse.
        let probe = Command::new("ip")
            .args(["netns", "exec", &switch, "true"])
            .stderr(Stdio::piped())
            .output()
            .map_err(|e| format!("running `ip netns exec`: {e}"))?;
        if !probe.status.success() {
            return Err(format!(
                "`ip netns exec` does not work here: {}",
                String::from_utf8_lossy(&probe.stderr).trim()
            ));
        }
        ip(&["-n", &switch, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &switch, "link", "set", "br0", "up"])?;
        for (i, name) in hosts.iter().enumerate() {
            let netns = format!("{base}-{name}");
            ip(&["netns", "add", &netns])?;
            lab.namespaces.push(netns.clone());
            // Both ends are made inside namespaces: the root namespace never sees them.
            let port = format!("p{i}");
            ip(&["-n", &switch, "link", "add", &port, "type", "veth", "peer", "name", "eth0"])
                .and_then(|_| ip(&["-n", &switch, "link", "set", "eth0", "netns", &netns]))?;
            ip(&["-n", &switch, "link", "set", &port, "master", "br0", "up"])?;
            let host_ip = Ipv4Addr::new(10, 213, subnet, i as u8 + 1);
            ip(&["-n", &netns, "addr", "add", &format!("{host_ip}/24"), "dev", "eth0"])?;
            ip(&["-n", &netns, "link", "set", "eth0", "up"])?;
            ip(&["-n", &netns, "link", "set", "lo", "up"])?;
            lab.hosts.push(Host { name: name.to_string(), netns, ip: host_ip });
        }
        Ok(lab)
    }

    /// The host named `name` (panics if there is none).
    pub fn host(&self, name: &str) -> &Host {
        self.hosts.iter().find(|h| h.name == name).unwrap_or_else(|| panic!("no host {name}"))
    }

    /// A command that runs `program` inside host `name`: `ip netns exec NETNS PROGRAM`,
    /// which execs it, so the child's PID is the program's own.
    pub fn command(&self, name: &str, program: &str) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.host(name).netns, program]);
        cmd
    }

    /// Sets host `name`'s link to the bridge down (`up == false`) or up again.
    pub fn set_link(&self, name: &str, up: bool) -> Result<(), String> {
        let state = if up { "up" } else { "down" };
        ip(&["-n", &self.host(name).netns, "link", "set", "eth0", state]).map(|_| ())
    }

    /// Loads `rules` (an nft script) inside host `name`: `nft -f -`.
    pub fn nft(&self, name: &str, rules: &str) -> Result<String, String> {
        use std::io::Write;
        let mut child = self
            .command(name, "nft")
            .args(["-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("running nft: {e}"))?;
        let written = child.stdin.take().map(|mut stdin| stdin.write_all(rules.as_bytes()));
        let out = child.wait_with_output().map_err(|e| format!("running nft: {e}"))?;
        if !out.status.success() || !matches!(written, Some(Ok(()))) {
            return Err(format!(
                "nft in {name} failed ({}): {}\nthe rules:\n{rules}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        for netns in self.namespaces.iter().rev() {
            remove(netns);
        }
    }
}
