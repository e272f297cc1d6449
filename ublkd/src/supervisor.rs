//! `ublkd serve --supervise`: runs the server as a child and starts a new one when it
//! dies, so that device 2 outlives a crash of its server without a person running
//! `ublkd recover`.
//!
//! * fuse: the supervisor makes the FUSE connection ([`frontend::fuse::connect`]) and
//!   holds its `/dev/fuse` fd; every server inherits it. The kernel ends a connection
//!   only when its last fd closes, so a server's death leaves the loop devices on
//!   `dev2` and the mounts above them intact; requests wait in the kernel. The next
//!   server resumes the connection (no second FUSE_INIT) and sends FUSE_NOTIFY_RESEND,
//!   which gives it the requests the dead one had taken and not answered. Readers see a
//!   delay, not EIO.
//! * ublk (UBLK_F_USER_RECOVERY): the kernel keeps `/dev/ublkbN` and queues its I/O;
//!   the supervisor sends START_USER_RECOVERY and starts a server with
//!   `--ublk-recover N` (what `ublkd recover` does by hand).
//!
//! The supervisor is what `mount` records as the bundle's server (its pid, and for fuse
//! the device `/proc/<supervisor>/fd/<root>/dev2`): SIGTERM/SIGINT/SIGHUP stop the
//! server and then the supervisor, SIGUSR1/SIGUSR2 are passed on. The server gets
//! PR_SET_PDEATHSIG, so it never outlives its supervisor. Each restart is counted in
//! `restarts.json` ([`Restarts`]) in `--dir`. A server that dies before its READY line
//! five times in a row makes the supervisor give up (then exit: fuse readers get EIO,
//! and `ublkd recover` is what is left).

use crate::args::ServeArgs;
use crate::frontend;
use crate::server::{announce, Ready, SIGNALS};
use crate::state::Restarts;
use crate::types::Frontend;
use anyhow::{bail, Context, Result};
use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use std::ffi::OsString;
use std::io::Read;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// A server that has not printed READY by then is killed (and counts as a failed start).
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Failed starts in a row after which the supervisor gives up.
const MAX_FAILED_STARTS: u32 = 5;

/// How one server ended.
struct Exit {
    status: ExitStatus,
    /// it had printed READY
    ready: bool,
    /// we were told to stop (and passed SIGTERM on)
    stopping: bool,
}

/// Why a server died, for `status`.
fn cause(status: &ExitStatus) -> String {
    match (status.signal(), status.code()) {
        (Some(sig), _) => match Signal::try_from(sig) {
            Ok(s) => format!("killed by {s}"),
            Err(_) => format!("killed by signal {sig}"),
        },
        (None, Some(code)) => format!("exited with status {code}"),
        _ => status.to_string(),
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// This process's `serve` arguments (`args`, after the program name) for its child:
/// without `--supervise`, and with `--frontend` and `--ublk-recover` left to [`spawn`].
fn child_args(args: impl IntoIterator<Item = OsString>) -> Vec<OsString> {
    let mut out = Vec::new();
    let mut args = args.into_iter();
    while let Some(a) = args.next() {
        let s = a.to_string_lossy();
        if s == "--supervise" || s.starts_with("--frontend=") || s.starts_with("--ublk-recover=") {
            continue;
        }
        if s == "--frontend" || s == "--ublk-recover" {
            args.next();
            continue;
        }
        out.push(a);
    }
    out
}

/// Start a server: `fuse` = the connection's (/dev/fuse, root) fds it inherits; `resume`
/// for every server after the first (fuse: an earlier one answered FUSE_INIT; the
/// counters go on); `ublk_recover` = the ublk device to reattach.
fn spawn(
    base: &[OsString],
    kind: Frontend,
    fuse: Option<(RawFd, RawFd)>,
    resume: bool,
    ublk_recover: Option<i32>,
) -> Result<Child> {
    let exe = std::env::current_exe().context("locate the ublkd executable")?;
    let mut cmd = Command::new(exe);
    cmd.args(base).args(["--frontend", kind.as_str()]);
    if let Some((f, r)) = fuse {
        cmd.args(["--fuse-fd", &f.to_string(), "--fuse-root-fd", &r.to_string()]);
        if resume {
            cmd.arg("--fuse-resume");
        }
    }
    if resume {
        cmd.arg("--resume-stats");
    }
    if let Some(id) = ublk_recover {
        cmd.args(["--ublk-recover", &id.to_string()]);
    }
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::inherit());
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            // the server takes its signals itself: none blocked (ours are, for the signalfd)
            let empty: libc::sigset_t = std::mem::zeroed();
            libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
            // never outlive the supervisor (it would hold the device with nobody to restart it)
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            if let Some((f, r)) = fuse {
                for fd in [f, r] {
                    if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
            }
            Ok(())
        });
    }
    cmd.spawn().context("start ublkd serve")
}

/// Wait for `child` to end, handing its READY line to `on_ready` and passing signals on.
fn watch(child: &mut Child, sfd: &mut SignalFd, mut on_ready: impl FnMut(Ready) -> Result<()>) -> Result<Exit> {
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    let mut out = child.stdout.take();
    let mut line = Vec::new();
    let (mut ready, mut stopping) = (false, false);
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        let mut fds = vec![libc::pollfd {
            fd: sfd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }];
        if let Some(o) = &out {
            fds.push(libc::pollfd {
                fd: o.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
        }
        let timeout = if ready || stopping {
            -1
        } else {
            deadline.saturating_duration_since(Instant::now()).as_millis() as i32
        };
        // SAFETY: poll(2) on an array of pollfds we own.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e).context("poll");
        }
        if n == 0 && !ready && !stopping {
            log::error!("server pid {pid} printed no READY line in {READY_TIMEOUT:?}: killing it");
            let _ = nix::sys::signal::kill(pid, Signal::SIGKILL);
            stopping = true;
            continue;
        }
        if fds.len() > 1 && fds[1].revents != 0 {
            let mut buf = [0u8; 4096];
            let got = out.as_mut().map_or(Ok(0), |o| o.read(&mut buf)).unwrap_or(0);
            line.extend_from_slice(&buf[..got]);
            if let Some(end) = line.iter().position(|&b| b == b'\n') {
                let text = String::from_utf8_lossy(&line[..end]).into_owned();
                match text.strip_prefix("READY ").map(serde_json::from_str::<Ready>) {
                    Some(Ok(r)) if !ready => {
                        ready = true;
                        on_ready(r)?;
                    }
                    _ => log::warn!("server pid {pid}: unexpected output {text:?}"),
                }
                out = None;
            } else if got == 0 {
                out = None;
            }
        }
        if fds[0].revents != 0 {
            let Some(si) = sfd.read_signal().context("read the signalfd")? else {
                continue;
            };
            match Signal::try_from(si.ssi_signo as i32) {
                Ok(Signal::SIGCHLD) => {
                    if let Some(status) = child.try_wait().context("wait for the server")? {
                        return Ok(Exit {
                            status,
                            ready,
                            stopping,
                        });
                    }
                }
                Ok(s @ (Signal::SIGUSR1 | Signal::SIGUSR2)) if ready => {
                    let _ = nix::sys::signal::kill(pid, s);
                }
                Ok(s @ (Signal::SIGTERM | Signal::SIGINT | Signal::SIGHUP)) => {
                    log::info!("{s}: stopping the server (pid {pid})");
                    stopping = true;
                    let _ = nix::sys::signal::kill(pid, Signal::SIGTERM);
                }
                _ => {}
            }
        }
    }
}

/// Sleep `d` unless a stop signal comes first (then true).
fn stop_requested_within(sfd: &mut SignalFd, d: Duration) -> Result<bool> {
    let until = Instant::now() + d;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(false);
        }
        let mut p = libc::pollfd {
            fd: sfd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll(2) on one pollfd we own.
        if unsafe { libc::poll(&mut p, 1, left.as_millis() as i32) } > 0 {
            if let Some(si) = sfd.read_signal().context("read the signalfd")? {
                let s = Signal::try_from(si.ssi_signo as i32);
                if matches!(s, Ok(Signal::SIGTERM | Signal::SIGINT | Signal::SIGHUP)) {
                    return Ok(true);
                }
            }
        }
    }
}

/// START_USER_RECOVERY once the kernel has noticed the server's death (it quiesces the
/// device when the dead server's io_uring commands are cancelled, which may take a
/// moment after the process is gone; seconds in the VM harness under TCG).
fn begin_ublk_recovery(id: i32) -> Result<()> {
    let t = Instant::now();
    loop {
        match frontend::ublk::begin_recovery(id) {
            Ok(()) => {
                log::info!("ublk device {id}: recovery started after {:?}", t.elapsed());
                return Ok(());
            }
            Err(e) if t.elapsed() > Duration::from_secs(30) => return Err(e),
            Err(e) => log::debug!("{e:#}: retrying"),
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn save(restarts: &Restarts, dir: Option<&Path>) {
    if let Some(d) = dir {
        if let Err(e) = restarts.save(d) {
            log::warn!("{e:#}");
        }
    }
}

pub fn supervise(args: ServeArgs) -> Result<()> {
    let kind = match args.frontend {
        Frontend::Auto => frontend::choose(Frontend::Auto)?.0,
        k => k,
    };
    let mut mask = SigSet::empty();
    for s in SIGNALS.into_iter().chain([Signal::SIGCHLD]) {
        mask.add(s);
    }
    mask.thread_block().context("block signals")?;
    let mut sfd = SignalFd::with_flags(&mask, SfdFlags::SFD_CLOEXEC).context("signalfd")?;
    // SAFETY: ignoring SIGPIPE is always sound.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };

    // fuse: the connection lives here, in every server's fds, and dies with us
    let conn = match kind {
        Frontend::Fuse => Some(frontend::fuse::connect()?),
        _ => None,
    };
    let fuse_fds = conn.as_ref().map(|c| (c.fuse.as_raw_fd(), c.root.as_raw_fd()));
    let me = std::process::id() as i32;
    let base = child_args(std::env::args_os().skip(1));
    let dir = args.dir.as_deref();
    if let Some(d) = dir {
        std::fs::create_dir_all(d).with_context(|| format!("{}: mkdir", d.display()))?;
    }
    // the count goes on across `ublkd recover` (a new supervisor for the same bundle)
    let mut restarts = dir.map(Restarts::load).unwrap_or_default();
    restarts.gave_up = false;
    let mut ublk_id = args.ublk_recover;
    let mut recover_next = args.ublk_recover;
    let (mut announced, mut failed_starts) = (false, 0u32);
    let mut died: Option<(Instant, String)> = None;
    loop {
        let mut child = spawn(&base, kind, fuse_fds, announced, recover_next)?;
        let child_pid = child.id() as i32;
        let exit = watch(&mut child, &mut sfd, |r| {
            restarts.server_pid = child_pid;
            if !announced {
                let device = match fuse_fds {
                    Some((_, root)) => format!("/proc/{me}/fd/{root}/{}", frontend::fuse::FILE_NAME),
                    None => r.device.clone(),
                };
                ublk_id = r.ublk_id.or(ublk_id);
                announce(&Ready { pid: me, device, ..r })?;
                announced = true;
            }
            if let Some((at, cause)) = died.take() {
                let down = at.elapsed().as_millis() as u64;
                restarts.count += 1;
                restarts.last_cause = cause;
                restarts.last_downtime_ms = down;
                restarts.max_downtime_ms = restarts.max_downtime_ms.max(down);
                log::info!("server restarted (pid {child_pid}) {down} ms after the last one died");
            }
            save(&restarts, dir);
            Ok(())
        })?;
        if exit.stopping {
            return Ok(());
        }
        if exit.status.success() {
            log::info!("server (pid {child_pid}) ended: {}", exit.status);
            return Ok(());
        }
        if !announced {
            bail!("the server (pid {child_pid}) did not start: {}", cause(&exit.status));
        }
        let why = cause(&exit.status);
        if exit.ready {
            failed_starts = 0;
            log::warn!("server pid {child_pid} died ({why}): starting a new one");
            restarts.last_ms = unix_ms();
            died = Some((Instant::now(), why));
        } else {
            failed_starts += 1;
            log::error!("a new server (pid {child_pid}) failed to start ({why}), {failed_starts} in a row");
            if failed_starts >= MAX_FAILED_STARTS {
                restarts.gave_up = true;
                save(&restarts, dir);
                bail!("giving up after {failed_starts} failed starts; `ublkd recover` starts a new server");
            }
            if stop_requested_within(&mut sfd, Duration::from_millis(100 << failed_starts))? {
                return Ok(());
            }
        }
        // ublk: a server that died serving needs START_USER_RECOVERY; after one that
        // failed to start, the device is still in recovery for the next attempt
        if let (Some(id), true) = (ublk_id, exit.ready) {
            begin_ublk_recovery(id)?;
            recover_next = Some(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn child_args_drop_what_the_supervisor_sets() {
        let argv = "serve --supervise /b --frontend auto --expect-id sha256:x --ublk-recover 3 --ublk-recover=4 \
                    --frontend=fuse --cache-mb 9";
        let got = child_args(argv.split_whitespace().map(OsString::from));
        let want: Vec<OsString> = "serve /b --expect-id sha256:x --cache-mb 9"
            .split_whitespace()
            .map(OsString::from)
            .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn causes_name_the_signal_or_status() {
        assert_eq!(cause(&ExitStatus::from_raw(libc::SIGKILL)), "killed by SIGKILL");
        assert_eq!(cause(&ExitStatus::from_raw(101 << 8)), "exited with status 101");
    }
}
