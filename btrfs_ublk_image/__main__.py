from btrfs_ublk_image.cli import run

run()
