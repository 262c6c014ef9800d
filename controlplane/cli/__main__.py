from controlplane.cli import main

raise SystemExit(main())
