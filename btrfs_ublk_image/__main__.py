from btrfs_ublk_image.cli import main

raise SystemExit(main())
