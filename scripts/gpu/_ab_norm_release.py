"""Experiment: row 3's step with the residual add + RMS norm kernel releasing the next launch before
it waits (the input GEMV / router after it resident while the launch before the norm still runs)."""
import statistics, sys
from pathlib import Path
import torch
sys.path.insert(0, str(Path("scripts/gpu").resolve()))
from ling_flash import build_row3, cuda_device
from impl.gpu_timing import interleaved_replay_us
from impl.graphs import capture_graph
from impl.model import add_rms_norm
from impl.model.kda import KDAAttention

VARIANTS = {"committed": False, "norm-early": True}
dev = cuda_device()
model = build_row3(dev)
token = torch.ones(1, 1, dtype=torch.long, device=dev)
kda_layers = [m for m in model.modules() if isinstance(m, KDAAttention)]
rows = []
for ctx in [int(c) for c in sys.argv[1].split(",")]:
    model.setup_caches(1, ctx + 16)
    pos = torch.tensor([ctx], device=dev)
    graphs, outs = {}, {}
    with torch.inference_mode():
        for name, early in VARIANTS.items():
            add_rms_norm.EARLY_RELEASE = early
            holder = {}
            graphs[name] = capture_graph([lambda: holder.__setitem__("y", model(token, pos))])
            for _ in range(3):
                for m in kda_layers:
                    m.reset_state()
                graphs[name].replay()
                torch.cuda.synchronize()
                y = holder["y"].clone()
                if name in outs and not torch.equal(y, outs[name]):
                    print(f"context {ctx} {name}: replays differ", flush=True)
                outs[name] = y
    for name, y in outs.items():
        print(f"context {ctx} {name}: logits equal to committed's: {torch.equal(y, outs['committed'])}", flush=True)
    samples = interleaved_replay_us(graphs, rounds=9)
    for name, s in samples.items():
        r = [a / b for a, b in zip(s, samples["committed"])]
        rows.append((ctx, name, statistics.median(s), statistics.median(r), min(r), max(r)))
        print("| %d | %s | %.1f | %.4f | %.4f | %.4f |" % rows[-1], flush=True)
print("| context | variant | step us | x committed (median) | min | max |")
for r in rows:
    print("| %d | %s | %.1f | %.4f | %.4f | %.4f |" % r)
