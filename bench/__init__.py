"""wavefarm's tools, apart from the product: the engine benchmark (engine) and the device kit (kit)
that a lent GPU machine runs. The product packages (app, tasks, gpu_worker) import nothing from here."""
