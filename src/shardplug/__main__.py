from shardplug.cli import main

raise SystemExit(main())
