//! The TLS flags: `--tls`, `--tls-certificates`, `--tls-psk` and `--tls-verify-peer` of the
//! NBD front end (`fallow nbd`, `fallow vhost --nbd`, `fallow up`), and `--node-tls` of
//! every command that serves or reaches the node protocol. docs/security.md says what
//! each protects.

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use fallow_nbd::TlsPolicy;
use fallow_tls::{ClientOptions, ServerOptions, TlsClient, TlsServer};

/// `--tls`: whether NBD clients may, must or cannot use TLS.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TlsMode {
    /// No TLS: STARTTLS is refused.
    #[default]
    Off,
    /// Clients may start TLS; those that do not are served in the clear.
    On,
    /// Clients must start TLS before anything else; the others are refused.
    Require,
}

/// The NBD front end's TLS flags.
#[derive(Debug, Clone, Args)]
pub struct NbdTlsArgs {
    /// TLS for NBD clients (STARTTLS): off, on (the client chooses) or require (every
    /// other option is refused with NBD_REP_ERR_TLS_REQD until the client starts TLS).
    /// Needs --tls-certificates or --tls-psk [default: off].
    #[arg(long, value_name = "MODE")]
    pub tls: Option<TlsMode>,
    /// Directory with ca-cert.pem, server-cert.pem and server-key.pem (the layout qemu's
    /// tls-creds-x509 and nbdkit's --tls-certificates use).
    #[arg(long, value_name = "DIR")]
    pub tls_certificates: Option<PathBuf>,
    /// Pre-shared keys in the psktool format (IDENTITY:HEXKEY per line): a client that
    /// knows one of them is let in, no certificates needed.
    #[arg(long, value_name = "FILE")]
    pub tls_psk: Option<PathBuf>,
    /// Ask every TLS client for a certificate and refuse those not signed by
    /// --tls-certificates' ca-cert.pem.
    #[arg(long)]
    pub tls_verify_peer: bool,
}

impl NbdTlsArgs {
    /// The policy the flags ask for, its credentials loaded and checked.
    pub fn policy(&self) -> anyhow::Result<TlsPolicy> {
        let has_credentials = self.tls_certificates.is_some() || self.tls_psk.is_some();
        let mode = self.tls.unwrap_or_default();
        if mode == TlsMode::Off {
            if has_credentials || self.tls_verify_peer {
                bail!("--tls-certificates, --tls-psk and --tls-verify-peer need --tls on or --tls require");
            }
            return Ok(TlsPolicy::Off);
        }
        if !has_credentials {
            let mode = if mode == TlsMode::On { "on" } else { "require" };
            bail!("--tls {mode} needs --tls-certificates DIR or --tls-psk FILE");
        }
        let server = TlsServer::new(&ServerOptions {
            certificates: self.tls_certificates.clone(),
            psk: self.tls_psk.clone(),
            verify_peer: self.tls_verify_peer,
            tls13_only: false,
        })
        .context("--tls")?;
        tracing::info!(?mode, credentials = server.summary(), "NBD over TLS");
        Ok(match mode {
            TlsMode::Require => TlsPolicy::Required(server),
            _ => TlsPolicy::Offered(server),
        })
    }
}

/// The URI scheme an NBD client uses for this server: `nbds` when TLS is required.
pub fn nbd_scheme(policy: &TlsPolicy) -> &'static str {
    match policy {
        TlsPolicy::Required(_) => "nbds",
        _ => "nbd",
    }
}

/// `--node-tls DIR`: the node protocol over TLS 1.3, on TCP. A node serves with
/// DIR/server-cert.pem and server-key.pem; everything that connects to a node (its peers,
/// `fallow nbd --pool`, `fallow stat`) checks the node's certificate against
/// DIR/ca-cert.pem and, when there is one, presents DIR/client-cert.pem.
#[derive(Debug, Clone, Default, Args)]
pub struct NodeTlsArgs {
    /// Talk to nodes over TLS 1.3 (every node of a cluster and all its clients together):
    /// DIR holds ca-cert.pem (the authority the nodes' certificates chain to) and, on a
    /// node, server-cert.pem and server-key.pem. Unix sockets stay in the clear.
    #[arg(long, value_name = "DIR")]
    pub node_tls: Option<PathBuf>,
}

impl NodeTlsArgs {
    /// The client half, if `--node-tls` is given.
    pub fn client(&self) -> anyhow::Result<Option<TlsClient>> {
        node_tls_client(self.node_tls.as_deref())
    }
}

/// The client half of the node protocol's TLS from a `--node-tls` directory.
pub fn node_tls_client(dir: Option<&std::path::Path>) -> anyhow::Result<Option<TlsClient>> {
    let Some(dir) = dir else { return Ok(None) };
    let options = ClientOptions { certificates: Some(dir.into()), psk: None, tls13_only: true };
    Ok(Some(TlsClient::new(&options).context("--node-tls")?))
}

/// The server half of the node protocol's TLS from a `--node-tls` directory.
pub fn node_tls_server(dir: Option<&std::path::Path>) -> anyhow::Result<Option<TlsServer>> {
    let Some(dir) = dir else { return Ok(None) };
    let options = ServerOptions {
        certificates: Some(dir.into()),
        psk: None,
        verify_peer: false,
        tls13_only: true,
    };
    Ok(Some(TlsServer::new(&options).context("--node-tls")?))
}
