//! ublkd: serve a btrfs-ublk-image bundle's data device lazily and mount the image.
//!
//! Layers, bottom first (docs/ublkd.md; `tests/layers.rs` checks that each module
//! imports only its own layer or those below, and that there is no cycle):
//! util, plumbing, stats -> format -> types, state, args -> store -> verify -> device
//! -> frontend -> server, supervisor -> verbs -> main.

mod args;
mod device;
mod format;
mod frontend;
mod plumbing;
mod pool;
mod server;
mod state;
mod stats;
mod store;
mod supervisor;
mod types;
mod util;
mod verbs;
mod verify;

use args::{Cli, Cmd};
use clap::Parser;

fn main() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info,fuser=error,libublk=warn"))
        .format_target(false)
        .init();
    util::timing("start");
    let cli = Cli::parse();
    let res = match cli.cmd {
        Cmd::Mount(a) => verbs::mount::mount(a),
        Cmd::Umount { mountpoint, lazy } => verbs::umount::umount(&mountpoint, lazy),
        Cmd::Status { json } => verbs::status::status(json),
        Cmd::Recover { mountpoint } => verbs::recover::recover(&mountpoint),
        Cmd::Record { mountpoint, output } => verbs::record::record(&mountpoint, &output),
        Cmd::Serve(a) if a.supervise => supervisor::supervise(a),
        Cmd::Serve(a) => server::serve(a),
        Cmd::UblkNull { size_mb, threads, ublk } => frontend::ublk::serve_null(
            size_mb << 20,
            frontend::ublk::Options::new(threads, ublk.mode(), ublk.ublk_queues),
        ),
    };
    if let Err(e) = res {
        eprintln!("ublkd: error: {e:#}");
        std::process::exit(1);
    }
}
