//! ublkd: serve a btrfs-ublk-image bundle's data device lazily and mount the image.

mod blockmap;
mod bundle;
mod device;
mod frontend;
mod ops;
mod plumbing;
mod remote;
mod server;
mod state;
mod stats;
mod trace;
mod verify;

use clap::{Parser, Subcommand};
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "ublkd",
    version,
    about = "Serve btrfs-ublk-image bundles lazily and mount them"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Verify a bundle, serve its device 2 in the background and mount the image.
    Mount(ops::MountArgs),
    /// Unmount, detach every device, stop the server, remove the state.
    Umount {
        mountpoint: PathBuf,
        /// Detach the mount even if it is busy (MNT_DETACH).
        #[arg(long)]
        lazy: bool,
    },
    /// List mounts with their devices and the server's counters.
    Status {
        #[arg(long)]
        json: bool,
    },
    /// Write the pack chunks a mount's server has read on demand since it started, in
    /// first-access order, as a prefetch trace (source "record").
    Record {
        mountpoint: PathBuf,
        /// Where to write the trace (e.g. BUNDLE/prefetch.trace).
        #[arg(short, long)]
        output: PathBuf,
    },
    /// Restart a dead server and reattach device 2 without unmounting.
    Recover { mountpoint: PathBuf },
    /// Run the device-2 server in the foreground (what `mount` starts).
    Serve(server::ServeArgs),
}

/// `RUST_LOG=debug`: where a mount's time goes, as `timing <ms> <step>` lines in
/// CLOCK_REALTIME milliseconds (comparable between `mount` and its server's log).
pub fn timing(step: &str) {
    if log::log_enabled!(log::Level::Debug) {
        let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: clock_gettime fills the timespec we own.
        if unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut t) } == 0 {
            log::debug!("timing {:.3} {step}", t.tv_sec as f64 * 1e3 + t.tv_nsec as f64 / 1e6);
        }
    }
}

fn main() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info,fuser=error,libublk=warn"))
        .format_target(false)
        .init();
    timing("start");
    let cli = Cli::parse();
    let res = match cli.cmd {
        Cmd::Mount(a) => ops::mount(a),
        Cmd::Umount { mountpoint, lazy } => ops::umount(&mountpoint, lazy),
        Cmd::Status { json } => ops::status(json),
        Cmd::Recover { mountpoint } => ops::recover(&mountpoint),
        Cmd::Record { mountpoint, output } => ops::record(&mountpoint, &output),
        Cmd::Serve(a) => server::serve(a),
    };
    if let Err(e) = res {
        eprintln!("ublkd: error: {e:#}");
        std::process::exit(1);
    }
}
