//! On-disk formats (docs/bundle-format.md, docs/trace-format.md): what a bundle's files
//! are and how they are parsed; no I/O policy, no state.

pub mod block_form;
pub mod blockmap;
pub mod crc32c;
pub mod digest;
pub mod manifest;
pub mod trace;
