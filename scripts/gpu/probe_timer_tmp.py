import torch, triton, triton.language as tl
from triton.language.extra.cuda import globaltimer
@triton.jit
def ticks(out_ptr, N: tl.constexpr):
    last = globaltimer()
    for i in range(N):
        now = globaltimer()
        while now == last:
            now = globaltimer()
        tl.store(out_ptr + i, now - last)
        last = now
o = torch.zeros(64, dtype=torch.int64, device="cuda")
ticks[(1,)](o, N=64); torch.cuda.synchronize()
print("globaltimer steps (ns):", sorted(set(o.tolist()))[:10], "median", o.median().item())
