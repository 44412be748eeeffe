from vramwatch.cli import main

raise SystemExit(main())
