//! The command line, in one place: every verb's arguments (clap derive), shared option
//! groups ([`RemoteArgs`], [`UblkArg`]) and their parsers.

use crate::types::{Dev2Cache, Frontend, PollMode, DEFAULT_POLL_US};
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Parser)]
#[command(
    name = "ublkd",
    version,
    about = "Serve btrfs-ublk-image bundles lazily and mount them"
)]
pub struct Cli {
    #[command(subcommand)]
    pub cmd: Cmd,
}

#[derive(Subcommand)]
pub enum Cmd {
    /// Verify a bundle, serve its device 2 in the background and mount the image.
    Mount(MountArgs),
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
    Serve(ServeArgs),
    /// Benchmark only: a ublk device that completes every read at once (the transport's
    /// ceiling), same queue setup as `serve`; prints /dev/ublkbN, runs until SIGTERM.
    #[command(hide = true)]
    UblkNull {
        #[arg(long)]
        size_mb: u64,
        /// ublk queues with `--ublk-poll=off` (as `serve --threads`).
        #[arg(long, default_value_t = 4)]
        threads: usize,
        #[command(flatten)]
        ublk: UblkArg,
    },
}

#[derive(clap::Args, Debug)]
pub struct MountArgs {
    /// Bundle directory (manifest.json, meta.img, blockmap, packs/), the URL of a bundle's
    /// manifest.json (`http(s)://...`), or `oci://REGISTRY[:PORT]/REPO[:TAG|@sha256:DIGEST]`.
    pub bundle: String,
    /// Where to mount the image.
    pub mountpoint: PathBuf,
    /// Writable layer: a file that becomes the sprout's rw device (created sparse if missing;
    /// if it already holds this image's sprout, that filesystem is mounted again).
    #[arg(long)]
    pub rw: Option<PathBuf>,
    /// A writable layer that lives under /run/ublkd/ (overlayfs over the bundle's shared
    /// read-only mount) and is discarded by `umount`.
    #[arg(long, conflicts_with = "rw")]
    pub ephemeral: bool,
    /// Size of a new --rw file (K, M, G, T suffixes).
    #[arg(long, default_value = "10G", value_parser = parse_size)]
    pub rw_size: u64,
    #[arg(long, value_enum, default_value = "auto")]
    pub frontend: Frontend,
    /// fuse frontend: how device 2 is cached, for every mount of the bundle (a property
    /// of its server). page: FUSE file in the page cache under buffered loop devices
    /// (warm reads as fast as btrfs on a local loop device, but cold misses reach the
    /// server one at a time). direct: direct I/O end to end (every read reaches the
    /// server, misses in parallel). Default: page for a local bundle, direct for an
    /// http(s)/oci one, where a miss is a network round trip that parallel readers
    /// must not wait for in line. passthrough (never the default): the server copies
    /// device 2 whole, verified, into an unnamed file in --cache-dir when it starts (time
    /// and disk space of all of device 2: the mount is no longer lazy) and the kernel
    /// reads that file through FUSE passthrough; no read reaches the server (Linux >=
    /// 6.9). A bundle whose server already runs in another mode is refused (omit the
    /// flag to follow it). Ignored by the ublk frontend (direct I/O).
    #[arg(long, value_enum, value_name = "MODE")]
    pub dev2_cache: Option<Dev2Cache>,
    /// Refuse to mount unless the image id (sha256 of manifest.json) is this.
    #[arg(long)]
    pub expect_id: Option<String>,
    /// Memory for the server's verified chunk cache, in MiB (the bundle's first mount
    /// starts its server; later mounts share it).
    #[arg(long, default_value_t = DEFAULT_CACHE_MB)]
    pub cache_mb: u64,
    /// Registry credentials USER:PASSWORD (also from $UBLKD_REGISTRY_AUTH, else docker's config.json).
    #[arg(long)]
    pub registry_auth: Option<String>,
    #[command(flatten)]
    pub remote: RemoteArgs,
    /// Prefetch trace to apply (default: prefetch.trace beside manifest.json, if any);
    /// its chunks are fetched in the background once the mount is up.
    #[arg(long, value_name = "TRACE")]
    pub prefetch: Option<PathBuf>,
    /// Do not apply the bundle's prefetch.trace.
    #[arg(long, conflicts_with = "prefetch")]
    pub no_prefetch: bool,
    /// Signature policy, containers-policy.json(5) as podman and skopeo read it, checked
    /// before anything but the OCI manifest is fetched [default: /etc/containers/policy.json
    /// when it exists; no policy file: no check].
    #[arg(long, value_name = "FILE")]
    pub policy: Option<PathBuf>,
    /// containers-registries.d(5) directory: the lookaside storage of each repository's
    /// signatures [default: /etc/containers/registries.d].
    #[arg(long, value_name = "DIR")]
    pub registries_d: Option<PathBuf>,
    /// Run the structural check (meta.img's trees, extents against the blockmap, device
    /// 2's superblock, `btrfs check --readonly`) even if a record says this image passed.
    #[arg(long)]
    pub recheck: bool,
    #[command(flatten)]
    pub ublk: UblkArg,
}

#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {
    /// Bundle directory, `http(s)://.../manifest.json` or `oci://REGISTRY/REPO[:TAG]`.
    pub bundle: String,
    /// Frontend (auto: ublk when available, else fuse).
    #[arg(long, value_enum, default_value = "auto")]
    pub frontend: Frontend,
    /// Directory for stats.json (the mount's state directory when started by `mount`).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Refuse to serve unless the bundle's image id is this.
    #[arg(long)]
    pub expect_id: Option<String>,
    /// Memory for verified chunks, in MiB.
    #[arg(long, default_value_t = DEFAULT_CACHE_MB)]
    pub cache_mb: u64,
    /// fuse frontend: how device 2's FUSE file is cached (default: page for a local
    /// bundle, direct for a remote one; passthrough on request; see `ublkd mount
    /// --help`). ublk: ignored.
    #[arg(long, value_enum)]
    pub dev2_cache: Option<Dev2Cache>,
    /// FUSE worker threads / ublk queues.
    #[arg(long, default_value_t = 4)]
    pub threads: usize,
    /// Reattach to an existing ublk device left by a dead server (USER_RECOVERY).
    #[arg(long)]
    pub ublk_recover: Option<i32>,
    /// Keep device 2 alive across a crash of the server: run it as a child and start a
    /// new one when it dies (fuse: this process holds the FUSE connection, and the
    /// requests the dead server had taken are sent to the next; ublk: USER_RECOVERY).
    /// `mount` starts its servers so.
    #[arg(long)]
    pub supervise: bool,
    /// Supervised fuse server: the inherited /dev/fuse fd of the supervisor's connection.
    #[arg(long, hide = true, requires = "fuse_root_fd")]
    pub fuse_fd: Option<i32>,
    /// Supervised fuse server: the inherited root fd of the connection's detached mount.
    #[arg(long, hide = true, requires = "fuse_fd")]
    pub fuse_root_fd: Option<i32>,
    /// A supervisor's restart: the counters go on from `--dir`'s stats.json.
    #[arg(long, hide = true)]
    pub resume_stats: bool,
    /// Supervised fuse server: an earlier server answered the connection's FUSE_INIT.
    #[arg(long, hide = true, requires = "fuse_fd")]
    pub fuse_resume: bool,
    #[command(flatten)]
    pub ublk: UblkArg,
    #[command(flatten)]
    pub remote: RemoteArgs,
}

/// Options for remote bundles, shared by `mount` and `serve` (`mount` passes them on).
#[derive(clap::Args, Debug, Clone)]
pub struct RemoteArgs {
    /// Persistent cache of remote images [default: $UBLKD_CACHE_DIR, else /var/cache/ublkd].
    #[arg(long)]
    pub cache_dir: Option<PathBuf>,
    /// Bound of the chunk files of every image in the cache dir, least recently used
    /// evicted first across images (K, M, G, T suffixes).
    #[arg(long, default_value = "4G", value_parser = parse_size)]
    pub cache_size: u64,
    /// Seconds a remote fetch may take, retries included, before the read fails with EIO.
    #[arg(long, default_value_t = 30.0)]
    pub fetch_timeout: f64,
    /// Chunks fetched ahead when a remote pack is read sequentially (0: none).
    #[arg(long, default_value_t = 8)]
    pub readahead: u64,
    /// Talk plain HTTP to the registry (loopback registries always are).
    #[arg(long)]
    pub plain_http: bool,
}

impl RemoteArgs {
    /// The same options as command-line arguments (for `mount` -> `serve`).
    pub fn to_args(&self) -> Vec<String> {
        let mut a = vec![
            "--cache-size".to_string(),
            self.cache_size.to_string(),
            "--fetch-timeout".into(),
            self.fetch_timeout.to_string(),
            "--readahead".into(),
            self.readahead.to_string(),
            "--cache-dir".into(),
            self.cache_root().display().to_string(),
        ];
        if self.plain_http {
            a.push("--plain-http".into());
        }
        a
    }

    pub fn cache_root(&self) -> PathBuf {
        self.cache_dir
            .clone()
            .or_else(|| std::env::var_os("UBLKD_CACHE_DIR").map(PathBuf::from))
            .unwrap_or_else(|| PathBuf::from("/var/cache/ublkd"))
    }

    /// `--fetch-timeout` (at least 0.1 s).
    pub fn timeout(&self) -> Duration {
        Duration::from_secs_f64(self.fetch_timeout.max(0.1))
    }
}

/// `--ublk-poll` and `--ublk-queues`, one definition for `mount`, `serve` and `ublk-null`.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct UblkArg {
    /// ublk frontend: what the server's queue thread does between requests. auto (the
    /// default): after each request it busy-polls its ring for a window that grows while
    /// requests keep arriving close together (up to 2 ms) and shrinks to nothing when
    /// they do not, so a request arriving meanwhile costs no wakeup of the server while
    /// an idle or sparsely read device costs no CPU. US: always poll that many
    /// microseconds (the flag alone: 2000). off (or 0): always sleep, one queue per
    /// --threads. A property of the bundle's server, like --dev2-cache (docs/ublkd.md).
    #[arg(long = "ublk-poll", value_name = "MODE", num_args = 0..=1, require_equals = true, default_missing_value = DEFAULT_POLL_US)]
    pub ublk_poll: Option<PollMode>,
    /// ublk frontend: the device's hw queues, each with its own server thread (1 to 4;
    /// the kernel makes at most one per CPU and pins each queue's thread to its CPUs).
    /// Default, for local and remote bundles alike: one when the thread polls (auto or
    /// US), one per CPU (serve --threads, at most 4) with off (measured: docs/ublkd.md,
    /// "Queues"). A property of the bundle's server, like --ublk-poll.
    #[arg(long = "ublk-queues", value_name = "N", require_equals = true,
          value_parser = clap::value_parser!(u16).range(1..=MAX_UBLK_QUEUES as i64))]
    pub ublk_queues: Option<u16>,
}

/// The most ublk queues a server makes (`--ublk-queues`, `--threads` with `--ublk-poll=off`).
pub const MAX_UBLK_QUEUES: u16 = 4;

impl UblkArg {
    /// The mode a new server runs with: the one given, else the default.
    pub fn mode(&self) -> PollMode {
        self.ublk_poll.unwrap_or_default()
    }
}

/// `--cache-mb` when not given (and for servers recorded before the value was kept).
pub const DEFAULT_CACHE_MB: u64 = 256;

/// A size with an optional K, M, G, T suffix (`10G`, `512MiB`, `4096`).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().find(|(_, c)| c.is_ascii_alphabetic()) {
        Some((i, _)) => {
            let suffix = s[i..].to_ascii_uppercase();
            let m: u64 = match suffix.trim_end_matches("IB").trim_end_matches('B') {
                "" => 1,
                "K" => 1 << 10,
                "M" => 1 << 20,
                "G" => 1 << 30,
                "T" => 1 << 40,
                _ => return Err(format!("bad size suffix in {s:?}")),
            };
            (&s[..i], m)
        }
        None => (s, 1),
    };
    let n: u64 = num.trim().parse().map_err(|_| format!("bad size {s:?}"))?;
    n.checked_mul(mult).ok_or_else(|| format!("size {s:?} too large"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn poll_of(args: &[&str]) -> Option<PollMode> {
        let cli = Cli::try_parse_from(args).unwrap();
        match cli.cmd {
            Cmd::Mount(a) => a.ublk.ublk_poll,
            Cmd::Serve(a) => a.ublk.ublk_poll,
            Cmd::UblkNull { ublk, .. } => ublk.ublk_poll,
            _ => unreachable!(),
        }
    }

    #[test]
    fn ublk_poll_is_auto_by_default_and_parses_the_same_everywhere() {
        let fixed = PollMode::Fixed(DEFAULT_POLL_US.parse().unwrap());
        for base in [
            &["ublkd", "mount", "/b", "/m"][..],
            &["ublkd", "serve", "/b"],
            &["ublkd", "ublk-null", "--size-mb", "8"],
        ] {
            let with = |extra: &str| poll_of(&[base, &[extra]].concat());
            // not given: a new server polls adaptively (a mount follows an existing one)
            assert_eq!(poll_of(base), None);
            assert_eq!(UblkArg::default().mode(), PollMode::Auto);
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
            Cmd::Serve(a) => assert_eq!((a.ublk.ublk_poll, a.bundle.as_str()), (Some(fixed), "/b")),
            _ => unreachable!(),
        }
    }

    #[test]
    fn ublk_queues_parse_alike_everywhere_within_1_to_4() {
        for base in [
            &["ublkd", "mount", "/b", "/m"][..],
            &["ublkd", "serve", "/b"],
            &["ublkd", "ublk-null", "--size-mb", "8"],
        ] {
            let queues = |extra: &[&str]| {
                Cli::try_parse_from([base, extra].concat()).map(|c| match c.cmd {
                    Cmd::Mount(a) => a.ublk.ublk_queues,
                    Cmd::Serve(a) => a.ublk.ublk_queues,
                    Cmd::UblkNull { ublk, .. } => ublk.ublk_queues,
                    _ => unreachable!(),
                })
            };
            assert_eq!(queues(&[]).unwrap(), None);
            assert_eq!(queues(&["--ublk-queues=2"]).unwrap(), Some(2));
            assert_eq!(queues(&["--ublk-queues=4", "--ublk-poll=off"]).unwrap(), Some(4));
            for bad in ["--ublk-queues=0", "--ublk-queues=5", "--ublk-queues=x"] {
                assert!(queues(&[bad]).is_err(), "{bad} accepted");
            }
        }
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("10G"), Ok(10 << 30));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("1X").is_err());
    }
}
