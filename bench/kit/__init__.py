"""The device kit: one command turns a lent GPU machine's minutes into the whole GPU verdict
(`scripts/device_run.py`; docs/PERFORMANCE.md, "How to run the GPU check").

    plan      the parts in order of value, their shares of the budget, the presets' sizes (no torch)
    runner    runs each part in its own process with its own budget and a hard timeout (killed on
              overrun), then summary.json, the one-screen table and kit.log
    part      what a part's process shares: arguments, deadline, its JSON written as it grows
    smoke     1: environment (GPU, driver, torch, clocks) and the tiny correctness smoke
              (scripts/gpu_check.py: side-stream installs against inline, graphs against eager)
    sweep     2: the engine sweep at the preset's size, bf16, graphs on; the reference's batch-1 figure
    graphs    3: graphs off against on at the same points; fp32 at two concurrencies
    churn     4: shared and distinct voices, delayed installs, inline preparations, cancellations and
              evictions interleaved; each surviving job against its decode alone; memory after warm-up
    overlap   5: CUDA-event timing of an install on the side stream against a concurrent decode step
    compile   6: torch.compile of the DiT under the graphs, if budget remains
    wheels    what travels as wheels, and the image's packages (the clean-venv test)

On a CPU (`--device cpu --preset tiny`, the rehearsal the test suite runs) every part runs its code; what
only CUDA has (graph capture, streams, events) is recorded as "not applicable on cpu".
"""
