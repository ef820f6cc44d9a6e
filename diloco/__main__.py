from diloco.cli import main

raise SystemExit(main())
