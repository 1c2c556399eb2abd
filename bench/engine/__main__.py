from bench.engine import main

raise SystemExit(main())
