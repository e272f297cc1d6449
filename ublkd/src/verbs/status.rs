//! `ublkd status [--json]`: mounts grouped by bundle, with devices and counters.

use crate::plumbing::mount as mnt;
use crate::state::{self, BundleState, LoopRecord, MountState, Restarts, ServerRecord, STATS_FILE};
use crate::stats::Snapshot;
use crate::types::{Ephemeral, Frontend, Mode, Phase, PollMode};
use anyhow::Result;

#[derive(serde::Serialize)]
pub struct StatusEntry<'a> {
    mountpoint: &'a str,
    bundle: &'a str,
    bundle_key: &'a str,
    name: &'a str,
    image_id: &'a str,
    mode: Mode,
    phase: Phase,
    rw_path: &'a Option<String>,
    /// ephemeral: overlay (over the shared mount) or sprout (own devices; the image has
    /// what overlayfs hides or interprets: `ephemeral_why`)
    ephemeral: Option<Ephemeral>,
    ephemeral_why: &'a Option<String>,
    /// ephemeral overlay: its upper directory
    upper: Option<String>,
    /// ro/ephemeral: the bundle's shared mount
    shared: Option<&'a str>,
    frontend: &'a str,
    mounted: bool,
    server_pid: Option<i32>,
    server_alive: bool,
    /// fuse: the server's `--dev2-cache` mode (page/direct)
    dev2_cache: Option<&'static str>,
    /// the server's `--cache-mb` (none for servers recorded before it was kept)
    cache_mb: Option<u64>,
    /// ublk: the server's `--ublk-poll` mode (auto, off, or a window in microseconds)
    ublk_poll: Option<PollMode>,
    /// ublk: the device's hw queues (none for servers recorded before it was kept)
    ublk_queues: Option<u16>,
    devices: Vec<String>,
    /// the supervisor's restarts of the bundle's server (count, last death and its cause,
    /// downtime, the running server's pid)
    restarts: Restarts,
    /// the bundle server's counters (shared by every mount of the bundle)
    #[serde(flatten)]
    stats: Snapshot,
}

/// A fuse server's `dev2` mode for status; none for ublk (always direct I/O).
pub fn server_dev2_cache(s: &ServerRecord) -> Option<&'static str> {
    (s.frontend == Frontend::Fuse).then(|| s.fuse_dev2_cache().as_str())
}

pub fn loop_desc(kind: &str, r: &LoopRecord) -> String {
    format!("{kind}={}{}", r.path, if r.direct_io { " (dio)" } else { "" })
}

pub fn status(json: bool) -> Result<()> {
    let states = MountState::all()?;
    let bundles = BundleState::all();
    let mounts = mnt::mounts()?;
    let nobundle = BundleState::default();
    let mut entries = Vec::new();
    for st in &states {
        let b = bundles.iter().find(|b| b.key == st.bundle_key).unwrap_or(&nobundle);
        let stats: Snapshot = std::fs::read(b.dir().join(STATS_FILE))
            .ok()
            .and_then(|x| serde_json::from_slice(&x).ok())
            .unwrap_or_default();
        let server_dev = b.server.as_ref().map(|s| s.device.as_str()).unwrap_or("-");
        let shared = b.shared.as_ref().filter(|_| st.uses_shared());
        let ephemeral = (st.mode == Mode::Ephemeral).then(|| st.ephemeral.unwrap_or(Ephemeral::Overlay));
        let mut devices: Vec<String> = Vec::new();
        let (meta, dev2, rw) = match shared {
            Some(sh) => (&sh.meta_loop, &sh.dev2_loop, &sh.rw_loop),
            None => (&st.meta_loop, &st.dev2_loop, &st.rw_loop),
        };
        if let Some(r) = meta {
            devices.push(loop_desc("meta", r));
        }
        if let Some(r) = dev2 {
            devices.push(format!("{} on {server_dev}", loop_desc("dev2", r)));
        }
        if let Some(node) = shared.and_then(|sh| sh.dev2_node.as_ref()) {
            devices.push(format!("dev2={node}"));
        }
        if let Some(r) = rw {
            devices.push(loop_desc(if shared.is_some() { "scratch" } else { "rw" }, r));
        }
        entries.push(StatusEntry {
            mountpoint: &st.mountpoint,
            bundle: &st.bundle,
            bundle_key: &st.bundle_key,
            name: &st.name,
            image_id: &st.image_id,
            mode: st.mode,
            phase: st.phase,
            rw_path: &st.rw_path,
            ephemeral,
            ephemeral_why: &st.ephemeral_why,
            upper: (ephemeral == Some(Ephemeral::Overlay)).then(|| st.dir().join("upper").display().to_string()),
            shared: shared.map(|s| s.path.as_str()),
            frontend: b.server.as_ref().map_or("", |s| s.frontend.as_str()),
            mounted: mounts
                .iter()
                .any(|m| m.mount_point == st.mountpoint && (m.fstype == "btrfs" || m.fstype == "overlay")),
            server_pid: b.server.as_ref().map(|s| s.pid),
            server_alive: b.server.as_ref().is_some_and(state::server_alive),
            dev2_cache: b.server.as_ref().and_then(server_dev2_cache),
            cache_mb: b.server.as_ref().and_then(|s| s.cache_mb),
            ublk_poll: b
                .server
                .as_ref()
                .filter(|s| s.ublk_id.is_some())
                .map(ServerRecord::ublk_poll_mode),
            ublk_queues: b.server.as_ref().and_then(|s| s.ublk_queues),
            devices,
            restarts: Restarts::load(&b.dir()),
            stats,
        });
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&entries)?);
        return Ok(());
    }
    if entries.is_empty() && bundles.is_empty() {
        println!("no ublkd mounts");
    }
    // grouped by bundle: its server, counters and shared mount, then its mounts
    for b in &bundles {
        let mine: Vec<&StatusEntry> = entries.iter().filter(|e| e.bundle_key == b.key).collect();
        println!("bundle {} [{}]", b.bundle, b.name);
        println!("  image    {}", b.image_id);
        match &b.server {
            Some(s) => println!(
                "  server   {} pid {} ({}), device {}{}{}{}",
                s.frontend,
                s.pid,
                if state::server_alive(s) {
                    "running"
                } else {
                    "NOT RUNNING"
                },
                s.device,
                server_dev2_cache(s).map_or(String::new(), |c| format!(", dev2-cache {c}")),
                s.cache_mb.map_or(String::new(), |m| format!(", chunk cache {m} MiB")),
                s.ublk_id.map_or(String::new(), |_| format!(
                    ", --ublk-poll={}{}",
                    s.ublk_poll_mode(),
                    s.ublk_queues.map_or(String::new(), |n| format!(", --ublk-queues={n}"))
                )),
            ),
            None => println!("  server   -"),
        }
        let r = Restarts::load(&b.dir());
        if r.count > 0 || r.gave_up {
            println!(
                "  restarts {} (last {} s ago: {}; readers waited {} ms, at most {} ms){}",
                r.count,
                state::now().saturating_sub(r.last_ms / 1000),
                r.last_cause,
                r.last_downtime_ms,
                r.max_downtime_ms,
                if r.gave_up {
                    "; GAVE UP: a new server failed to start, run `ublkd recover`"
                } else {
                    ""
                }
            );
        }
        if let Some(sh) = &b.shared {
            let devs: Vec<String> = [
                ("meta", &sh.meta_loop),
                ("dev2", &sh.dev2_loop),
                ("scratch", &sh.rw_loop),
            ]
            .iter()
            .filter_map(|(k, r)| r.as_ref().map(|r| loop_desc(k, r)))
            .chain(sh.dev2_node.iter().map(|n| format!("dev2={n}")))
            .collect();
            println!("  shared   {} ({}) {}", sh.path, sh.phase, devs.join(" "));
        }
        if let Some(e) = mine.first() {
            println!(
                "  served   {} bytes in {} reads; {} chunks verified, {} verification failures, {} read errors, {} pack bytes read, {} cache hits",
                e.stats.bytes_served, e.stats.reads, e.stats.chunks_verified, e.stats.verify_failures, e.stats.read_errors, e.stats.pack_bytes_read, e.stats.cache_hits
            );
            if !b.serve_args.is_empty() {
                let s = &e.stats;
                println!(
                    "  fetched  {} bytes in {} requests ({} failed), latency mean {:.1} ms max {:.1} ms; \
                     chunk cache {} hits {} misses {} bad, {} bytes ({} bytes from other images' caches); \
                     {} chunks read ahead",
                    s.fetch_bytes,
                    s.fetch_requests,
                    s.fetch_errors,
                    s.fetch_latency_us_mean as f64 / 1000.0,
                    s.fetch_latency_us_max as f64 / 1000.0,
                    s.disk_cache_hits,
                    s.disk_cache_misses,
                    s.disk_cache_corrupt,
                    s.disk_cache_bytes,
                    s.disk_cache_shared_bytes,
                    s.readahead_chunks
                );
            }
            let s = &e.stats;
            println!("  demand   {} chunks loaded for device reads", s.demand_chunk_loads);
            if s.prefetch_total > 0 {
                println!(
                    "  prefetch {}/{} chunks done ({}), {} fetched ({} bytes), {} errors",
                    s.prefetch_done,
                    s.prefetch_total,
                    if s.prefetch_done < s.prefetch_total {
                        "running"
                    } else {
                        "finished"
                    },
                    s.prefetch_chunks,
                    s.prefetch_bytes,
                    s.prefetch_errors
                );
            }
        }
        println!("  mounts   {}", mine.len());
        for e in &mine {
            let what = match e.mode {
                Mode::Rw => format!("rw {} [{}]", e.rw_path.as_deref().unwrap_or("-"), e.devices.join(" ")),
                Mode::Ephemeral if e.ephemeral == Some(Ephemeral::Sprout) => format!(
                    "ephemeral, btrfs sprout onto {} [{}] (not overlayfs: {})",
                    e.rw_path.as_deref().unwrap_or("-"),
                    e.devices.join(" "),
                    e.ephemeral_why.as_deref().unwrap_or("-")
                ),
                Mode::Ephemeral => format!(
                    "ephemeral, {}, upper {}",
                    Ephemeral::Overlay.as_str(),
                    e.upper.as_deref().unwrap_or("-")
                ),
                m => m.to_string(),
            };
            println!(
                "    {} {} ({})",
                e.mountpoint,
                what,
                if e.mounted { Phase::Mounted } else { e.phase }
            );
        }
    }
    for e in entries
        .iter()
        .filter(|e| !bundles.iter().any(|b| b.key == e.bundle_key))
    {
        println!("{} ({}, {}): no bundle state", e.mountpoint, e.mode, e.phase);
    }
    Ok(())
}
