from gpu_worker.bench import main

raise SystemExit(main())
