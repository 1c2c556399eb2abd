"""Old (af2d197 flow.py: gather/scatter/cat) vs new (lean KV cache) streaming flow: memory and frames/s.

    python .kvbench/measure.py --impl new --batch 8 --chunks 2 [--device cuda] [--preset full]

One process per (impl, batch) on the CPU so VmHWM is that configuration's peak. Streams: `batch` rows
over 2 voices (6 s prompts: 150 tokens, 300 frames), warmed 2 chunks (cache at 400 frames), then
`chunks` timed chunks of 25 + 3 tokens (50 frames per row) through stream_chunks + trim_cache.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_worker.checkpoint.load import load_dummy  # noqa: E402
from gpu_worker.model.config import ModelArgs  # noqa: E402
from gpu_worker.model.flow import FlowCache, trim_cache  # noqa: E402


def rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    return 0


def old_module():
    spec = importlib.util.spec_from_file_location("old_flow", Path(__file__).with_name("old_flow.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["old_flow"] = mod
    spec.loader.exec_module(mod)
    return mod


def tensor_bytes(cache) -> int:
    if hasattr(cache, "stream_nbytes"):
        return cache.stream_nbytes()
    return sum(t.numel() * t.element_size() for t in
               (cache.conformer_cnn, cache.conformer_att, cache.estimator_cnn, cache.estimator_att) if t is not None)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def run(impl: str, batch: int, chunks: int, device: torch.device, preset: str, dtype, flow=None, voices=None,
        sync_debug: bool = False, profile_dir=None) -> dict:
    args = ModelArgs.preset(preset)
    if flow is None:
        flow = load_dummy(args, seed=0, device=device, dtype=dtype).flow
    if impl == "old":
        mod = old_module()
        old = mod.Flow(args.flow)
        old.load_state_dict(flow.state_dict(), assign=True)
        run_flow, cache_cls, trim = old.eval(), mod.FlowCache, mod.trim_cache
    else:
        run_flow, cache_cls, trim = flow, FlowCache, trim_cache
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        if voices is None:
            voices = []
            for v in range(2):
                tokens = torch.randint(0, 6561, (1, 150), generator=gen)
                tokens = torch.cat([tokens, torch.full((1, 3), 4218)], dim=1).to(device)
                mel = (torch.randn(1, 300, 80, generator=gen) - 4).to(device, dtype)
                spk_raw = torch.randn(1, 192, generator=gen).to(device, dtype)
                noise = torch.randn(1, 80, 30000, generator=gen).to(device, dtype)
                voices.append(flow.setup(tokens, mel, spk_raw, noise))
        prompt_len = voices[0][1].estimator_att.size(4)
        caches = [cache_cls(conformer_cnn=voices[i % 2][1].conformer_cnn, conformer_att=voices[i % 2][1].conformer_att,
                            estimator_cnn=voices[i % 2][1].estimator_cnn, estimator_att=voices[i % 2][1].estimator_att)
                  for i in range(batch)]
        spk = torch.cat([voices[i % 2][0] for i in range(batch)])
        noise = [torch.randn(1, 80, 1000, generator=gen).to(device, dtype) for _ in range(batch)]
        sync(device)
        base_rss = rss_kb("VmRSS")
        if device.type == "cuda":
            torch.cuda.empty_cache()
            base_alloc = torch.cuda.memory_allocated()
        times, frames, n_syncs = [], 0, 0
        for step in range(2 + chunks):
            tokens = [torch.randint(0, 6561, (1, 28), generator=gen).to(device) for _ in range(batch)]
            if device.type == "cuda" and step == 2:
                torch.cuda.reset_peak_memory_stats()
            sync(device)
            t0 = time.perf_counter()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if sync_debug and step == 2:
                    torch.cuda.set_sync_debug_mode("warn")
                mel, n_frames, new = run_flow.stream_chunks(tokens, spk, caches, [False] * batch, noise)
                caches = [trim(c, prompt_len) for c in new]
                if sync_debug and step == 2:
                    torch.cuda.set_sync_debug_mode(0)
                    n_syncs = sum("synchroniz" in str(w.message) for w in caught)
                    sync_msgs = sorted({str(w.message)[:160] + " @" + Path(w.filename).name + ":" + str(w.lineno)
                                        for w in caught})
            sync(device)
            if step >= 2:
                times.append(time.perf_counter() - t0)
                frames += sum(n_frames)
            del mel, new
        # breakdown of one more chunk: encoder, solve, trim (each synced)
        tokens = [torch.randint(0, 6561, (1, 28), generator=gen).to(device) for _ in range(batch)]
        sync(device)
        t0 = time.perf_counter()
        if impl == "new":
            mu, enc = run_flow.encode_chunks(tokens, caches, [False] * batch)
        else:
            pairs = [run_flow.encode_chunk(t, c, False) for t, c in zip(tokens, caches, strict=True)]
            mu, enc = [m for m, _ in pairs], [c for _, c in pairs]
        sync(device)
        t1 = time.perf_counter()
        _, new = run_flow.solve_chunk_batch(mu, spk, noise, enc)
        sync(device)
        t2 = time.perf_counter()
        caches = [trim(c, prompt_len) for c in new]
        sync(device)
        t3 = time.perf_counter()
        breakdown = {"encode": round(t1 - t0, 4), "solve": round(t2 - t1, 4), "trim": round(t3 - t2, 4)}
        if profile_dir is not None:
            tokens = [torch.randint(0, 6561, (1, 28), generator=gen).to(device) for _ in range(batch)]
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                _, _, new = run_flow.stream_chunks(tokens, spk, caches, [False] * batch, noise)
                caches = [trim(c, prompt_len) for c in new]
                sync(device)
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
            Path(profile_dir, f"prof_{impl}_{batch}.txt").write_text(table)
        enc_times = []
        for _ in range(3):
            sync(device)
            t0 = time.perf_counter()
            for tok, c in zip(tokens, caches, strict=True):
                run_flow.encode_chunk(tok, c, False)
            sync(device)
            enc_times.append(time.perf_counter() - t0)
        out = {"impl": impl, "per_row_encode_s": round(min(enc_times), 4), "breakdown_s": breakdown, "batch": batch, "device": str(device), "dtype": str(dtype), "preset": preset,
               "chunk_s": [round(t, 4) for t in times], "fps": round(frames / sum(times), 1),
               "cache_frames": caches[0].offset,
               "stream_bytes": tensor_bytes(caches[0]),
               "stream_estimator_att_bytes": (caches[0].estimator_kv.own_nbytes() if impl == "new"
                                              else caches[0].estimator_att.numel() * 4),
               "voice_bytes": voices[0][1].estimator_att.numel() * voices[0][1].estimator_att.element_size()}
        if device.type == "cuda":
            out["peak_alloc_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
            out["steady_alloc_over_base_gb"] = round((torch.cuda.memory_allocated() - base_alloc) / 2**30, 3)
            out["peak_over_base_gb"] = round((torch.cuda.max_memory_allocated() - base_alloc) / 2**30, 3)
            if sync_debug:
                out["syncs_in_one_chunk"] = n_syncs
                out["sync_sites"] = sync_msgs
        else:
            out["peak_rss_gb"] = round(rss_kb("VmHWM") / 2**20, 3)
            out["rss_before_streams_gb"] = round(base_rss / 2**20, 3)
            out["rss_now_gb"] = round(rss_kb("VmRSS") / 2**20, 3)
        return out, flow, voices


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--impl", default="new")
    p.add_argument("--batch", default="1")
    p.add_argument("--chunks", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--preset", default="full")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--sync-debug", action="store_true")
    p.add_argument("--flush-denormal", action="store_true")
    p.add_argument("--profile-dir", default=None)
    a = p.parse_args()
    if a.flush_denormal:
        torch.set_flush_denormal(True)
    if a.threads:
        torch.set_num_threads(a.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    device = torch.device(a.device)
    flow = voices = None
    for impl in a.impl.split(","):
        for b in [int(x) for x in a.batch.split(",")]:
            res, flow, voices = run(impl, b, a.chunks, device, a.preset, dtype, flow, voices, a.sync_debug,
                                    a.profile_dir)
            print(json.dumps(res), flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
