"""The btrfs writer: on-disk structures, trees, chunks, superblocks."""
