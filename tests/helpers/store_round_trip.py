"""The Python API's round trip through object storage, as a user's script runs it: `python store_round_trip.py URL`
(under torchrun for several ranks). tests/checkpoint/test_object_store.py imports its pieces for the one-process
case."""
import functools
import sys

import torch

import minitrain

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)


def prepared(zero: int):
    torch.manual_seed(0)
    return minitrain.prepare(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)),
                             ADAMW, zero=zero)


def steps(model, opt, n: int, rank: int = 0) -> None:
    for i in range(n):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * i + rank))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def round_trip(url: str, zero: int, rank: int = 0) -> tuple:
    """Two steps, a save to URL, two more; a fresh model loaded from URL/step-000002 and stepped alike. Returns
    (what save_checkpoint returned, what load_checkpoint returned, whether the two ended equal)."""
    model, opt = prepared(zero)
    steps(model, opt, 2, rank)
    saved = minitrain.save_checkpoint(url, model, opt, 2, extra={"epoch": 1})
    steps(model, opt, 2, rank)
    again, again_opt = prepared(zero)
    loaded = minitrain.load_checkpoint(f"{url}/step-000002", again, again_opt)
    steps(again, again_opt, 2, rank)
    a, b = minitrain.full_state_dict(model), minitrain.full_state_dict(again)
    return saved, loaded, all(torch.equal(a[k], b[k]) for k in a)


if __name__ == "__main__":
    minitrain.init_distributed()
    saved, loaded, same = round_trip(sys.argv[1], zero=2, rank=torch.distributed.get_rank())
    assert loaded == (2, {"epoch": 1}) and same, (loaded, same)
    if minitrain.is_main_process():
        print(f"saved {saved}; same after the round trip")
