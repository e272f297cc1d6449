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
    /// Benchmark only: a ublk device that completes every read at once (the transport's
    /// ceiling), same queue setup as `serve`; prints /dev/ublkbN, runs until SIGTERM.
    #[command(hide = true)]
    UblkNull {
        #[arg(long)]
        size_mb: u64,
        /// ublk queues (as `serve --threads`).
        #[arg(long, default_value_t = 4)]
        threads: usize,
        /// Busy-poll each queue US microseconds after its last request (as `serve
        /// --ublk-poll`).
        #[arg(long, value_name = "US", num_args = 0..=1, require_equals = true, default_missing_value = frontend::ublk::DEFAULT_POLL_US)]
        ublk_poll: Option<u64>,
    },
}

/// `RUST_LOG=debug`: where a mount's time goes, as `timing <ms> <step>` lines in
/// CLOCK_REALTIME milliseconds (comparable between `mount` and its server's log).
pub fn timing(step: &str) {
    if log::log_enabled!(log::Level::Debug) {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        log::debug!("timing {:.3} {step}", t.as_secs_f64() * 1e3);
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
        Cmd::UblkNull {
            size_mb,
            threads,
            ublk_poll,
        } => frontend::ublk::serve_null(
            size_mb << 20,
            frontend::ublk::Options::with_threads(threads).with_poll(ublk_poll),
        ),
    };
    if let Err(e) = res {
        eprintln!("ublkd: error: {e:#}");
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mount_poll(args: &[&str]) -> Option<u64> {
        let base = ["ublkd", "mount", "/b", "/m"];
        let cli = Cli::try_parse_from(base.iter().chain(args)).unwrap();
        match cli.cmd {
            Cmd::Mount(a) => a.ublk_poll,
            _ => unreachable!(),
        }
    }

    #[test]
    fn ublk_poll_is_off_by_default_and_takes_an_optional_value() {
        assert_eq!(mount_poll(&[]), None);
        let default: u64 = frontend::ublk::DEFAULT_POLL_US.parse().unwrap();
        assert_eq!(mount_poll(&["--ublk-poll"]), Some(default));
        assert_eq!(mount_poll(&["--ublk-poll=50"]), Some(50));
        // a bare flag does not swallow the next argument as its value
        let cli = Cli::try_parse_from(["ublkd", "serve", "--ublk-poll", "/b"]).unwrap();
        match cli.cmd {
            Cmd::Serve(a) => assert_eq!((a.ublk_poll, a.bundle.as_str()), (Some(default), "/b")),
            _ => unreachable!(),
        }
        assert!(Cli::try_parse_from(["ublkd", "mount", "/b", "/m", "--ublk-poll=x"]).is_err());
    }
}
