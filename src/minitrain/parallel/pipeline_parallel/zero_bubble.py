"""A backward in two parts, for the zero-bubble schedule (schedules.py): B, the gradient of the stage's input,
which the previous stage waits for, and W, the gradients of the weights, which nobody waits for.

Every module of the stage with parameters of its own (a linear layer, a norm, an embedding) has its forward
outputs noted, per micro-batch. B asks autograd for the gradients of the stage's input and of those outputs, and
nothing else: no parameter's gradient is computed, and the graph is kept. W then takes each module's output
gradient back to that module's own parameters only (the rest of the chain is B's work, done once), and
accumulates the micro-batch's weight gradients in one engine run, so the data-parallel sync hooks see every
parameter of the last micro-batch arrive together, as in an ordinary backward. The gradients are the ordinary
backward's: the same products of the same saved tensors.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


class SplitBackward:
    def __init__(self, module: nn.Module):
        self.owners = {m: [p for p in m.parameters(recurse=False) if p.requires_grad] for m in module.modules()}
        self.owners = {m: params for m, params in self.owners.items() if params}
        self._noting: list | None = None
        self.handles = [m.register_forward_hook(self._note) for m in self.owners]

    def _note(self, module: nn.Module, _args, output) -> None:
        if self._noting is not None:
            if not isinstance(output, torch.Tensor):
                raise TypeError(f"the zero-bubble schedule defers the weight gradients of {type(module).__name__}, "
                                "which returns no tensor; use the 1f1b schedule for this model")
            if output.requires_grad:
                self._noting.append((module, output))

    @contextlib.contextmanager
    def noting(self) -> Iterator[list]:
        """Within the block, the outputs of the modules with parameters, in call order, appended to the list."""
        noted: list = []
        self._noting = noted
        try:
            yield noted
        finally:
            self._noting = None

    @staticmethod
    def input_part(output: torch.Tensor, grad: torch.Tensor, stage_input: torch.Tensor | None,
                   noted: list) -> tuple[torch.Tensor | None, list]:
        """B: the stage input's gradient (None on the first stage) and each noted output's, the graph kept."""
        targets = ([stage_input] if stage_input is not None else []) + [out for _, out in noted]
        grads = torch.autograd.grad(output, targets, grad, retain_graph=True, allow_unused=True)
        return (grads[0] if stage_input is not None else None), list(grads[1 if stage_input is not None else 0:])

    def weight_part(self, noted: list, grads: list) -> None:
        """W: each module's parameters' gradients from its output's, accumulated in one engine run (a parameter used
        by several modules, or several times, gets their sum)."""
        total: dict[nn.Parameter, torch.Tensor] = {}
        for (module, out), grad in zip(noted, grads):
            if grad is None:
                continue
            params = self.owners[module]
            for p, g in zip(params, torch.autograd.grad(out, params, grad, retain_graph=True, allow_unused=True)):
                if g is not None:
                    total[p] = g if p not in total else total[p] + g
        if total:
            torch.autograd.backward(list(total), list(total.values()))
