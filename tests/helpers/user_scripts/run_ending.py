"""A short run of a user's own script that ends as scripts end: `destroy_process_group()` without minitrain's
cleanup() (a DDP script's last line), cleanup() twice, or sys.exit(3) between a backward and its step. Run under
torchrun's environment; the mode is the first argument and the ZeRO stage the second, or with `each` both are
drawn in turn from the run's number (tests/helpers/zygote.py sets ZYGOTE_RUN). tests/system/test_exits.py runs it many
times over.

Last, after minitrain's own exit handler, it says on stderr how many of gloo's work threads (a process group's) are
still alive: one that lives into the interpreter's shutdown can abort the process there ("terminate called without
an active exception": a finished collective's destructor, run on that thread, needs the interpreter that is going
away)."""
import atexit
import functools
import os
import sys

import torch
import torch.distributed as dist

import minitrain


def gloo_threads_left() -> None:
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    print(f"gloo threads alive at exit: {sum(name.startswith('pt_gloo') for name in names)}", file=sys.stderr,
          flush=True)


atexit.register(gloo_threads_left)  # before minitrain's (init_distributed's), so it runs after it
MODES = ("destroy", "cleanup-twice", "exit-mid-step")
run = int(os.environ.get("ZYGOTE_RUN", "0"))
mode = MODES[run % len(MODES)] if sys.argv[1] == "each" else sys.argv[1]
zero = run % 4 if sys.argv[1] == "each" else int(sys.argv[2])
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
model, optimizer = minitrain.prepare(model, functools.partial(torch.optim.AdamW, lr=1e-2), zero=zero)
for step in range(3):
    model(torch.randn(4, 8)).square().mean().backward()
    if mode == "exit-mid-step" and step == 2:
        sys.exit(3)  # a backward's gradients synced (or on their way, at ZeRO-2/3), its step not taken
    optimizer.step()
    optimizer.zero_grad()
if mode == "destroy":
    dist.destroy_process_group()
elif mode == "cleanup-twice":
    minitrain.cleanup()
    minitrain.cleanup()
