//! `fallow-guest`: builds the test guests' images and runs a script in a guest, for the
//! benchmark scripts (`bench/vm.sh`). The tests use the same code as a library
//! (`fallow_testkit::guest`).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use fallow_testkit::guest::{accel, DebianImage, Disk, Guest, GuestSpec, MinimalImage};

/// Build fallow's test guest images and run scripts in guests (QEMU; KVM when this host
/// can boot the guest with it, else TCG).
#[derive(Debug, Parser)]
#[command(name = "fallow-guest")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Build the minimal image (and with --debian the Debian root file system) if the
    /// cache lacks it, and print its files as JSON.
    Image {
        /// Also the Debian root file system for benchmarks (mmdebstrap; needs root).
        #[arg(long)]
        debian: bool,
    },
    /// Print the accelerator guests use here (`kvm` or `tcg`), probing if needed.
    Accel,
    /// Boot a guest, run a script in it, and print what it reported as one JSON object:
    /// `{"exit": N, "elapsed_s": …, "accel": …, "results": {KEY: VALUE, …}}`. The
    /// guest's console goes to stderr (or --console FILE). Exits 1 if the script failed
    /// or the guest did not finish.
    Run(RunArgs),
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    /// The script to run (a file), with `sh`.
    #[arg(long, value_name = "FILE")]
    script: PathBuf,
    /// A disk, in order (/dev/vda first): nbd://HOST:PORT/NAME, file:PATH,
    /// file-ro:PATH, vhost-user:SOCKET, or drive:OPTIONS (QEMU -drive options, e.g.
    /// drive:file=rbd:POOL/IMAGE:conf=PATH). Repeatable.
    #[arg(long = "disk", value_name = "DISK")]
    disks: Vec<String>,
    /// Run the script chrooted into the ext4 file system on this guest device (e.g.
    /// /dev/vda), mounted read-only unless --root-rw.
    #[arg(long, value_name = "DEV")]
    root: Option<String>,
    /// Mount --root read-write.
    #[arg(long)]
    root_rw: bool,
    /// Guest memory in MiB.
    #[arg(long, default_value_t = 256)]
    memory_mib: u32,
    /// Virtual CPUs.
    #[arg(long, default_value_t = 1)]
    cpus: u32,
    /// Seconds the guest may run, boot included, before it is killed.
    #[arg(long, default_value_t = 600)]
    time_limit: u64,
    /// Write the guest's console here instead of to stderr.
    #[arg(long, value_name = "FILE")]
    console: Option<PathBuf>,
}

fn parse_disk(spec: &str) -> Result<Disk, String> {
    if spec.starts_with("nbd://") || spec.starts_with("nbd+unix://") {
        return Ok(Disk::nbd(spec));
    }
    if let Some(path) = spec.strip_prefix("file:") {
        return Ok(Disk::file(path.as_ref()));
    }
    if let Some(path) = spec.strip_prefix("file-ro:") {
        return Ok(Disk::File { path: path.into(), read_only: true });
    }
    if let Some(options) = spec.strip_prefix("drive:") {
        return Ok(Disk::Drive { options: options.to_string() });
    }
    if let Some(path) = spec.strip_prefix("vhost-user:") {
        return Ok(Disk::VhostUser { socket: path.into(), queues: 1 });
    }
    Err(format!("--disk {spec:?}: expected nbd://…, file:PATH, file-ro:PATH, vhost-user:PATH or drive:OPTIONS"))
}

fn run(args: RunArgs, image: &MinimalImage) -> Result<bool, String> {
    let script = std::fs::read_to_string(&args.script)
        .map_err(|e| format!("reading {}: {e}", args.script.display()))?;
    let mut spec = GuestSpec::new(&script)
        .memory_mib(args.memory_mib)
        .cpus(args.cpus)
        .time_limit(Duration::from_secs(args.time_limit));
    for disk in &args.disks {
        spec = spec.disk(parse_disk(disk)?);
    }
    if let Some(root) = &args.root {
        spec = spec.root(root, args.root_rw);
    }
    let output = Guest::boot(image, &spec).and_then(Guest::finish).map_err(|e| e.to_string())?;
    let console = output.console_text();
    match &args.console {
        Some(path) => std::fs::write(path, console + "\n")
            .map_err(|e| format!("writing {}: {e}", path.display()))?,
        None => eprintln!("{console}"),
    }
    let results: serde_json::Map<String, serde_json::Value> =
        output.results().into_iter().map(|(k, v)| (k, serde_json::Value::String(v))).collect();
    let report = serde_json::json!({
        "exit": output.exit_code,
        "elapsed_s": output.elapsed.as_secs_f64(),
        "accel": output.accel.name(),
        "results": results,
    });
    println!("{report}");
    Ok(output.exit_code == 0)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let image = match MinimalImage::get() {
        Ok(image) => image,
        Err(e) => {
            eprintln!("fallow-guest: {e}");
            return ExitCode::from(2);
        }
    };
    let outcome = match cli.command {
        Cmd::Image { debian } => {
            let debian = match debian.then(DebianImage::get).transpose() {
                Ok(debian) => debian,
                Err(e) => {
                    eprintln!("fallow-guest: {e}");
                    return ExitCode::from(2);
                }
            };
            let report = serde_json::json!({
                "debian_root": debian.as_ref().map(|d| d.root_image()),
                "debian_versions": debian.as_ref().map(|d| d.versions()),
                "kernel": image.kernel(),
                "initramfs": image.initramfs(),
                "busybox": image.busybox(),
                "tool": image.tool(),
                "versions": image.versions(),
            });
            println!("{report}");
            Ok(true)
        }
        Cmd::Accel => {
            println!("{}", accel(&image).name());
            Ok(true)
        }
        Cmd::Run(args) => run(args, &image),
    };
    match outcome {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("fallow-guest: {e}");
            ExitCode::from(2)
        }
    }
}
