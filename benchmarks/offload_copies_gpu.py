"""Where an offloaded optimizer step's time goes on a GPU machine, for gpt2-124m's 124M parameters: the bf16
gradient's copy to host memory (pinned, and fresh pageable as `.cpu()` makes it), the host's fused AdamW over the
float32 master and state (16, 8 and 4 threads), and the master's copy back (as float32 into a device buffer, and
converted to bf16 by one `copy_`). Medians of 5, after a warm-up. It prints; the step's own figures are
benchmarks/gpu.py's (offload rows).

    python benchmarks/offload_copies_gpu.py

Needs a CUDA device; exits 2 without one.
"""
import statistics
import sys
import time

import torch

if not torch.cuda.is_available():
    print("benchmarks/offload_copies_gpu.py: error: no CUDA device here", file=sys.stderr)
    sys.exit(2)
n = 124_475_904
torch.set_num_threads(16)
dev = torch.device("cuda")
grad_dev = torch.randn(n, device=dev).to(torch.bfloat16)
params_dev = torch.empty(n, device=dev, dtype=torch.bfloat16)
params_dev32 = torch.empty(n, device=dev, dtype=torch.float32)
pinned_bf16 = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
master = torch.randn(n, pin_memory=True)
m, v = torch.zeros(n, pin_memory=True), torch.zeros(n, pin_memory=True)
steps = [torch.zeros(()) for _ in range(8)]
chunk = 1 << 24


def timed(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return 1000 * statistics.median(out)


def adam():
    from torch.optim.adamw import adamw
    for i, a in enumerate(range(0, n, chunk)):
        b = min(a + chunk, n)
        g = pinned_bf16[a:b].float()
        adamw([master[a:b]], [g], [m[a:b]], [v[a:b]], [], [steps[i]], amsgrad=False, beta1=0.9, beta2=0.95,
              lr=1e-4, weight_decay=0.1, eps=1e-8, maximize=False, fused=True)


print(f"threads {torch.get_num_threads()}")
print(f"D2H bf16 gradient -> pinned: {timed(lambda: pinned_bf16.copy_(grad_dev)):.1f} ms")
print(f"D2H bf16 gradient -> pageable .cpu(): {timed(lambda: grad_dev.cpu()):.1f} ms")
print(f"host fused AdamW, 16M-element chunks (upcast included): {timed(adam):.1f} ms")
print(f"H2D float32 master -> device float32: {timed(lambda: params_dev32.copy_(master)):.1f} ms")
print(f"H2D float32 master -> device bf16 (copy_): {timed(lambda: params_dev.copy_(master)):.1f} ms")
print(f"host round to bf16, then H2D: {timed(lambda: params_dev.copy_(master.to(torch.bfloat16))):.1f} ms")
for threads in (4, 8):
    torch.set_num_threads(threads)
    print(f"host fused AdamW with {threads} threads: {timed(adam):.1f} ms")
