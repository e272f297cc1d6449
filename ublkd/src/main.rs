//! ublkd: serve a btrfs-ublk-image bundle's data device lazily and mount the image.

mod blockmap;
mod bundle;
mod device;
mod frontend;
mod ops;
mod plumbing;
mod pool;
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
        #[command(flatten)]
        poll: frontend::ublk::PollArg,
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
        Cmd::UblkNull { size_mb, threads, poll } => frontend::ublk::serve_null(
            size_mb << 20,
            frontend::ublk::Options::with_threads(threads).with_poll(poll.mode()),
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
    use frontend::ublk::PollMode;

    fn poll_of(args: &[&str]) -> Option<PollMode> {
        let cli = Cli::try_parse_from(args).unwrap();
        match cli.cmd {
            Cmd::Mount(a) => a.poll.ublk_poll,
            Cmd::Serve(a) => a.poll.ublk_poll,
            Cmd::UblkNull { poll, .. } => poll.ublk_poll,
            _ => unreachable!(),
        }
    }

    #[test]
    fn ublk_poll_is_auto_by_default_and_parses_the_same_everywhere() {
        let fixed = PollMode::Fixed(frontend::ublk::DEFAULT_POLL_US.parse().unwrap());
        for base in [
            &["ublkd", "mount", "/b", "/m"][..],
            &["ublkd", "serve", "/b"],
            &["ublkd", "ublk-null", "--size-mb", "8"],
        ] {
            let with = |extra: &str| poll_of(&[base, &[extra]].concat());
            // not given: a new server polls adaptively (a mount follows an existing one)
            assert_eq!(poll_of(base), None);
            assert_eq!(frontend::ublk::PollArg::default().mode(), PollMode::Auto);
            assert_eq!(with("--ublk-poll"), Some(fixed));
            assert_eq!(with("--ublk-poll=50"), Some(PollMode::Fixed(50)));
            assert_eq!(with("--ublk-poll=auto"), Some(PollMode::Auto));
            assert_eq!(with("--ublk-poll=off"), Some(PollMode::Off));
            assert_eq!(with("--ublk-poll=0"), Some(PollMode::Off));
            let bad = Cli::try_parse_from([base, &["--ublk-poll=x"]].concat())
                .map(|_| ())
                .unwrap_err();
            assert!(bad.to_string().contains("auto, off or a number"), "{bad}");
        }
        // a bare flag does not swallow the next argument as its value
        let cli = Cli::try_parse_from(["ublkd", "serve", "--ublk-poll", "/b"]).unwrap();
        match cli.cmd {
            Cmd::Serve(a) => assert_eq!((a.poll.ublk_poll, a.bundle.as_str()), (Some(fixed), "/b")),
            _ => unreachable!(),
        }
    }
}
