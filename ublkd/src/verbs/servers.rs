//! A bundle's server process, seen from the verbs: start `ublkd serve` and wait for its
//! `READY` line, stop it (only the recorded process), use the running one, hand it a
//! prefetch request.

use super::mounts::mounts_of;
use crate::args::UblkArg;
use crate::format::trace::{self, Trace};
use crate::frontend;
use crate::server::Ready;
use crate::state::{self, BundleState, ServerRecord, SERVER_LOG};
use crate::types::{Dev2Cache, Frontend};
use crate::util::timing;
use anyhow::{bail, ensure, Context, Result};
use std::fs::OpenOptions;
use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

pub fn server_log_tail(dir: &Path) -> String {
    let text = std::fs::read_to_string(dir.join(SERVER_LOG)).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(8)..].join("\n")
}

/// Start `ublkd serve` in the background (own session, log in `dir/server.log`) and wait
/// for its READY line.
pub fn spawn_server(
    b: &BundleState,
    kind: Frontend,
    cache_mb: u64,
    dev2_cache: Dev2Cache,
    ublk: &UblkArg,
    recover: Option<i32>,
) -> Result<(Ready, ServerRecord)> {
    let ublk_poll = ublk.mode();
    let (bundle, dir, image_id) = (b.bundle.as_str(), &b.dir(), b.image_id.as_str());
    let exe = std::env::current_exe().context("locate the ublkd executable")?;
    let log = OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(SERVER_LOG))
        .with_context(|| format!("{}: open", dir.join(SERVER_LOG).display()))?;
    let mut cmd = Command::new(exe);
    // supervised: a server that dies is restarted and device 2 reattached (src/supervisor.rs)
    cmd.arg("serve")
        .arg("--supervise")
        .arg(bundle)
        .args(["--frontend", kind.as_str(), "--expect-id", image_id])
        .arg("--dir")
        .arg(dir)
        .args(["--cache-mb", &cache_mb.to_string()])
        .args(["--dev2-cache", dev2_cache.as_str()])
        .args(&b.serve_args);
    if let Some(id) = recover {
        cmd.args(["--ublk-recover", &id.to_string()]);
    }
    if kind == Frontend::Ublk {
        cmd.arg(format!("--ublk-poll={ublk_poll}"));
        if let Some(n) = ublk.ublk_queues {
            cmd.arg(format!("--ublk-queues={n}"));
        }
    }
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::from(log));
    // SAFETY: setsid is async-signal-safe; the server must not die with our terminal.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let mut child = cmd.spawn().context("start ublkd serve")?;
    timing("server spawned");
    let pid = child.id() as i32;
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut r = BufReader::new(stdout);
        let mut line = String::new();
        let _ = r.read_line(&mut line);
        let _ = tx.send(line);
    });
    let line = rx.recv_timeout(Duration::from_secs(30)).unwrap_or_default();
    let ready = line
        .strip_prefix("READY ")
        .and_then(|j| serde_json::from_str::<Ready>(j.trim()).ok());
    match ready {
        Some(r) => {
            let start_time = state::proc_start_time(pid).unwrap_or(0);
            let rec = ServerRecord {
                pid,
                start_time,
                frontend: r.frontend,
                device: r.device.clone(),
                ublk_id: r.ublk_id,
                dev2_cache: r.dev2_cache,
                cache_mb: Some(cache_mb),
                ublk_poll: r.ublk_id.and(Some(ublk_poll)),
                ublk_poll_us: None,
                ublk_queues: r.ublk_queues,
            };
            // the server outlives us; it is reaped by init once we exit
            std::mem::forget(child);
            Ok((r, rec))
        }
        None => {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "ublkd serve did not start; its log ({}):\n{}",
                dir.join(SERVER_LOG).display(),
                server_log_tail(dir)
            )
        }
    }
}

/// Stop a server: SIGTERM, then SIGKILL. Only a process whose pid and start time match.
pub fn stop_server(s: &ServerRecord) -> Result<()> {
    if !state::server_alive(s) {
        return Ok(());
    }
    let pid = nix::unistd::Pid::from_raw(s.pid);
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
    let t = Instant::now();
    while state::server_alive(s) {
        if t.elapsed() > Duration::from_secs(10) {
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
            std::thread::sleep(Duration::from_millis(100));
            ensure!(!state::server_alive(s), "server pid {} does not exit", s.pid);
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

pub fn ublk_dev_exists(id: i32) -> bool {
    Path::new(&format!("/dev/ublkc{id}")).exists() || Path::new(&format!("/sys/class/ublk-char/ublkc{id}")).exists()
}

/// A ublk server that died leaves I/O queued (USER_RECOVERY): delete its device first
/// so that unmounts see errors instead of waiting forever.
pub fn fail_dead_ublk(b: &BundleState) -> Result<()> {
    if let Some(srv) = &b.server {
        if let (Some(id), false) = (srv.ublk_id, state::server_alive(srv)) {
            if ublk_dev_exists(id) {
                frontend::ublk::delete(id, true)?;
            }
        }
    }
    Ok(())
}

/// The bundle's server: the running one, or a new one.
pub fn ensure_server(
    b: &mut BundleState,
    asked: Frontend,
    kind: Frontend,
    cache_mb: u64,
    dev2_cache: (Dev2Cache, bool),
    ublk: &UblkArg,
    me: &str,
) -> Result<ServerRecord> {
    let ublk_poll = ublk.ublk_poll;
    if let Some(s) = &b.server {
        if state::server_alive(s) {
            ensure!(
                asked == Frontend::Auto || s.frontend == kind,
                "bundle {} is already served by a {} server (pid {}): use --frontend {} or auto",
                b.bundle,
                s.frontend,
                s.pid,
                s.frontend
            );
            let (cache, explicit) = dev2_cache;
            ensure!(
                !explicit || s.ublk_id.is_some() || s.fuse_dev2_cache() == cache,
                "bundle {} is already served with --dev2-cache {} (pid {}; the mode holds for all its mounts): omit \
                 --dev2-cache to follow it, or unmount the bundle's mounts first",
                b.bundle,
                s.fuse_dev2_cache().as_str(),
                s.pid
            );
            ensure!(
                ublk_poll.is_none() || s.ublk_id.is_none() || Some(s.ublk_poll_mode()) == ublk_poll,
                "bundle {} is already served with --ublk-poll={} (pid {}; the mode holds for all its mounts): omit \
                 --ublk-poll to follow it, or unmount the bundle's mounts first",
                b.bundle,
                s.ublk_poll_mode(),
                s.pid
            );
            ensure!(
                ublk.ublk_queues.is_none() || s.ublk_id.is_none() || s.ublk_queues == ublk.ublk_queues,
                "bundle {} is already served with {} ublk queue(s) (pid {}; the count holds for all its mounts): \
                 omit --ublk-queues to follow it, or unmount the bundle's mounts first",
                b.bundle,
                s.ublk_queues
                    .map_or("an unrecorded number of".to_string(), |n| n.to_string()),
                s.pid
            );
            return Ok(s.clone());
        }
        let others: Vec<String> = mounts_of(&b.key)?
            .into_iter()
            .filter(|m| m.id != me)
            .map(|m| m.mountpoint)
            .collect();
        ensure!(
            others.is_empty(),
            "the server of bundle {} (pid {}) is not running and it still has mounts ({}): run `ublkd recover` on one \
             of them first",
            b.bundle,
            s.pid,
            others.join(", ")
        );
    }
    std::fs::create_dir_all(b.dir()).with_context(|| format!("{}: mkdir", b.dir().display()))?;
    let (_ready, srv) = spawn_server(b, kind, cache_mb, dev2_cache.0, ublk, None)?;
    b.server = Some(srv.clone());
    b.save()?;
    Ok(srv)
}

/// Hand a trace to the bundle's server: written into its directory, then SIGUSR1.
pub fn request_prefetch(b: &BundleState, srv: &ServerRecord, t: &Trace) -> Result<()> {
    ensure!(state::server_alive(srv), "the server (pid {}) is not running", srv.pid);
    t.write(&b.dir().join(trace::FILE_NAME))?;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(srv.pid), nix::sys::signal::Signal::SIGUSR1)
        .with_context(|| format!("signal the server (pid {})", srv.pid))?;
    Ok(())
}
