"""btrfs-ublk-image: build btrfs seed images whose data is served lazily.

Pipeline (one module each, in the order a byte travels):
  spec.py    -> the YAML spec, validated (pydantic models; also its JSON schema)
  sources/   -> tar / files (/ oci / dir) layers streamed into one merged tree
  tree.py    -> the merged tree: Inode objects, content as Blob (in a pack), inline bytes or
             Sparse (a file with holes: Blobs at file offsets)
  packs.py   -> pack files: deduplicated file content, content-addressed
  btrfs/     -> the btrfs writer: device 1 (meta.img) and device 2's layout
  blockmap.py-> device 2 offsets -> pack ranges, plus per-chunk digests
  bundle.py  -> manifest.json, atomic bundle directory
"""

__version__ = "0.1.0"
