//! The one digest type: sha256, written `sha256:<64 hex>` (image ids, manifest file and
//! pack digests, OCI descriptors).

use anyhow::{ensure, Context, Result};
use sha2::{Digest as _, Sha256};

/// The prefix of a written digest.
pub const PREFIX: &str = "sha256:";

/// Lowercase hex of the sha256 of `data`.
pub fn sha256_hex(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

/// `s` without its `sha256:` prefix, if it has one (not checked further).
pub fn strip_prefix(s: &str) -> Option<&str> {
    s.strip_prefix(PREFIX)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Sha256Digest([u8; 32]);

impl Sha256Digest {
    /// The digest of `data`.
    pub fn of(data: &[u8]) -> Sha256Digest {
        Sha256Digest(Sha256::digest(data).into())
    }

    /// Exactly `sha256:<64 hex digits>` (either case).
    pub fn parse(s: &str) -> Result<Sha256Digest> {
        let hex = strip_prefix(s).with_context(|| format!("digest {s:?} does not start with sha256:"))?;
        ensure!(
            hex.len() == 64 && hex.bytes().all(|c| c.is_ascii_hexdigit()),
            "digest {s:?} is not 64 hex digits"
        );
        let mut b = [0u8; 32];
        hex::decode_to_slice(hex, &mut b).with_context(|| format!("digest {s:?} is not 64 hex digits"))?;
        Ok(Sha256Digest(b))
    }

    /// An id as users write it: `sha256:<hex>` or the bare hex.
    pub fn parse_id(s: &str) -> Result<Sha256Digest> {
        match strip_prefix(s) {
            Some(_) => Self::parse(s),
            None => Self::parse(&format!("{PREFIX}{s}")),
        }
    }

    /// The 64 lowercase hex digits, without the prefix.
    pub fn hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl std::fmt::Display for Sha256Digest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{PREFIX}{}", self.hex())
    }
}

impl std::str::FromStr for Sha256Digest {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        Self::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_the_prefixed_form() {
        let d = Sha256Digest::of(b"abc");
        assert_eq!(d.to_string(), format!("sha256:{}", sha256_hex(b"abc")));
        assert_eq!(Sha256Digest::parse(&d.to_string()).unwrap(), d);
        assert_eq!(
            Sha256Digest::parse(&d.to_string().to_uppercase().replace("SHA256", "sha256")).unwrap(),
            d
        );
        assert_eq!(Sha256Digest::parse_id(&d.hex()).unwrap(), d);
        let e = Sha256Digest::parse(&d.hex()).unwrap_err().to_string();
        assert!(e.contains("does not start with sha256:"), "{e}");
        let e = Sha256Digest::parse("sha256:ab").unwrap_err().to_string();
        assert!(e.contains("is not 64 hex digits"), "{e}");
        assert!(Sha256Digest::parse_id("xyz").is_err());
    }
}
