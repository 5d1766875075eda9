from codraft.cli import main

raise SystemExit(main())
