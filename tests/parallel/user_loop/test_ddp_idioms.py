"""What a loop written for DDP (or FSDP2) does with its model and optimizer, honoured as DDP does it, or refused at
once saying what to do: an optimizer made (and stepped, or loaded) before prepare, with a scheduler made on it;
DDP's and FSDP2's switches for accumulation; model.module; a model each rank initialised differently; torch's
GradScaler and torch's clip where gradients are whole; torch.compile after prepare; tied weights in full_state_dict.
Float64 on 2 ranks against DDP or one process; each test fails on the code before the change it names."""
from __future__ import annotations

import contextlib
import copy
import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import minitrain
from minitrain.api.session import state_of
from minitrain.parallel.core.shard_optimizer import NotElementwiseError

from tests.helpers.dist import run_ranks
from tests.helpers.numerics import assert_states_match
from tests.helpers.hf_models import make_model
from tests.parallel.user_loop.test_habits import Block

pytestmark = pytest.mark.slow

V, D, T = 16, 8, 6
TOL = 1e-12
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)


class Net(nn.Module):
    """A tied head, a frozen parameter and a persistent buffer, each drawn from the seed."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight
        self.scale = nn.Parameter(torch.rand(D) + 0.5, requires_grad=False)
        self.register_buffer("shift", torch.randn(D) / 4)

    def forward(self, x):
        h = self.emb(x) * self.scale + self.shift
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net().double()


def groups(model: nn.Module) -> list[dict]:
    """nanoGPT's split (no decay for vectors), the frozen vector among them, as model.parameters() puts it there."""
    return [{"params": [p for p in model.parameters() if p.dim() >= 2 and p.requires_grad], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]


def loss_of(model, x):
    return F.cross_entropy(model(x)[:, :-1].reshape(-1, V), x[:, 1:].reshape(-1))


def batches(steps: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, V, (8, T), generator=g) for _ in range(steps)]


def _same(a, b, where: str) -> None:
    assert_states_match(a, b, where, TOL)


# --- an optimizer made before prepare --------------------------------------------------------------------------
def _steps(model, optimizer, scheduler, xs, rank=0, world=1) -> list[float]:
    losses = []
    for x in xs:
        loss = loss_of(model, x.chunk(world)[rank])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(loss.item())
    return losses


def _made_before_prepare(topo):
    minitrain.init_distributed(topology=topo)
    out = {}
    for zero in range(4):
        model = net()
        made = torch.optim.AdamW(groups(model), lr=0.02, betas=(0.9, 0.95))
        scheduler = torch.optim.lr_scheduler.LambdaLR(made, lambda step: 0.5 ** step)
        _steps(model, made, scheduler, batches()[:2])  # on every rank alike: state to carry over
        before, shown = copy.deepcopy(made.state_dict()), made.param_groups
        model, optimizer = minitrain.prepare(model, made, zero=zero)
        assert optimizer.param_groups is shown and isinstance(optimizer.inner, torch.optim.AdamW)
        assert {id(p) for g in shown for p in g["params"]} == {id(p) for p in model.parameters()}
        assert not made.state  # its memory is the prepared optimizer's now
        with pytest.raises(RuntimeError, match="was given to minitrain.prepare, which returned the optimizer"):
            made.step()
        carried = optimizer.state_dict()
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            losses = _steps(model, optimizer, scheduler, batches()[2:], topo.rank, topo.world_size)
        assert not [w for w in warned if "before `optimizer.step()`" in str(w.message)]  # the prepared one stepped
        out[zero] = {"before": before, "carried": carried, "losses": losses,
                     "state": minitrain.full_state_dict(model), "lr": [g["lr"] for g in optimizer.param_groups]}
    return out


def test_an_optimizer_made_before_prepare_carries_its_class_groups_state_and_scheduler_at_every_stage():
    """Made and stepped (as a checkpoint's load leaves it) before prepare, with a scheduler made on it: at ZeRO 0-3
    its state comes out of the prepared optimizer exactly as it went in, its param groups are the very dicts the
    scheduler drives, and training goes on as one process does."""
    results = run_ranks(_made_before_prepare, 2)[0]
    model = net()
    made = torch.optim.AdamW(groups(model), lr=0.02, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(made, lambda step: 0.5 ** step)
    _steps(model, made, scheduler, batches()[:2])
    losses = _steps(model, made, scheduler, batches()[2:])
    for zero, got in results.items():
        _same(got["carried"], got["before"], f"ZeRO-{zero} carried state")
        torch.testing.assert_close(got["lr"], [g["lr"] for g in made.param_groups], rtol=0, atol=0)
        _same(got["state"], dict(model.state_dict()), f"ZeRO-{zero} parameters")
        assert len(got["losses"]) == len(losses)


def test_an_optimizer_that_cannot_be_made_again_exactly_is_refused_before_the_model_changes():
    """A wrapper of another optimizer, a subclass keeping a setting outside its defaults, hooks prepare cannot
    carry, and under ZeRO a loaded state whose parameters of one group have taken different numbers of steps:
    each refused saying what to do, with the model as it was."""
    class Lookahead(torch.optim.Optimizer):  # wraps another optimizer: its class alone cannot make it again
        def __init__(self, base: torch.optim.Optimizer, k: int = 5):
            self.base, self.k = base, k
            super().__init__(base.param_groups, {"k": k})

        def step(self, closure=None):
            return self.base.step(closure)

    class ClippedSGD(torch.optim.SGD):  # a setting of its own, not in its defaults
        def __init__(self, params, lr=0.1, clip=1.0):
            super().__init__(params, lr=lr)
            self.clip = clip

    model = net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="could not make Lookahead again .* pass what makes it instead"):
        minitrain.prepare(model, Lookahead(torch.optim.SGD(model.parameters(), lr=0.1)))
    with pytest.raises(ValueError, match="ClippedSGD keeps clip of its own, which made again from its defaults "
                                         "differs from yours; pass what makes it instead"):
        minitrain.prepare(model, ClippedSGD(model.parameters(), clip=0.5))
    hooked = torch.optim.SGD(model.parameters(), lr=0.1)
    hooked.register_state_dict_pre_hook(lambda optimizer: None)
    with pytest.raises(ValueError, match="has state_dict or load_state_dict hooks, which prepare cannot carry"):
        minitrain.prepare(model, hooked)
    other = net()
    partly = torch.optim.AdamW([{"params": [other.emb.weight, other.blocks[0].lin.weight]}], lr=0.1)
    loss_of(other, batches(1)[0]).backward()
    other.emb.weight.grad = None  # one parameter of the group is not stepped
    partly.step()
    partly.add_param_group({"params": [p for p in other.parameters() if p.requires_grad and p.dim() < 2 or
                                       p is other.blocks[1].lin.weight]})
    with pytest.raises(ValueError, match="param group 0's parameters differ in their 'step'.* or use zero=0"):
        minitrain.prepare(other, partly, zero=1)
    assert type(model) is Net and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="param_groups goes with an optimizer's maker"):
        minitrain.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), param_groups=groups(model))
    with pytest.raises(ValueError, match="prepare takes the model before torch.compile"):
        minitrain.prepare(torch.compile(model), ADAMW)


def test_a_made_optimizers_step_hooks_go_with_it_and_the_prepared_model_is_not_pickled_whole(tmp_path):
    """An EMA kept by a step post-hook on the optimizer made before prepare still runs after each step; torch.save
    of the prepared model is refused saying what to save; an optimizer whose class makes state when it is made
    (Adagrad) is not taken for one that has stepped; a scheduler made just before prepare does not warn."""
    from minitrain.api import user_optimizer

    model = net()
    made = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = {}
    made.register_step_post_hook(lambda optimizer, args, kwargs: ema.update(
        {name: p.detach().clone() for name, p in model.named_parameters()}))
    model, optimizer = minitrain.prepare(model, made)
    loss_of(model, batches(1)[0]).backward()
    optimizer.step()
    assert ema and torch.equal(ema["emb.weight"], model.emb.weight)
    with pytest.raises(TypeError, match="not pickled or copied whole .* save model.state_dict()"):
        torch.save(model, tmp_path / "model.pt")
    adagrad = torch.optim.Adagrad(net().parameters(), lr=0.1)
    assert adagrad.state and not user_optimizer.stepped(user_optimizer.take(adagrad, None))
    # A scheduler made on the optimizer just before prepare: the prepared one steps first, and no warning says the
    # scheduler stepped before its optimizer.
    fresh = torch.optim.SGD((model := net()).parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(fresh, lambda step: 0.5 ** step)
    model, optimizer = minitrain.prepare(model, fresh)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        _steps(model, optimizer, scheduler, batches(1))
    assert not [w for w in warned if "before `optimizer.step()`" in str(w.message)], [str(w.message) for w in warned]
    minitrain.cleanup()


# --- DDP's and FSDP2's switches for accumulation ---------------------------------------------------------------
SWITCHES = ("minitrain.no_sync", "model.no_sync", "require_backward_grad_sync", "set_requires_gradient_sync")


def _accumulate(model, optimizer, how: str, rank: int, world: int) -> None:
    for x in batches(2):
        micro = x.chunk(world)[rank].chunk(4)
        for i, part in enumerate(micro):
            last = i == len(micro) - 1
            context = contextlib.nullcontext()
            if how == "require_backward_grad_sync":
                model.require_backward_grad_sync = last  # DDP's attribute, set before the forward (nanoGPT)
            elif how == "set_requires_gradient_sync":
                model.set_requires_gradient_sync(last)  # FSDP2's
            elif not last:
                context = model.no_sync() if how == "model.no_sync" else minitrain.no_sync(model)
            with context:
                (loss_of(model, part) / len(micro)).backward()
        optimizer.step()
        optimizer.zero_grad()


def _switches(topo):
    minitrain.init_distributed(topology=topo)
    out = {}
    for zero in range(4):
        for how in SWITCHES:
            model, optimizer = minitrain.prepare(net(), ADAMW, zero=zero)
            stats = topo.dp.stats
            before = {op: s.calls for op, s in stats.items()}
            _accumulate(model, optimizer, how, topo.rank, topo.world_size)
            calls = {op: s.calls - before.get(op, 0) for op, s in stats.items()}
            out[(zero, how)] = {"state": minitrain.full_state_dict(model), "calls": calls,
                                "buckets": len(getattr(state_of(model).strategy, "buckets", ()))}
    return out


def test_ddps_and_fsdp2s_switches_for_accumulation_sync_once_per_step_as_no_sync_does():
    """require_backward_grad_sync (nanoGPT's way), model.no_sync() and FSDP2's set_requires_gradient_sync: at every
    stage the same training, bit for bit, as minitrain.no_sync, with the same collectives: at ZeRO-0 one all-reduce
    per bucket per step, not per micro-batch (the switch used to be ignored, every micro-batch synced)."""
    results = run_ranks(_switches, 2)[0]
    for zero in range(4):
        reference = results[(zero, "minitrain.no_sync")]
        for how in SWITCHES[1:]:
            got = results[(zero, how)]
            assert got["calls"] == reference["calls"], (zero, how, got["calls"], reference["calls"])
            for key, value in reference["state"].items():
                assert torch.equal(got["state"][key], value), (zero, how, key)
    assert results[(0, "require_backward_grad_sync")]["calls"]["all_reduce"] == \
        2 * results[(0, "minitrain.no_sync")]["buckets"]  # 2 steps


# --- model.module, the model's class ---------------------------------------------------------------------------
def test_model_module_is_refused_naming_the_model_and_hugging_face_still_saves(tmp_path):
    """DDP scripts write `raw_model = model.module`: the message says to use the model. `hasattr(model, "module")`
    stays False, so transformers' save_pretrained (which unwraps model.module for as long as there is one) saves the
    prepared model; the class keeps its name, and cleanup() gives the model its own class back."""
    transformers = pytest.importorskip("transformers")
    model = make_model("gpt2")
    cls = type(model)
    model, _ = minitrain.prepare(model, ADAMW)
    assert isinstance(model, cls) and type(model).__name__ == cls.__name__
    with pytest.raises(AttributeError, match="returns your GPT2LMHeadModel itself, not a wrapper: use the model"):
        model.module  # noqa: B018
    assert not hasattr(model, "module")
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    assert type(loaded) is cls
    x = torch.randint(0, 64, (2, 8))
    assert torch.equal(loaded(input_ids=x).logits, model(input_ids=x).logits)
    minitrain.cleanup()
    assert type(model) is cls


# --- every rank its own initialisation -------------------------------------------------------------------------
def _seeded_per_rank(topo):
    """Each rank builds its model from its own seed (nanoGPT seeds 1337 + rank): after prepare, rank 0's model."""
    minitrain.init_distributed(topology=topo)
    with pytest.raises(NotElementwiseError, match="slices tensor or expert parallelism gives each rank; use tp=1"):
        minitrain.prepare(llama(0), functools.partial(torch.optim.Adafactor, lr=1e-2), tp=2, tp_plan="auto")
    out = {}
    for zero in (0, 3):
        model, _ = minitrain.prepare(net(1337 + topo.rank), ADAMW, zero=zero)
        state = minitrain.full_state_dict(model)
        out[zero] = {"state": state, "tied": state["head.weight"].data_ptr() == state["emb.weight"].data_ptr(),
                     "own": {k: v.clone() for k, v in model.state_dict().items()} if zero == 0 else None}
    model, _ = minitrain.prepare(llama(1337 + topo.rank), ADAMW, tp=2, tp_plan="auto")
    out["tp"] = {"state": minitrain.full_state_dict(model)}
    return out


def llama(seed: int) -> nn.Module:
    """A Llama whose 2 key-value heads split over tp=2."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=T)
    return transformers.LlamaForCausalLM(cfg).double()


def test_a_model_each_rank_initialised_differently_starts_as_rank_0s_everywhere():
    """Trainable and frozen parameters and buffers, at ZeRO-0 and ZeRO-3 and with tensor parallelism (whose slices
    used to come from each rank's own model): every rank starts from rank 0's model, as DDP's broadcast at wrap
    makes it. And a tied weight comes back from full_state_dict as one tensor under both keys, as torch's does."""
    first, second = run_ranks(_seeded_per_rank, 2)
    expected = {k: v.clone() for k, v in net(1337).state_dict().items()}
    for result in (first, second):
        for zero in (0, 3):
            _same(result[zero]["state"], expected, f"ZeRO-{zero}")
            assert result[zero]["tied"], "the tied head and embedding are one tensor, as in torch's state_dict"
        _same(result[0]["own"], expected, "model.state_dict() at ZeRO-0")
        _same(result["tp"]["state"], dict(llama(1337).state_dict()), "tp=2")


# --- torch's GradScaler and clip where gradients are whole; torch.compile after prepare -------------------------
def _torch_scaler(topo, setup):
    minitrain.init_distributed(topology=topo)
    model = net()
    if setup == "ddp":
        model = minitrain.wrap_for_ddp(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        model, optimizer = minitrain.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2), zero=setup)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    out = []
    for i, x in enumerate(batches(5)):
        loss = loss_of(model, x.chunk(topo.world_size)[topo.rank])
        if i == 2 and topo.rank == 1:
            loss = loss * float("inf")  # one rank overflows: the step is skipped on every rank
        try:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
        except RuntimeError as e:
            return str(e)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        out.append([loss.item(), float(norm), scaler.get_scale()])
    inner = model.module if setup == "ddp" else model
    return {"steps": out, "state": {k: v.clone() for k, v in inner.state_dict().items()}}


def test_torchs_grad_scaler_and_clip_train_as_under_ddp_at_zero_0_and_1_and_are_refused_at_2():
    """torch.amp.GradScaler unscales the gradients the optimizer's param_groups hold (they used to be minitrain's
    shard views, with no gradient: its step asserted), skips an overflowed step on every rank, and grows its
    scale, as under DDP; at ZeRO-2 the gradients are shards and it is refused naming minitrain's GradScaler."""
    ddp = run_ranks(_torch_scaler, 2, "ddp")[0]
    assert ddp["steps"][2][1] != ddp["steps"][2][1] and ddp["steps"][3][2] < ddp["steps"][1][2]  # overflowed
    for zero in (0, 1):
        got = run_ranks(_torch_scaler, 2, zero)[0]
        for mine, theirs in zip(got["steps"], ddp["steps"]):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=TOL, equal_nan=True)
        _same(got["state"], ddp["state"], f"ZeRO-{zero}")
    message = run_ranks(_torch_scaler, 2, 2)[0]
    assert "sharded across ranks at ZeRO-2" in message and "minitrain.GradScaler" in message, message


def _compiled_after_prepare(topo, zero, compiled):
    minitrain.init_distributed(topology=topo)
    model, optimizer = minitrain.prepare(net(), ADAMW, zero=zero)
    run = torch.compile(model, backend="aot_eager") if compiled else model
    losses, graphs = [], []
    for x in batches(3):
        micro = x.chunk(topo.world_size)[topo.rank].chunk(2)
        for i, part in enumerate(micro):
            run.require_backward_grad_sync = i == len(micro) - 1  # through the compiled wrapper, to the model
            (loss_of(run, part) / len(micro)).backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():  # an evaluation, on every rank
            losses.append(loss_of(run, x).item())
        if compiled:
            from torch._dynamo.utils import counters
            graphs.append(counters["stats"]["unique_graphs"])
    return {"losses": losses, "state": minitrain.full_state_dict(model), "graphs": graphs}


@pytest.mark.parametrize("zero", [0, 3])
def test_torch_compile_after_prepare_trains_as_eager(zero):
    """torch.compile(model) after prepare (dynamo tracing the forward with minitrain's hooks; the hooks that gather or
    wait run eagerly), with DDP's switch set through the compiled wrapper: the same training as eager, compiled
    once (no graph made again at a later step)."""
    eager = run_ranks(_compiled_after_prepare, 2, zero, False)[0]
    compiled = run_ranks(_compiled_after_prepare, 2, zero, True, timeout_s=300)[0]
    torch.testing.assert_close(compiled["losses"], eager["losses"], rtol=0, atol=TOL)
    _same(compiled["state"], eager["state"], f"ZeRO-{zero}")
    assert compiled["graphs"][0] > 0 and len(set(compiled["graphs"])) == 1, compiled["graphs"]  # none made again


def _evaluation_alone_at_tp_2(topo):
    minitrain.init_distributed(topology=topo)
    model, _ = minitrain.prepare(llama(0), ADAMW, tp=2, tp_plan="auto")
    x = torch.randint(0, 32, (2, T))
    if topo.rank == 0:
        with torch.no_grad():
            model(input_ids=x)  # site: rank 0 evaluates alone
    else:
        model(input_ids=x).logits.sum().backward()  # site: rank 1 trains on
    return "went on"


def test_an_evaluation_on_one_rank_of_a_tensor_parallel_model_stops_every_rank_naming_each_line():
    """With tp=2 every forward all-reduces across the pair: rank 0 evaluating alone (as a DDP script does) is
    announced and found, rather than its collectives pairing with rank 1's training ones."""
    from minitrain.runtime.launch import RankFailedError, launch

    lines = open(__file__).read().splitlines()
    site = {m: f"test_ddp_idioms.py:{next(i + 1 for i, t in enumerate(lines) if t.endswith(f'# site: {m}'))}"
            for m in ("rank 0 evaluates alone", "rank 1 trains on")}
    with pytest.raises(RankFailedError) as failed:
        launch(_evaluation_alone_at_tp_2, 2, backend="gloo", pg_timeout_s=60, timeout_s=90)
    assert (f"rank 0 is in the model's forward at {site['rank 0 evaluates alone']}; rank 1 is in the model's forward "
            f"at {site['rank 1 trains on']}: with tp=2 each rank holds slices of the model's layers") in \
        str(failed.value), failed.value
