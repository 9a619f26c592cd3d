"""Models nobody here wrote, doing what models do: exact (equal to plain single-process PyTorch in float64) or
refused with a reason, never silently wrong.

- ZeRO-3 with a parameter used outside its module's forward (an nn.ParameterList indexed by the parent, a tied
  head by direct weight access), a block returning a dataclass, a loss that calls submodules itself.
- Refusals that name what to change: a tensor-parallel plan replacing a module with a forward of its own, a
  pipeline split whose pieces do not compute what the model's forward does, an output ZeRO-3 cannot see into.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import minitrain
from minitrain.parallel.pipeline_parallel.split import PipelineSplit, check_pieces, check_split

from tests.helpers.dist import run_ranks
from tests.helpers.numerics import assert_bit_equal

pytestmark = pytest.mark.slow

V, D, T = 16, 8, 6
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
TOL = 1e-12


class ParameterListScales(nn.Module):
    """Per-block scales in an nn.ParameterList, indexed in the parent's forward (never its own forward)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(2))
        self.scales = nn.ParameterList(nn.Parameter(1 + 0.1 * torch.randn(D)) for _ in range(2))
        self.head = nn.Linear(D, V)

    def forward(self, x):
        h = self.emb(x)
        for block, scale in zip(self.blocks, self.scales):
            h = h + torch.tanh(block(h)) * scale
        return self.head(h)


class Body(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(2))

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return h


class DirectTiedHead(Body):
    """A head tied to the embedding by reading its weight directly: F.linear(h, self.emb.weight)."""

    def forward(self, x):
        return F.linear(super().forward(x), self.emb.weight)


@dataclass
class BlockOutput:
    hidden: torch.Tensor
    gate: torch.Tensor


class DataclassBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, D)
        self.gate = nn.Linear(D, 1)

    def forward(self, h):
        return BlockOutput(torch.tanh(self.proj(h)), torch.sigmoid(self.gate(h)))


class DataclassBlocks(nn.Module):
    """Blocks that return a dataclass of tensors."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(DataclassBlock() for _ in range(2))
        self.head = nn.Linear(D, V)

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            out = block(h)
            h = h + out.hidden * out.gate
        return self.head(h)


class TiedBodyAndHead(nn.Module):
    """Called piece by piece by the loss (loss_by_parts), never through forward; the head tied to the embedding."""

    def __init__(self):
        super().__init__()
        self.body = Body()
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.body.emb.weight

    def forward(self, x):
        return self.head(self.body(x))


MODELS = {"parameter_list": ParameterListScales, "direct_tie": DirectTiedHead, "dataclass": DataclassBlocks,
          "by_parts": TiedBodyAndHead}


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[kind]().double()


def loss_of(kind: str, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    logits = model.head(model.body(x)) if kind == "by_parts" else model(x)  # by_parts: the loss calls submodules
    return F.cross_entropy(logits[:, :-1].reshape(-1, V), x[:, 1:].reshape(-1))


def batches(steps: int = 3, batch: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, V, (batch, T), generator=g) for _ in range(steps)]


def plain(kind: str) -> tuple[list[float], dict]:
    model = build(kind)
    opt = ADAMW(model.parameters())
    losses = []
    for x in batches():
        loss = loss_of(kind, model, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _zero3_cases(topo, kinds):
    minitrain.init_distributed(topology=topo)
    out = {}
    for kind in kinds:
        for zero in (2, 3):
            model, opt = minitrain.prepare(build(kind), ADAMW, zero=zero)
            losses = []
            for x in batches():
                loss = loss_of(kind, model, x.chunk(topo.world_size)[topo.rank])
                loss.backward()
                opt.step()
                opt.zero_grad()
                total = torch.tensor([loss.item()], dtype=torch.float64)
                dist.all_reduce(total)
                losses.append(float(total) / topo.world_size)
            if zero == 3:
                out[(kind, "reads")] = _reads_between_steps(model)
            with torch.no_grad():  # an evaluation forward frees what it gathered
                loss_of(kind, model, batches(1)[0])
            out[(kind, zero)] = losses, minitrain.full_state_dict(model)
    return out


def _reads_between_steps(model) -> dict:
    """For each parameter: what describes it, and what each read of its values between steps raised."""
    seen = {}
    for name, p in model.named_parameters():
        reads = {"norm": lambda: p.norm(), "detach": lambda: p.detach().clone(), "print": lambda: print(p),
                 ".data": lambda: p.data, "arithmetic": lambda: p * 2, "a list of them": lambda: torch.cat([p, p]),
                 "a conversion": lambda: p.to(torch.float32), ".data =": lambda: setattr(p, "data", p.new_zeros(1))}
        said = {}
        for what, read in reads.items():
            try:
                read()
                said[what] = "read"
            except RuntimeError as e:
                said[what] = str(e)
        description = (str(p.dtype), p.device.type, p.requires_grad, p.grad, p.numel() == p.shape.numel() > 0)
        # What reads no value: the model moved where it is, a tensor shaped like the parameter.
        unread = (model.to(p.device) is model and model.double() is model, torch.zeros_like(p).shape == p.shape,
                  p.new_zeros(2).dtype == p.dtype)
        seen[name] = {"description": description, "values": said, "unread": unread}
    return seen


def _ported_ddp_loops(topo):
    """A loop written for DistributedDataParallel: it reads p.grad after backward and clips with torch's own
    clip_grad_norm_ on model.parameters(); at ZeRO-2/3 two backwards before one step."""
    out = {}
    for zero in range(4):
        model, opt = minitrain.prepare(build("parameter_list"), ADAMW, zero=zero)
        norms, grads = [], []
        for x in batches():
            mine = x.chunk(topo.world_size)[topo.rank]
            if zero >= 2:
                for half in mine.chunk(2):  # two backwards, no no_sync: each syncs, and they add up
                    (loss_of("parameter_list", model, half) / 2).backward()
                try:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
                    out[f"clip-{zero}"] = "no error"
                except RuntimeError as e:
                    out[f"clip-{zero}"] = str(e)
                norms.append(minitrain.clip_grad_norm_(model, 0.05))
            else:
                loss_of("parameter_list", model, mine).backward()
                grads.append({n: p.grad.clone() for n, p in model.named_parameters()})  # DDP's guarantee
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
            opt.step()
            opt.zero_grad()
        out[zero] = norms, grads, minitrain.full_state_dict(model)
    return out


def _fp16(topo, root):
    """fp16 through minitrain.GradScaler at every stage. Run A meets a batch whose loss is not finite (skipped: every
    parameter and all optimizer state unchanged, the scale halved), unscales before clipping, and is saved after
    the skip and resumed by a fresh model; run B never sees the bad batch and starts at A's halved scale. The
    scale is a power of two, so both must end bit for bit equal."""
    out = {}
    good = batches(3)
    for zero in range(4):
        def run(init_scale, bad_at, unscale):
            model, opt = minitrain.prepare(build("parameter_list").float(), ADAMW, zero=zero, precision="fp16")
            scaler = minitrain.GradScaler(opt, init_scale=init_scale, growth_interval=100)
            seen = []
            for i, x in enumerate(good[:1] + ([None] if bad_at else []) + good[1:]):
                mine = (good[0] if x is None else x).chunk(topo.world_size)[topo.rank]
                loss = loss_of("parameter_list", model, mine) * (float("inf") if x is None else 1.0)
                before = (opt.state_dict(), minitrain.full_state_dict(model)) if x is None else None
                scaler.scale(loss).backward()
                if unscale:
                    scaler.unscale_(opt)
                minitrain.clip_grad_norm_(model, 0.05)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
                if x is None:
                    seen.append((before, (opt.state_dict(), minitrain.full_state_dict(model)), scaler.get_scale()))
                    minitrain.save_checkpoint(root / f"fp16-{zero}", model, opt, i + 1)
                    resumed, resumed_opt = minitrain.prepare(build("parameter_list").float(), ADAMW, zero=zero,
                                                             precision="fp16")
                    minitrain.load_checkpoint(root / f"fp16-{zero}", resumed, resumed_opt)
                    resumed_scaler = minitrain.GradScaler(resumed_opt)  # made after the load: takes its state
                    seen.append(resumed_scaler.get_scale())
                    model, opt, scaler = resumed, resumed_opt, resumed_scaler
            return seen, opt.state_dict(), minitrain.full_state_dict(model)

        out[zero] = run(2.0 ** 10, True, True), run(2.0 ** 9, False, False)
    return out


class WithEmptyAndRunningMean(ParameterListScales):
    """A 0-element parameter (a prefix of length 0) and a buffer updated from each rank's own data."""

    def __init__(self):
        super().__init__()
        self.prefix = nn.Parameter(torch.zeros(0, D))
        self.register_buffer("mean_hidden", torch.zeros(D))

    def forward(self, x):
        out = super().forward(x)
        with torch.no_grad():
            self.mean_hidden.copy_(self.emb(x).mean((0, 1)))
        return out + self.prefix.sum()


def _habits(topo, root):
    """model.zero_grad() in place of the optimizer's, a 0-element parameter, BatchNorm, a buffer updated from data."""
    out = {}
    for zero in range(4):
        model, opt = minitrain.prepare(build("parameter_list"), ADAMW, zero=zero)
        for x in batches():
            model.zero_grad()  # torch's set_to_none: a fresh start for every gradient
            loss_of("parameter_list", model, x.chunk(topo.world_size)[topo.rank]).backward()
            opt.step()
        out[("zero_grad", zero)] = minitrain.full_state_dict(model)
        torch.manual_seed(0)
        model, opt = minitrain.prepare(WithEmptyAndRunningMean().double(), ADAMW, zero=zero)
        loss_of("parameter_list", model, batches(1)[0].chunk(topo.world_size)[topo.rank]).backward()
        opt.step()
        try:
            minitrain.save_checkpoint(root / f"buffers-{zero}", model, opt, 1)
            out[("buffer", zero)] = "saved"
        except ValueError as e:
            out[("buffer", zero)] = str(e)
    norm = nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D)).double()
    model, opt = minitrain.prepare(norm, ADAMW, zero=1)
    x = torch.randn(4, D, dtype=torch.float64)
    try:
        model(x)
        out["batchnorm"] = "ran"
    except RuntimeError as e:
        out["batchnorm"] = str(e)
    model.eval()
    model(x)  # frozen statistics: the same on every rank
    return out


def _torch_clip(topo) -> str:
    """bf16 gradients, ZeRO-1, the user's torch clip after backward: what step() says."""
    model, opt = minitrain.prepare(build("parameter_list").float(), ADAMW, zero=1, precision="bf16")
    loss_of("parameter_list", model, batches(1)[0].chunk(topo.world_size)[topo.rank]).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    try:
        opt.step()
    except RuntimeError as e:
        return str(e)
    return "stepped"


def _two_ranks(topo, kinds, root):
    minitrain.init_distributed(topology=topo)
    return (_zero3_cases(topo, kinds), _ported_ddp_loops(topo), _fp16(topo, root), _habits(topo, root),
            _torch_clip(topo))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_ranks(_two_ranks, 2, list(MODELS), tmp_path_factory.mktemp("any"), timeout_s=180)


def test_fp16_skips_an_overflowed_step_exactly_and_its_scale_survives_a_checkpoint(two_ranks):
    for rank_out in two_ranks:
        for zero, ((seen, opt_a, state_a), (_, opt_b, state_b)) in rank_out[2].items():
            (before, after, scale), resumed_scale = seen
            assert_bit_equal(after[0], before[0], f"ZeRO-{zero}: optimizer state across the skipped step")
            assert_bit_equal(after[1], before[1], f"ZeRO-{zero}: parameters across the skipped step")
            assert scale == resumed_scale == 2.0 ** 9, zero
            assert all(v.dtype == torch.float16 for v in state_a.values())
            assert_bit_equal(opt_a, opt_b, f"ZeRO-{zero}: optimizer, bad batch skipped vs never seen")
            assert_bit_equal(state_a, state_b, f"ZeRO-{zero}: parameters, bad batch skipped vs never seen")


def test_model_zero_grad_an_empty_parameter_and_per_rank_statistics(two_ranks):
    """model.zero_grad() (set_to_none) instead of the optimizer's: ZeRO-2/3 went on accumulating into their shard
    (5e-2 off), ZeRO-0/1 refused naming an internal call; a 0-element parameter was refused at ZeRO-0/1; BatchNorm
    and a buffer updated from each rank's data silently differed per rank."""
    _, ref_state = plain("parameter_list")
    for rank_out in two_ranks:
        habits = rank_out[3]
        for zero in range(4):
            state = habits[("zero_grad", zero)]
            for key, value in ref_state.items():
                assert (state[key] - value).abs().max().item() <= TOL, (zero, key)
            assert "buffer 'mean_hidden' differs across data-parallel ranks" in habits[("buffer", zero)], zero
        assert "'1' (BatchNorm1d) normalizes by the statistics of each rank's own batch" in habits["batchnorm"]


def test_a_zero_stage_that_is_not_one_is_refused():
    for zero in (True, 2.0, "2", 4):
        with pytest.raises(ValueError, match="zero must be one of the ZeRO stages 0, 1, 2, 3"):
            minitrain.prepare(build("direct_tie"), ADAMW, zero=zero)


def test_fp16_steps_only_through_its_scaler():
    model, opt = minitrain.prepare(build("parameter_list").float(), ADAMW, zero=1, precision="fp16")
    loss_of("parameter_list", model, batches(1)[0]).backward()
    with pytest.raises(RuntimeError, match="minitrain.GradScaler"):
        opt.step()
    with pytest.raises(ValueError, match="needs no loss scaling"):
        minitrain.GradScaler(minitrain.prepare(build("direct_tie").float(), ADAMW, precision="bf16")[1])


def plain_clipped(kind: str, max_norm: float) -> tuple[list[float], list[dict], dict]:
    model = build(kind)
    opt = ADAMW(model.parameters())
    norms, grads = [], []
    for x in batches():
        loss_of(kind, model, x).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        opt.zero_grad()
    return norms, grads, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_loop_ported_from_ddp_reads_averaged_gradients_or_is_told_where_they_went(two_ranks):
    ref_norms, ref_grads, ref_state = plain_clipped("parameter_list", 0.05)
    for rank_out in two_ranks:
        ported = rank_out[1]
        for zero in range(4):
            norms, grads, state = ported[zero]
            assert max(abs(a - b) for a, b in zip(norms, ref_norms)) <= TOL, zero  # the true global norm
            assert min(ref_norms) > 0.05, "clipping must engage"
            for got, ref in zip(grads, ref_grads):  # ZeRO-0/1: after backward, every p.grad is the average
                for name, value in ref.items():
                    assert (got[name] - value).abs().max().item() <= TOL, (zero, name)
            for key, value in ref_state.items():  # torch's clip applied at 0/1, minitrain's at 2/3: same training
                assert (state[key] - value).abs().max().item() <= TOL, (zero, key)
        for zero in (2, 3):
            assert "minitrain.clip_grad_norm_" in ported[f"clip-{zero}"] and "sharded" in ported[f"clip-{zero}"]


def test_torch_clipping_where_it_cannot_be_honoured_is_refused(two_ranks):
    """bf16 gradients summed over ranks in float32: the optimizer steps on the float32 sum, so a clip of the bf16
    p.grad would be silently ignored; it is refused at step(). In one process nothing is summed: the optimizer
    steps on p.grad itself, and the clip is honoured."""
    for rank_out in two_ranks:
        assert "p.grad was changed between backward and optimizer.step" in rank_out[4], rank_out[4]
    model, opt = minitrain.prepare(build("parameter_list").float(), ADAMW, zero=1, precision="bf16")
    loss_of("parameter_list", model, batches(1)[0]).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    clipped = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None]).norm()
    before = [p.detach().float().clone() for p in model.parameters()]
    opt.step()
    assert clipped <= 1.01e-3 and any(not torch.equal(b, p.float()) for b, p in zip(before, model.parameters()))


def test_zero3_gathers_parameters_used_outside_their_module_and_sees_into_any_output(two_ranks):
    got = two_ranks[0][0]
    for kind in MODELS:
        ref_losses, ref_state = plain(kind)
        for zero in (2, 3):
            losses, state = got[(kind, zero)]
            assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOL, (kind, zero)
            assert state.keys() == ref_state.keys()
            for key, value in ref_state.items():
                assert (state[key] - value).abs().max().item() <= TOL, (kind, zero, key)


class Hidden:
    """An object of its own, holding its tensor where ZeRO-3 cannot see it: no tensor in the output at all."""

    def __init__(self, value):
        self.get = lambda: value


class OpaqueBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, D)

    def forward(self, h):
        return Hidden(self.proj(h))


class OpaqueBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(OpaqueBlock() for _ in range(2))

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            h = block(h).get()
        return h


def test_an_output_zero3_cannot_see_into_is_refused_naming_its_type():
    model, _ = minitrain.prepare(OpaqueBlocks().double(), ADAMW, zero=3)
    with pytest.raises(ValueError, match="in what 'blocks.0' returned \\(a Hidden\\)"):
        model(batches(1)[0])


def test_zero3_refuses_reading_a_freed_parameter_between_steps_instead_of_reading_freed_memory(two_ranks):
    """Between steps ZeRO-3 holds only shards. Code of the user's that reads a parameter then (an EMA, a logged norm,
    print) read freed memory: garbage, or the process killed by SIGSEGV. Now it is refused, naming what to do; what
    describes a parameter stays readable, and the run goes on exactly (its losses and final state are
    test_zero3_gathers_parameters_used_outside_their_module_and_sees_into_any_output's)."""
    for rank_out in two_ranks:
        for kind in MODELS:
            for name, seen in rank_out[0][(kind, "reads")].items():
                assert seen["description"] == ("torch.float64", "cpu", True, None, True), (kind, name)
                assert seen["unread"] == (True, True, True), (kind, name)
                for what, said in seen["values"].items():
                    assert "ZeRO-3 has freed" in said and "minitrain.full_state_dict(model)" in said, (kind, what, said)


# --- refusals before anything is split ------------------------------------------------------------------------
transformers = pytest.importorskip("transformers")


def tiny(config_class, model_class, **options):
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = config_class(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16, head_dim=8,
                          **options)
    return model_class(config).double()


class ScaledEmbedding(nn.Embedding):
    """An embedding whose forward scales its output, as Gemma's does."""

    def forward(self, ids):
        return super().forward(ids) * self.embedding_dim ** 0.5


def test_a_plan_that_would_replace_a_module_with_a_forward_of_its_own_is_refused():
    from minitrain.parallel.tensor_parallel.plans import check_plan, hugging_face_plan

    model = tiny(transformers.LlamaConfig, transformers.LlamaForCausalLM, tie_word_embeddings=True)
    old = model.model.embed_tokens
    model.model.embed_tokens = ScaledEmbedding(old.num_embeddings, old.embedding_dim).double()
    model.tie_weights()
    with pytest.raises(ValueError, match="'model.embed_tokens' is a ScaledEmbedding, whose forward is its own"):
        check_plan(model, hugging_face_plan(model), 2)  # tp_plan="auto" splits a tied embedding over the vocabulary
    gemma = tiny(transformers.GemmaConfig, transformers.GemmaForCausalLM)
    with pytest.raises(ValueError, match="whose forward is its own"):
        check_plan(gemma, hugging_face_plan(gemma), 2)


def _split_check(model, split):
    check_pieces(model, split, check_split(model, split, 2))


def test_a_pipeline_split_that_does_not_compute_the_models_forward_is_refused():
    pieces = ["model.embed_tokens", "model.layers", "model.norm", "lm_head"]
    eager = tiny(transformers.LlamaConfig, transformers.LlamaForCausalLM, attn_implementation="eager")

    def rotary_only(model, hidden):  # the blocks' rotary embeddings, but no causal mask
        positions = torch.arange(hidden.size(1)).unsqueeze(0)
        return {"position_embeddings": model.model.rotary_emb(hidden, positions)}

    with pytest.raises(ValueError, match="does not give what LlamaForCausalLM.forward gives"):
        _split_check(eager, PipelineSplit(pieces, rotary_only))  # eager attention without its mask looks ahead
    _split_check(eager, PipelineSplit.auto(eager))  # the auto split carries the model's own causal mask
    gemma2 = tiny(transformers.Gemma2Config, transformers.Gemma2ForCausalLM)
    with pytest.raises(ValueError, match="soft-caps its logits"):
        PipelineSplit.auto(gemma2)
    mistral = tiny(transformers.MistralConfig, transformers.MistralForCausalLM, sliding_window=4)
    with pytest.raises(ValueError, match="sliding window"):
        PipelineSplit.auto(mistral)
    tempered = Tempered().double()
    with pytest.raises(ValueError, match="does not give what Tempered.forward gives"):
        _split_check(tempered, PipelineSplit(["emb", "blocks", "head"]))


class Tempered(Body):
    """Logits divided by a temperature after the head: post-processing that running the pieces would skip."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(D, V)

    def forward(self, x):
        return self.head(super().forward(x)) / 0.7
