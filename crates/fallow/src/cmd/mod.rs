//! One module per subcommand.

pub mod trace;
