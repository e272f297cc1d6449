//! meta.img's *block form* and its inverse (docs/bundle-format.md, "The block form"): what
//! a delta build's meta.img patch is made between, and what a pull applies it to. The
//! transform is ublkd's (`ublkd/src/format/block_form.rs`, which ublkd's pulls use),
//! compiled into this crate as well, so that there is one implementation in Rust; patch.py's
//! `_block_form` is the reference and the path without the extension (`BUI_NATIVE=0`).

use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// The transform's checksum: ublkd's CRC-32C module (over the `crc32c` crate), compiled here too.
#[path = "../../ublkd/src/format/crc32c.rs"]
#[allow(dead_code)] // crc32c_update: ublkd's name hashes
mod crc32c;

#[path = "../../ublkd/src/format/block_form.rs"]
mod form;

/// patch.py `block_form` (`inverse`: `from_block_form`): the same bytes, made in place in
/// the new bytes object.
#[pyfunction]
pub fn block_form<'py>(py: Python<'py>, img: &[u8], inverse: bool) -> PyResult<Bound<'py, PyBytes>> {
    PyBytes::new_with(py, img.len(), |out| {
        out.copy_from_slice(img);
        form::transform(out, inverse);
        Ok(())
    })
}
