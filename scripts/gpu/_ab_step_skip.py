"""Experiment: row 3's step with MLA's combine (or attention + combine) left out, interleaved."""
import statistics, sys
from pathlib import Path
import torch
sys.path.insert(0, str(Path("scripts/gpu").resolve()))
from ling_flash import build_row3, cuda_device
from impl.gpu_timing import interleaved_replay_us
from impl.graphs import capture_graph
from impl.generate import greedy_step_at
from impl.model import mla_decode

dev = cuda_device()
model = build_row3(dev)
token = torch.ones(1, 1, dtype=torch.long, device=dev)
rows = []
for ctx in (1024, 8192, 32768):
    model.setup_caches(1, ctx + 16)
    pos = torch.tensor([ctx], device=dev)
    graphs = {}
    with torch.inference_mode():
        for name in ("full", "combine", "attention+combine"):
            mla_decode.SKIP = name if name != "full" else ""
            mla_decode._PERSIST.clear()
            graphs[name] = capture_graph([lambda: greedy_step_at(model, token, pos)])
    samples = interleaved_replay_us(graphs, rounds=7)
    for name, s in samples.items():
        d = [a - b for a, b in zip(s, samples["full"])]
        rows.append((ctx, name, statistics.median(s), statistics.median(d) / 7))
print("| context | variant | step us | (variant - full) / 7 MLA layers, us |")
for r in rows:
    print("| %d | %s | %.1f | %.2f |" % r)
