from specdeploy.cli import main

raise SystemExit(main())
