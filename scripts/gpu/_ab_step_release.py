"""Experiment: row 3's step with MLA's combine and output kernels and KDA's output kernel releasing
the next launch before they wait (so o_proj's GEMV starts during the attention), with o_proj tiles."""
import statistics, sys
from pathlib import Path
import torch
sys.path.insert(0, str(Path("scripts/gpu").resolve()))
from ling_flash import build_row3, cuda_device
from impl.gpu_timing import interleaved_replay_us
from impl.graphs import capture_graph
from impl.model import gemv, kda_decode, mla_absorb, mla_decode
from impl.model.kda import KDAAttention

O = (2560, 4096)
VARIANTS = {
    "committed": (False, False, None),
    "mla-early": (True, False, None),
    "kda-early": (False, True, None),
    "both-early": (True, True, None),
    "both-early-o2x4096w8": (True, True, gemv.GemvLaunch(2, 4096, 8)),
    "both-early-o4x4096w8": (True, True, gemv.GemvLaunch(4, 4096, 8)),
    "both-early-o8x2048w8": (True, True, gemv.GemvLaunch(8, 2048, 8)),
}
dev = cuda_device()
model = build_row3(dev)
token = torch.ones(1, 1, dtype=torch.long, device=dev)
kda_layers = [m for m in model.modules() if isinstance(m, KDAAttention)]
committed = dict(gemv.TUNED)
rows = []
for ctx in (1024, 8192, 32768):
    model.setup_caches(1, ctx + 16)
    pos = torch.tensor([ctx], device=dev)
    graphs, outs = {}, {}
    with torch.inference_mode():
        for name, (mla_e, kda_e, tile) in VARIANTS.items():
            mla_absorb.EARLY_RELEASE = mla_decode.EARLY_RELEASE = mla_e
            kda_decode.EARLY_RELEASE = kda_e
            gemv.TUNED.clear(); gemv.TUNED.update(committed)
            if tile is not None:
                gemv.TUNED[O] = tile
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
    samples = interleaved_replay_us(graphs, rounds=7)
    for name, s in samples.items():
        r = [a / b for a, b in zip(s, samples["committed"])]
        rows.append((ctx, name, statistics.median(s), statistics.median(r), min(r), max(r)))
print("| context | variant | step us | x committed (median) | min | max |")
for r in rows:
    print("| %d | %s | %.1f | %.4f | %.4f | %.4f |" % r)
