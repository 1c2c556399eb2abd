"""Acceleration, applied around the model at build time, never inside it (`gpu_worker.model` stays pure
modules): each piece wraps or re-dispatches a module with the same call signature and parameters.

    onednn     the DiT's float32 linears on a CPU through oneDNN, and its MLP's fc1 + tanh-GELU as one
               fused oneDNN kernel (`use_cpu_linear(model, "onednn" | "blas")`, WAVEFARM_CPU_LINEAR)
    tensorrt   CAM++ as a TensorRT engine built from its ONNX file, on CUDA (`on_tensorrt(campplus)`)
    graphs, flow_graphs   the vocoder and a decode step's flow as CUDA graphs (`graph_hift`, `graph_flow`),
               both runners built on `graph_base.GraphRunner` (capture, replay, fallbacks, stats)

The composition root (`gpu_worker.worker.runtime`) applies them; the benchmarks switch them to measure before
and after in one process.
"""
