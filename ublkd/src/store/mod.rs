//! Stores: where a bundle's bytes come from. Local bundle directories ([`local`]: the
//! checked manifest, meta.img and blockmap; [`source::LocalPacks`]), remote bundles
//! ([`remote`]: http(s) and OCI registries, fetched into an image directory) and the
//! persistent chunk cache of remote images ([`cache`]).

pub mod cache;
pub mod local;
pub mod remote;
pub mod source;
