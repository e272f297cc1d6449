//! Typed state shared by every layer: which frontend serves a bundle, how it caches and
//! polls, a mount's mode and phase. Their serde forms are the strings of the state files,
//! `READY` lines and `ublkd status --json`.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Frontend {
    #[default]
    Auto,
    Ublk,
    Fuse,
}

impl Frontend {
    pub fn as_str(&self) -> &'static str {
        match self {
            Frontend::Auto => "auto",
            Frontend::Ublk => "ublk",
            Frontend::Fuse => "fuse",
        }
    }
}

impl std::fmt::Display for Frontend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How device 2's FUSE file is cached (`--dev2-cache`), see `crate::frontend::fuse`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dev2Cache {
    /// Page-cached FUSE file under buffered loop devices: warm reads at local-loop
    /// speed, cold misses one at a time.
    Page,
    /// Direct-I/O FUSE file and loop devices: every read reaches the server, misses in
    /// parallel.
    Direct,
    /// FUSE passthrough (kernel >= 6.9): the server writes device 2 whole, verified, into
    /// an unnamed local file at its start and every open of `dev2` reads that file in
    /// the kernel; no read reaches the server. Never the default.
    Passthrough,
}

impl Dev2Cache {
    pub fn as_str(&self) -> &'static str {
        match self {
            Dev2Cache::Page => "page",
            Dev2Cache::Direct => "direct",
            Dev2Cache::Passthrough => "passthrough",
        }
    }

    /// The default for a bundle: `page` when its packs are local files (a miss costs a
    /// pack read and a sha256), `direct` when they are fetched over the network (a miss
    /// costs a round trip, and a buffered loop device would send misses one at a time).
    pub fn default_for(remote: bool) -> Dev2Cache {
        if remote {
            Dev2Cache::Direct
        } else {
            Dev2Cache::Page
        }
    }

    /// Whether a loop device on `dev2` runs with direct I/O in this mode.
    pub fn loop_direct_io(&self) -> bool {
        *self == Dev2Cache::Direct
    }
}

/// `--ublk-poll` without a value: a fixed window of this many microseconds.
pub const DEFAULT_POLL_US: &str = "2000";

/// How the queue thread waits for the next request (`--ublk-poll`, a property of the
/// bundle's server).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PollMode {
    /// Sleep in io_uring_enter at once (libublk's loop), one queue per `--threads`.
    Off,
    /// Poll for a window that follows how close together requests arrive
    /// (`crate::frontend::ublk::poll::PollWindow`): none while the device is idle or sparsely used.
    #[default]
    Auto,
    /// Poll for this many microseconds after every batch.
    Fixed(u64),
}

impl std::str::FromStr for PollMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(PollMode::Auto),
            "off" | "0" => Ok(PollMode::Off),
            _ => s
                .parse::<u64>()
                .map(PollMode::Fixed)
                .map_err(|_| format!("{s:?}: expected auto, off or a number of microseconds")),
        }
    }
}

impl std::fmt::Display for PollMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PollMode::Off => f.write_str("off"),
            PollMode::Auto => f.write_str("auto"),
            PollMode::Fixed(us) => write!(f, "{us}"),
        }
    }
}

impl serde::Serialize for PollMode {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for PollMode {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// A mount's mode (`mount --rw PATH`, `--ephemeral`, or neither).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// A read-only bind mount of the bundle's shared mount.
    #[default]
    Ro,
    /// overlayfs over the shared mount, upper and work dirs in the mount's state dir.
    Ephemeral,
    /// Own device instances, native btrfs sprout onto the rw file.
    Rw,
}

impl Mode {
    pub fn as_str(&self) -> &'static str {
        match self {
            Mode::Ro => "ro",
            Mode::Ephemeral => "ephemeral",
            Mode::Rw => "rw",
        }
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How an `--ephemeral` mount is made: overlayfs over the shared mount, or, for images
/// overlayfs would show differently (`verify::structure::OverlayView`), a btrfs sprout of
/// its own device instances onto a file in the mount's state dir (deleted at umount).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Ephemeral {
    Overlay,
    Sprout,
}

impl Ephemeral {
    pub fn as_str(&self) -> &'static str {
        match self {
            Ephemeral::Overlay => "overlay",
            Ephemeral::Sprout => "sprout",
        }
    }
}

/// Where a mount (or a bundle's shared mount) is: "mounting" until it is up, then "mounted".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    #[default]
    Mounting,
    Mounted,
}

impl Phase {
    pub fn as_str(&self) -> &'static str {
        match self {
            Phase::Mounting => "mounting",
            Phase::Mounted => "mounted",
        }
    }
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn j<T: serde::Serialize>(v: &T) -> String {
        serde_json::to_string(v).unwrap()
    }

    #[test]
    fn serde_forms_are_the_state_files_strings() {
        assert_eq!(j(&Frontend::Ublk), "\"ublk\"");
        assert_eq!(j(&Frontend::Fuse), "\"fuse\"");
        assert_eq!(j(&Dev2Cache::Page), "\"page\"");
        assert_eq!(j(&Dev2Cache::Direct), "\"direct\"");
        assert_eq!(j(&Dev2Cache::Passthrough), "\"passthrough\"");
        assert_eq!(j(&Mode::Ro), "\"ro\"");
        assert_eq!(j(&Mode::Ephemeral), "\"ephemeral\"");
        assert_eq!(j(&Mode::Rw), "\"rw\"");
        assert_eq!(j(&Phase::Mounting), "\"mounting\"");
        assert_eq!(j(&Phase::Mounted), "\"mounted\"");
        for e in [Ephemeral::Overlay, Ephemeral::Sprout] {
            assert_eq!(j(&e), format!("\"{}\"", e.as_str()));
        }
        for m in [Mode::Ro, Mode::Ephemeral, Mode::Rw] {
            assert_eq!(serde_json::from_str::<Mode>(&j(&m)).unwrap(), m);
            assert_eq!(j(&m), format!("\"{m}\""));
        }
        for p in [Phase::Mounting, Phase::Mounted] {
            assert_eq!(j(&p), format!("\"{p}\""));
        }
    }
}
