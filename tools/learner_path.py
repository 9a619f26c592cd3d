"""The learner's path: which of minitrain's files one training step runs through, strategy by strategy.

For each strategy, 2 ranks (gloo, CPU) train a tiny MiniGPT the way a user's loop does: init_distributed,
prepare(model, optimizer, zero=/tp=/pp=/ep=...), one warm-up step, then one traced step (forward,
loss.backward(), optimizer.step(), optimizer.zero_grad(); a pipeline's forward and backward are one
minitrain.pipeline_step). Rank 0 traces that step with sys.settrace, counting only code under src/minitrain/
except src/minitrain/models/ (the model is the user's, not the framework). Files are found from the trace,
never named here, so the figures follow any reorganisation of the tree.

- files: the minitrain files the step executes code in; lines: those files' total length (what a reader
  must open), and the distinct lines executed;
- cross-file calls: distinct (caller function, callee function) pairs in different minitrain files. A call
  made through torch or the standard library (a module's __call__, a hook torch runs inside a minitrain
  call, a context manager) counts as made by the nearest minitrain function below it; a hook torch runs
  for the user's code or the model (autograd's, a module's forward hooks) has no minitrain caller.

    .venv/bin/python tools/learner_path.py             # every strategy; writes benchmarks/results/learner_path.json
                                                      # (then python benchmarks/tables.py renews docs/layout.md)
    .venv/bin/python tools/learner_path.py --verbose   # and each strategy's files: path, lines, lines executed
    .venv/bin/python tools/learner_path.py ddp tp      # some strategies only (no JSON written)

A strategy that fails is reported with its error; the others still run. Only rank 0's main thread is
traced (on CPU autograd runs the backward, and minitrain's hooks, in that thread).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import minitrain
from minitrain.runtime.launch import RankFailedError, launch

ROOT = Path(__file__).resolve().parent.parent
SRC = Path(minitrain.__file__).resolve().parent
RESULT = ROOT / "benchmarks" / "results" / "learner_path.json"
WORLD, BATCH = 2, 8  # ranks; the global batch, cut over the data-parallel replicas
MOE = {"moe_experts": 4, "moe_top_k": 2}
# name -> (label, prepare's arguments). "pp" and "ep" change the model too (build below).
STRATEGIES = {"ddp": ("bucketed DDP", {"zero": 0, "dp": "bucketed"}), "zero1": ("ZeRO-1", {"zero": 1}),
              "zero2": ("ZeRO-2", {"zero": 2}), "zero3": ("ZeRO-3", {"zero": 3}),
              "tp": ("tensor parallel (tp=2)", {"tp": 2}),
              "pp": ("1F1B pipeline (pp=2)", {"pp": 2, "microbatches": 2, "schedule": "1f1b"}),
              "ep": ("expert parallel (ep=2, MoE)", {"ep": 2})}
# The project's target for these: at most 6 files and 1,500 lines a reader must open.
TARGET = {"files": 6, "lines": 1500, "strategies": ["ddp", "zero1", "zero2", "zero3", "tp", "pp"]}
# picotron's figures for the same path (its files for that strategy, read in its repository); fixed reference.
PICOTRON = {"ddp": {"files": 4, "lines": 675, "calls": 9}, "tp": {"files": 5, "lines": 1023, "calls": 10},
            "pp": {"files": 5, "lines": 911, "calls": 8}}


class Pieces(nn.Module):
    """A user's MiniGPT laid out as pp_split wants it: pieces run one after another (MiniGPT's own forward adds
    the position embeddings inside it, so here one piece embeds tokens and positions)."""

    def __init__(self, gpt: nn.Module):
        super().__init__()
        self.embed, self.blocks, self.ln_f, self.head = Embed(gpt.tok_emb, gpt.pos_emb), gpt.blocks, gpt.ln_f, gpt.head

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.ln_f(x))


class Embed(nn.Module):
    def __init__(self, tok: nn.Embedding, pos: nn.Embedding):
        super().__init__()
        self.tok, self.pos = tok, pos

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build(name: str) -> tuple[nn.Module, dict, object]:
    """The user's model, prepare's arguments and the model's config for strategy `name`."""
    from minitrain.config import ModelConfig
    from minitrain.models.minigpt import MINIGPT_PLAN, MiniGPT

    cfg = ModelConfig(**(MOE if name == "ep" else {}))
    kwargs = dict(STRATEGIES[name][1])
    model = MiniGPT(cfg)
    if name == "tp":
        kwargs["plan"] = MINIGPT_PLAN  # MiniGPT's tensor-parallel plan
    if name == "pp":
        model = Pieces(model)
        probe = torch.arange(cfg.seq_len).remainder(cfg.vocab_size).unsqueeze(0)
        kwargs["pp_split"] = minitrain.PipelineSplit(["embed", "blocks", "ln_f", "head"], example=probe)
    return model, kwargs, cfg


class Trace:
    """What code one step runs in minitrain's own files (the model's left out), recorded by sys.settrace."""

    def __init__(self):
        self.lines: set[tuple[str, int]] = set()
        self.calls: set[tuple[str, str]] = set()
        self.kinds: dict[str, str] = {}  # co_filename -> "ours" | "user" | "library"
        self.user = {os.path.realpath(__file__), os.path.realpath(sys.argv[0])}

    def kind(self, filename: str) -> str:
        if filename not in self.kinds:
            path = os.path.realpath(filename)
            inside = path.startswith(f"{SRC}{os.sep}")
            model = path.startswith(f"{SRC / 'models'}{os.sep}")
            self.kinds[filename] = "user" if model or path in self.user else "ours" if inside else "library"
        return self.kinds[filename]

    def call(self, frame, event, arg):
        code = frame.f_code
        if self.kind(code.co_filename) != "ours":
            return None  # torch's, Python's, the model's and the user's code: no line events
        caller = frame.f_back
        while caller is not None and self.kind(caller.f_code.co_filename) == "library":
            caller = caller.f_back  # through torch and the standard library to whoever called them
        if caller is not None and self.kind(caller.f_code.co_filename) == "ours" \
                and caller.f_code.co_filename != code.co_filename:
            self.calls.add((_where(caller.f_code), _where(code)))
        return self.line

    def line(self, frame, event, arg):
        if event == "line":
            self.lines.add((frame.f_code.co_filename, frame.f_lineno))
        return self.line

    def result(self) -> dict:
        files = {}
        for filename in sorted({f for f, _ in self.lines}):
            path = Path(os.path.realpath(filename))
            executed = sum(1 for f, _ in self.lines if f == filename)
            files[path.relative_to(SRC.parent.parent).as_posix()] = [len(path.read_text().splitlines()), executed]
        return {"files": files, "calls": sorted(f"{a} -> {b}" for a, b in self.calls)}


def _where(code) -> str:
    return f"{Path(os.path.realpath(code.co_filename)).relative_to(SRC).as_posix()}:{code.co_qualname}"


def rank_main(topo, name: str) -> dict | None:
    minitrain.init_distributed(topology=topo)
    torch.manual_seed(0)
    model, kwargs, cfg = build(name)
    model, optimizer = minitrain.prepare(model, functools.partial(torch.optim.AdamW, lr=1e-3), **kwargs)
    rank, replicas = minitrain.dp_rank(), minitrain.dp_world_size()

    def step(n: int) -> None:
        tokens = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len + 1), generator=torch.Generator().manual_seed(n))
        mine = tokens.chunk(replicas)[rank]  # this replica's share of the global batch
        x, y = mine[:, :-1], mine[:, 1:]
        if name == "pp":
            minitrain.pipeline_step(model, x, y, next_token_loss)  # forward and backward, micro-batch by micro-batch
        else:
            loss = model(x, y)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    step(0)  # warm-up: what happens once (buffers made, shapes exchanged) is not the path of a step
    if topo.rank != 0:
        step(1)
        minitrain.cleanup()
        return None
    trace = Trace()
    sys.settrace(trace.call)
    try:
        step(1)
    finally:
        sys.settrace(None)
    minitrain.cleanup()
    return trace.result()


def measure(name: str) -> dict:
    """One strategy's figures, or its error in one line."""
    try:
        return launch(rank_main, WORLD, name, backend="gloo", pg_timeout_s=120, timeout_s=300)[0]
    except Exception as e:  # noqa: BLE001 - one strategy failing must not stop the others
        last = ([line.strip() for line in str(e).splitlines() if line.strip()] or [""])[-1]  # a traceback's end
        return {"error": (last if isinstance(e, RankFailedError) else f"{type(e).__name__}: {last}")[:300]}


def totals(entry: dict) -> tuple[int, int, int, int]:
    """(files, lines in them, lines executed, cross-file calls)."""
    files = entry["files"].values()
    return len(files), sum(n for n, _ in files), sum(e for _, e in files), len(entry["calls"])


def revision() -> str:
    """The commit measured, "-dirty" when the tracked files differ from it."""
    git = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True,
                         check=False)
    return git.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("strategies", nargs="*", metavar="STRATEGY",
                        help=f"some of {', '.join(STRATEGIES)} (default: all, and the JSON written)")
    parser.add_argument("--verbose", action="store_true", help="each strategy's files: path, lines, lines executed")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.strategies) - set(STRATEGIES))
    if unknown:
        parser.error(f"unknown strategy {', '.join(unknown)}; known: {', '.join(STRATEGIES)}")
    names = args.strategies or list(STRATEGIES)
    results = {}
    print("| strategy | files | lines | executed | cross-file calls | picotron (files, lines, calls) |")
    print("|---|---:|---:|---:|---:|---|")
    for name in names:
        label, settings = STRATEGIES[name]
        results[name] = {"label": label, "prepare": settings, **measure(name)}
        ref = PICOTRON.get(name)
        theirs = f"{ref['files']}, {ref['lines']:,}, ~{ref['calls']}" if ref else ""
        if "error" in results[name]:
            print(f"| {label} | failed: {results[name]['error']} | | | | {theirs} |", flush=True)
            continue
        files, lines, executed, calls = totals(results[name])
        print(f"| {label} | {files} | {lines:,} | {executed:,} | {calls} | {theirs} |", flush=True)
    if args.verbose:
        for name in names:
            if "files" in results[name]:
                print(f"\n{STRATEGIES[name][0]}:")
                for path, (lines, executed) in results[name]["files"].items():
                    print(f"  {path:<52} {lines:>5} lines {executed:>5} executed")
    if not args.strategies:
        body = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "revision": revision(), "world_size": WORLD,
                "backend": "gloo", "model": {"preset": "tiny", "ep": MOE}, "target": TARGET, "picotron": PICOTRON,
                "results": results}
        RESULT.write_text(json.dumps(body, indent=1) + "\n")
        print(f"\nwrote {RESULT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
