//! One module per subcommand.

pub mod bench;
pub mod exports;
pub mod logging;
pub mod nbd;
pub mod nbd_file;
pub mod node;
pub mod serving;
pub mod stat;
pub mod tls;
pub mod trace;
pub mod up;
pub mod vhost;
pub mod warm;
