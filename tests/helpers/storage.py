"""Memory read from the storages tensors really hold, not from a strategy's own bookkeeping.

A strategy's ledger says what it believes it holds; a bug that drops an entry from the ledger but keeps
the tensor (ZeRO-3 "freeing" a gathered block without releasing its storage) fools every test that
reads the ledger. Here every live tensor the interpreter knows (the garbage collector tracks them all),
plus each parameter and its `.grad`, is resolved to its storage, and the storages' bytes are summed,
each storage once. Storages are sorted into the model's parameters (what `model.parameters()` point
into, and the shard the strategy keeps), the optimizer's state, and everything else: gradient buffers
and shards, the batch, and the activations Python holds.

On CPU that is the only honest reading there is: the CPU allocator keeps no statistics, and
torch.profiler's memory records on CPU show frees but not the allocations. Tensors held only inside
C++ (autograd's saved activations, a collective's scratch space) are not seen; parameters and
gradients, the memory the ZeRO stages exist to shard, are all Python tensors.

`gc.freeze()` before the trainer is built keeps the interpreter's import-time objects out of the walk
(a census is ~50 ms otherwise).
"""
from __future__ import annotations

import gc

import torch
from torch.utils._pytree import tree_leaves

from minitrain.parallel.core.units import module_units


def _storage_bytes(tensors) -> dict[int, int]:
    """data_ptr -> bytes of each distinct non-empty storage among `tensors`."""
    out = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes():
            out[storage.data_ptr()] = storage.nbytes()
    return out


def census(trainer, where: str) -> dict:
    """Bytes held right now by the trainer's parameters, its optimizer's state, the activations Python
    holds (tensors in an autograd graph) and everything else: gradients, gradient buffers and shards,
    the batch, collective scratch tensors. Each storage counts once, in the first of those it belongs to."""
    strategy = trainer.strategy
    params = list(trainer.model.parameters())
    live = [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)] + [p.grad for p in params
                                                                                  if p.grad is not None]
    kinds = {"params": _storage_bytes(params + [strategy.held_params()]),
             "optimizer": _storage_bytes(strategy.optimizer.held_tensors()),
             "model_buffers": _storage_bytes(trainer.model.buffers()),
             "activations": _storage_bytes([t for t in live if t.requires_grad]),
             "grads_and_other": _storage_bytes(live)}
    out, counted = {"where": where}, set()
    for kind, storages in kinds.items():
        out[kind] = sum(n for ptr, n in storages.items() if ptr not in counted)
        counted |= storages.keys()
    return out


def sampled_step(trainer) -> list[dict]:
    """One training step with a census before and after it and at every unit's boundaries: before and
    after each unit's forward (after the strategy's own hooks, so a block is seen gathered and then
    freed), and when backward reaches each unit's output (after the strategy's gather for backward)."""
    samples = []
    model = trainer.model
    watched = [("model", model)] + [(plan.name, plan.module) for plan in module_units(model) if plan.module is not None]

    def backward_hook(name):
        return lambda _grad: samples.append(census(trainer, f"backward reaches {name}"))

    def after_forward(_module, _args, output, name):
        samples.append(census(trainer, f"after forward {name}"))
        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(backward_hook(name))

    handles = []
    for name, module in watched:
        handles.append(module.register_forward_pre_hook(
            lambda _m, _a, name=name: samples.append(census(trainer, f"before forward {name}"))))
        handles.append(module.register_forward_hook(lambda m, a, out, name=name: after_forward(m, a, out, name)))
    samples.append(census(trainer, "step start"))
    trainer.train_step()
    samples.append(census(trainer, "step end"))
    for handle in handles:
        handle.remove()
    return samples
