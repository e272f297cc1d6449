"""Benchmarks of btrfs-ublk-image (run them with ``bench/run``; see docs/benchmarks.md)."""
