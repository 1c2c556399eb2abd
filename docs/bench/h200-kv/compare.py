"""GPU check: the new flow (lean cache, batched encoder) against the old one (af2d197) on the same rows."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1])); sys.path.insert(0, str(Path(__file__).resolve().parent))
import os

from measure import old_module

from gpu_worker.checkpoint.load import load_dummy
from gpu_worker.model.config import ModelArgs
from gpu_worker.model.flow import trim_cache

dev = torch.device(os.environ.get("DEV", "cuda"))
if os.environ.get("NO_TF32"):
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
args = ModelArgs.preset(os.environ.get("PRESET", "full"))
flow = load_dummy(args, seed=0, device=dev).flow
mod = old_module(); old = mod.Flow(args.flow); old.load_state_dict(flow.state_dict(), assign=True); old.eval()
gen = torch.Generator().manual_seed(3)
B = 12
with torch.inference_mode():
    voices = []
    for v in range(3):
        n = 150 - 20 * v  # different prompt lengths: 300, 260, 220 frames
        tok = torch.cat([torch.randint(0, 6561, (1, n), generator=gen), torch.full((1, 3), 4218)], 1).to(dev)
        voices.append(flow.setup(tok, (torch.randn(1, 2 * n, 80, generator=gen) - 4).to(dev),
                                 torch.randn(1, 192, generator=gen).to(dev), torch.randn(1, 80, 30000, generator=gen).to(dev)))
    new_c = [voices[i % 3][1] for i in range(B)]
    old_c = [mod.FlowCache(c.conformer_cnn, c.conformer_att, c.estimator_cnn, c.estimator_att) for c in new_c]
    plen = [voices[i % 3][1].estimator_att.size(4) for i in range(B)]
    spk = torch.cat([voices[i % 3][0] for i in range(B)])
    noise = [torch.randn(1, 80, 2000, generator=gen).to(dev) for _ in range(B)]
    worst = 0.0
    for step in range(9):
        rows = [i for i in range(B) if i % 4 <= step]  # staggered starts: mixed cache lengths
        lens = [28 if (step + i) % 5 else 17 for i in rows]  # some short (last-like) chunks
        last = [(step + i) % 5 == 0 for i in rows]
        toks = [torch.randint(0, 6561, (1, n), generator=gen).to(dev) for n in lens]
        a, na, ca = flow.stream_chunks(toks, spk[rows], [new_c[i] for i in rows], last, [noise[i] for i in rows])
        b, nb, cb = old.stream_chunks(toks, spk[rows], [old_c[i] for i in rows], last, [noise[i] for i in rows])
        assert na == nb
        d = (a - b).abs().max().item()
        de = max((x.reference_estimator_att() - y.estimator_att).abs().max().item() for x, y in zip(ca, cb))
        worst = max(worst, d, de)
        for j, i in enumerate(rows):
            new_c[i] = trim_cache(ca[j], plen[i]); old_c[i] = mod.trim_cache(cb[j], plen[i])
        print(f"step {step}: rows {len(rows)} mel max diff {d:.2e} est cache max diff {de:.2e} "
              f"cache lens {sorted({c.offset for c in new_c})}", flush=True)
        # 'last' chunks end a stream in real use; here the stream goes on (the flow allows it)
    print("WORST", f"{worst:.2e}")
