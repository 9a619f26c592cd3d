"""ZeRO stages 0-3: identical training, memory that matches the formula, parity with PyTorch's peers.

Stage 0 (data parallel), 1, 2 and 3 must follow plain PyTorch in one process with the
same global batch (tests/helpers/reference.py): in float64 every difference is reduction-order rounding.
"""
import gc
import math

import pytest
import torch


from minitrain.train.run_config import run_config
from minitrain.bench.peers import STAGE_OF, PeerTrainer
from minitrain.runtime.topology import Topology
from minitrain.train.trainer import Trainer

from tests.helpers.dist import run_ranks
from tests.helpers.numerics import FLOAT32_VS_ONE_PROCESS, key_bias_mask
from tests.helpers.reference import assert_close_to, assert_exercises_the_loop, plain_run
from tests.helpers.storage import sampled_step

pytestmark = pytest.mark.slow

STAGES = (0, 1, 2, 3)
STEPS = 5


def _config(world, zero, dtype="float64", batch_size=4, grad_accum=1, steps=STEPS, **extra):
    values = {"train.zero": zero, "train.dtype": dtype, "train.steps": steps, "train.batch_size": batch_size,
              "train.grad_accum": grad_accum, "dist.nproc": world, "train.lr": 1e-2, "train.log_every": 0,
              # In float64, between the steps' gradient norms: clipping acts on some steps, not on others.
              "train.grad_clip": 1.5 if dtype == "float64" else 1.0}
    values.update(extra)
    return run_config(cli_values=values)


def _train(topo, zero, dtype="float64", batch_size=4, grad_accum=1, **extra):
    trainer = Trainer(_config(topo.world_size, zero, dtype, batch_size, grad_accum, **extra), topo)
    records = [trainer.train_step() for _ in range(STEPS)]
    s = trainer.strategy
    return {"losses": [r.loss for r in records], "grad_norms": [r.grad_norm for r in records],
            "params": s.full_params(), "snapshot": s.state_snapshot(),
            "memory": s.memory_bytes(), "expected": s.expected_memory_bytes(), "peak": s.peak_memory_bytes(),
            "padded": s.flat.padded_numel, "numel": s.flat.numel, "units": len(s.flat.units),
            "unit_sizes": [u.stop - u.start for u in s.flat.units],
            "empty_at_rest": all(p.untyped_storage().nbytes() == 0 for p in trainer.model.parameters())}


def _every_stage(topo, dtype, batch_size=4, grad_accum=1):
    return {zero: _train(topo, zero, dtype, batch_size, grad_accum) for zero in STAGES}


def _max_diff(a, b) -> float:
    return (a - b).abs().max().item()


def _plain(world, batch_size=4, grad_accum=1, **extra):
    """Plain PyTorch in one process on the same global batch, in float64."""
    return plain_run(_config(world, 0, "float64", batch_size, grad_accum, **extra), STEPS)


def _assert_follows(ref, got, what):
    assert_close_to(ref, 1e-12, what, losses=got["losses"], grad_norms=got["grad_norms"], params=got["params"])


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_stage_equals_single_process_float64(world):
    results = run_ranks(_every_stage, world, "float64")
    ref = _plain(world)
    assert_exercises_the_loop(ref)
    for zero in STAGES:
        got = results[0][zero]
        assert all(torch.equal(r[zero]["params"], got["params"]) for r in results), f"ranks differ at ZeRO-{zero}"
        # The global norm over shards is the single process's norm, so clipping acts on the same steps.
        _assert_follows(ref, got, f"ZeRO-{zero} at {world} ranks")


def test_every_stage_agrees_in_float32():
    results = run_ranks(_every_stage, 4, "float32")[0]
    keep = ~key_bias_mask(results[0]["numel"])  # exact gradient zero: only rounding residue (see numerics.py)
    for zero in (1, 2, 3):
        # All-reduce (stage 0) and reduce-scatter sum in different orders; only the key biases notice.
        torch.testing.assert_close(results[zero]["params"][keep], results[0]["params"][keep], rtol=0, atol=1e-6)
        torch.testing.assert_close(torch.tensor(results[zero]["losses"]), torch.tensor(results[0]["losses"]),
                                   rtol=0, atol=1e-6)
    ref = _train(Topology.single(), 0, "float32", batch_size=16)
    torch.testing.assert_close(results[3]["params"][keep], ref["params"][keep], rtol=0, atol=FLOAT32_VS_ONE_PROCESS)


def test_gradient_accumulation_equals_one_big_batch_at_every_stage():
    # 3 ranks (padding) x 2 micro-batches x batch 2 = one process with batch 12.
    results = run_ranks(_every_stage, 3, "float64", 2, 2)[0]
    ref = _plain(3, 2, 2)
    for zero in STAGES:
        _assert_follows(ref, results[zero], f"ZeRO-{zero}")


def test_at_rest_memory_equals_the_formula_and_shards_as_one_over_n():
    single = run_ranks(_every_stage, 1, "float32")[0]
    four = run_ranks(_every_stage, 4, "float32")
    for zero in STAGES:
        assert single[zero]["memory"] == single[zero]["expected"], f"ZeRO-{zero}, 1 rank"
        assert all(rank[zero]["memory"] == rank[zero]["expected"] for rank in four), f"ZeRO-{zero}, 4 ranks"
        padding = four[0][zero]["padded"] - single[zero]["numel"]  # each unit padded to a multiple of 4
        assert 0 <= padding < 4 * four[0][zero]["units"]
        # Float32 bytes per element over the whole model and over one rank's shard. ZeRO-2 keeps the full parameters
        # and the shard they are gathered from; at ZeRO-2/3 the optimizer holds m and v only, its master being the
        # parameter shard.
        bytes_of = {"params": {2: (4, 4), 3: (0, 4)}.get(zero, (4, 0)), "grads": (0, 4) if zero >= 2 else (4, 0),
                    "optimizer": (0, 8) if zero >= 2 else (0, 12) if zero == 1 else (12, 0)}
        padded = four[0][zero]["padded"]
        for kind, (whole, shard) in bytes_of.items():
            n1, n4 = single[zero]["memory"][kind], four[0][zero]["memory"][kind]
            assert n1 == (whole + shard) * single[zero]["numel"], f"ZeRO-{zero} {kind} at 1 rank: {n1}"
            assert 4 * n4 == 4 * whole * padded + shard * padded, f"ZeRO-{zero} {kind}: {n4} at 4 ranks vs {n1} at 1"
    assert four[0][3]["empty_at_rest"] and not four[0][2]["empty_at_rest"]  # ZeRO-3 holds no full parameter


def _deep_model_memory(topo):
    """6 blocks: enough units that one block at a time is visibly less than the whole model."""
    out = {}
    for zero, prefetch in ((0, True), (2, True), (3, True), (3, False)):
        r = _train(topo, zero, "float32", **{"model.n_layer": 6, "train.prefetch": prefetch})
        out[(zero, prefetch)] = r
    return out


def test_zero3_gathers_one_block_at_a_time_and_prefetch_changes_nothing_but_memory():
    r = run_ranks(_deep_model_memory, 2)[0]
    dp, z2, z3, z3_serial = r[(0, True)], r[(2, True)], r[(3, True)], r[(3, False)]
    assert z3["losses"] == z3_serial["losses"] and torch.equal(z3["params"], z3_serial["params"])
    shard = 4 * z3["padded"] // 2
    largest = 4 * max(z3["unit_sizes"])
    # Without prefetch: the shard plus exactly one gathered unit; with it, at most two.
    assert z3_serial["peak"]["params"] == shard + largest
    assert shard + largest <= z3["peak"]["params"] <= shard + 2 * largest < 4 * z3["numel"]
    # ZeRO-2: never a full gradient buffer (data parallel holds one all step).
    assert z2["peak"]["grads"] < 4 * z2["numel"] <= dp["peak"]["grads"] == 4 * dp["padded"]
    assert _max_diff(z3["params"], dp["params"]) <= 1e-6


def _measured_memory(topo):
    """Storage census (tests/helpers/storage.py) through one step of the 6-block model at each stage."""
    out = {}
    for zero, prefetch in ((0, True), (2, True), (3, True), (3, False)):
        # Leave the interpreter's objects so far out of the walks: they hold no tensor of this trainer. That
        # includes the previous trainers: a dropped strategy outlives its trainer (the hooks it put on the
        # parameters close over it, a cycle through C++ that gc does not follow).
        gc.collect()
        gc.freeze()
        trainer = Trainer(_config(topo.world_size, zero, "float32", **{"model.n_layer": 6, "train.prefetch": prefetch}),
                          topo)
        trainer.train_step()  # the second step is measured: the first allocates what every step reuses
        s = trainer.strategy
        out[(zero, prefetch)] = {"samples": sampled_step(trainer), "ledger_peak": s.peak_memory_bytes(),
                                 "numel": s.flat.numel, "padded": s.flat.padded_numel,
                                 "largest_unit": max(u.stop - u.start for u in s.flat.units)}
        del trainer, s
    return out


def test_zero2_and_zero3_memory_read_from_real_storage_through_a_step():
    r = run_ranks(_measured_memory, 2)[0]
    most = {key: {kind: max(sample[kind] for sample in m["samples"]) for kind in ("params", "grads_and_other")}
            for key, m in r.items()}
    numel, padded, largest = r[(3, True)]["numel"], r[(3, True)]["padded"], 4 * r[(3, True)]["largest_unit"]
    full, shard = 4 * numel, 4 * padded // 2  # float32 bytes of the whole model, and of one rank's half
    # Data parallel holds the full gradient buffer from start to end of the step.
    assert min(sample["grads_and_other"] for sample in r[(0, True)]["samples"]) >= full
    # ZeRO-2: the gradient shard, plus the full gradient of at most two blocks (one filling, one reducing).
    assert shard < most[(2, True)]["grads_and_other"] <= shard + 2 * largest < full
    # ZeRO-2/3 give the shard back at the step's start (as FSDP2's zero_grad frees its sharded gradients): it is not
    # held through the forward's activations, and backward's first reduction takes it again.
    for key in ((2, True), (3, True)):
        forward = [sample["grads_and_other"] for sample in r[key]["samples"] if "forward" in sample["where"]]
        assert len(forward) > 2 and max(forward) < shard // 4, (key, forward, shard)
        # Unit by unit, each reduction allocating its own piece: halfway through backward it is not yet whole.
        halfway, = [sample["grads_and_other"] for sample in r[key]["samples"]
                    if sample["where"] == "backward reaches blocks.3"]
        assert halfway < shard, (key, halfway, shard)
    # ZeRO-3: the parameter shard, plus one gathered block (two while the next one is prefetched).
    assert most[(3, False)]["params"] == shard + largest
    assert shard + largest <= most[(3, True)]["params"] <= shard + 2 * largest < full
    # ZeRO-2: the full parameters and the shard they are gathered from, from the step's end through forward; in
    # backward each block's full parameters are freed once its gradient is reduced (at the embedding's backward only
    # the shared unit is still whole), and the step's end gathers them all again.
    z2 = {sample["where"]: sample["params"] for sample in r[(2, True)]["samples"]}
    assert all(held == full + shard for where, held in z2.items() if "forward" in where or "step" in where), z2
    assert z2["backward reaches blocks.5"] > z2["backward reaches blocks.0"] + 2 * largest, z2  # 5 blocks freed
    assert shard < z2["backward reaches tok_emb"] < shard + largest, z2
    for key in ((2, True), (3, True), (3, False)):  # and the strategy's own ledger saw no less than the storages held
        assert most[key]["params"] <= r[key]["ledger_peak"]["params"], key


def _tied(topo):
    return {(zero, accum): _train(topo, zero, "float64", 4 // accum, accum, **{"model.tie_weights": True})
            for zero in (0, 2, 3) for accum in (1, 2)}


def test_tied_embedding_and_head_shard_through_the_shared_unit():
    r = run_ranks(_tied, 2)[0]
    for accum in (1, 2):  # accumulation re-gathers the shared unit for every micro-batch
        ref = _plain(2, 4 // accum, accum, **{"model.tie_weights": True})
        for zero in (0, 2, 3):
            _assert_follows(ref, r[(zero, accum)], f"ZeRO-{zero}, {accum} micro-batches, tied weights")


def _forward_twice_then_backward(zero):
    trainer = Trainer(_config(1, zero, **{"model.tie_weights": True}), Topology.single())
    s = trainer.strategy
    s.zero_grad()
    x, y = trainer.loader.next_batch()
    first = s.module(x, y)
    with torch.no_grad():  # e.g. an evaluation between forward and backward frees every unit
        s.module(x)
    second = s.module(x, y)  # two graphs alive at once
    (first + second).backward()
    s.step(1e-2)
    return s.full_params(), s.ledger.transient["params"]


def test_zero3_backward_after_a_no_grad_forward_and_two_graphs_alive():
    expected, _ = _forward_twice_then_backward(0)
    got, still_gathered = _forward_twice_then_backward(3)
    assert _max_diff(got, expected) <= 1e-12 and still_gathered == 0


def test_zero3_forward_without_grad_gives_the_same_logits_and_frees_every_block():
    cfg = _config(1, 3, **{"model.tie_weights": True})
    dp, z3 = Trainer(_config(1, 0, **{"model.tie_weights": True}), Topology.single()), Trainer(cfg, Topology.single())
    x, _ = dp.loader.next_batch()
    with torch.no_grad():
        expected, got = dp.model(x), z3.model(x)
    assert torch.equal(got, expected)
    assert all(p.untyped_storage().nbytes() == 0 for p in z3.model.parameters())
    assert z3.strategy.ledger.transient["params"] == 0


@pytest.mark.parametrize("zero", [2, 3])
def test_a_parameter_without_gradient_is_named(zero):
    trainer = Trainer(_config(1, zero), Topology.single())
    trainer.model.ln_f.forward = lambda x: x  # ln_f's parameters no longer reach the loss
    with pytest.raises(RuntimeError, match="ln_f.weight, ln_f.bias"):
        trainer.train_step()


def _ours_and_peer(topo, dtype):
    out = {}
    for peer, zero in STAGE_OF.items():
        cfg = _config(topo.world_size, zero, dtype, steps=10)
        ours = Trainer(cfg, topo)
        theirs = PeerTrainer(cfg, topo, peer)
        out[peer] = ([ours.train_step().loss for _ in range(10)], [theirs.train_step() for _ in range(10)])
    return out


@pytest.mark.parametrize("dtype,atol", [("float32", 1e-6), ("float64", 1e-12)])
def test_every_stage_matches_its_pytorch_peer(dtype, atol):
    # Stage 0 vs DDP, 1 vs ZeroRedundancyOptimizer, 2 vs FSDP2 without resharding after forward, 3 vs FSDP2.
    for peer, (ours, theirs) in run_ranks(_ours_and_peer, 2, dtype)[0].items():
        assert max(abs(a - b) for a, b in zip(ours, theirs)) <= atol, peer
        assert ours[-1] < ours[0]


def _save_then_continue(topo, root, zero, batch_size):
    trainer = Trainer(_config(topo.world_size, zero, batch_size=batch_size, steps=6), topo)
    for _ in range(3):
        trainer.train_step()
    path = trainer.save_checkpoint(root)
    losses = [trainer.train_step().loss for _ in range(3)]
    return str(path), losses, trainer.strategy.full_params()


def _load_then_continue(topo, path, zero, batch_size, root):
    trainer = Trainer(_config(topo.world_size, zero, batch_size=batch_size, steps=6), topo)
    trainer.load_checkpoint(path)
    again = trainer.save_checkpoint(root)  # this layout's shards, gathered back through its own manifest
    losses = [trainer.train_step().loss for _ in range(3)]
    return str(again), trainer.step, losses, trainer.strategy.full_params()


@pytest.mark.parametrize("saved_as,loaded_as", [((2, 1, 4), (1, 0, 8)), ((2, 1, 4), (4, 3, 2)),
                                                ((4, 3, 2), (1, 0, 8)), ((3, 2, 4), (2, 3, 6))],
                         ids=["zero1x2-to-dp1", "zero1x2-to-zero3x4", "zero3x4-to-dp1", "zero2x3-to-zero3x2"])
def test_checkpoints_move_between_stages_and_world_sizes(tmp_path, saved_as, loaded_as):
    from minitrain import checkpoint

    # (world, zero, batch per rank); the global batch stays equal so the data order continues.
    (world, zero, batch), (world2, zero2, batch2) = saved_as, loaded_as
    path, losses, params = run_ranks(_save_then_continue, world, str(tmp_path / "a"), zero, batch)[0]
    again, step, losses2, params2 = run_ranks(_load_then_continue, world2, path, zero2, batch2, str(tmp_path / "b"))[0]
    # The state as loaded (parameters, master, Adam m and v) equals the source in every element.
    source = checkpoint.assemble_flat(*checkpoint.verify(path))
    loaded = checkpoint.assemble_flat(*checkpoint.verify(again))
    assert set(loaded) <= set(source) and "optim.exp_avg_sq" in loaded
    for key, value in loaded.items():
        assert torch.equal(value, source[key]), key
    # ...and training continues the same: float64, the mean over ranks summed in another order.
    assert step == 6
    assert max(abs(a - b) for a, b in zip(losses, losses2)) <= 1e-12
    assert _max_diff(params, params2) <= 1e-12


def test_cli_memory_profile_prints_the_table_and_writes_memory_json(tmp_path):
    import json

    from tests.helpers.dist import run_cli, run_main

    out = tmp_path / "z3"
    proc = run_cli("train", "--nproc", "2", "--zero", "3", "--steps", "3", "--memory-profile", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "Memory per rank, bytes: ZeRO-3, N = 2" in proc.stdout
    assert proc.stdout.count(" yes ") == 6  # 2 ranks x (params, grads, optimizer) equal the formula
    report = json.loads((out / "memory.json").read_text())
    assert report["stage"] == 3 and all(r["at_rest_equals_formula"] for r in report["ranks"])
    rank0 = report["ranks"][0]
    assert rank0["at_rest"]["params"] == 4 * report["padded_params"] // 2
    assert rank0["peak_in_step"]["params"] > rank0["at_rest"]["params"]  # a gathered block on top of the shard
    bad = run_main("train", "--zero", "4", "--out", str(tmp_path / "bad"))  # refused before any rank
    assert bad.returncode == 2 and "train.zero must be one of 0, 1, 2, 3" in bad.stderr
    assert not (tmp_path / "bad").exists()



def _update_skipped_through_step(topo):
    """The trainer's ZeRO-2 (each block freed once its gradient is reduced) through strategy.step() with non-finite
    gradients: the update is skipped, and the parameters are whole again all the same."""
    trainer = Trainer(_config(topo.world_size, 2, "float64"), topo)
    trainer.train_step()
    model, strategy = trainer.model, trainer.strategy
    before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    (model(torch.zeros(1, 8, dtype=torch.long)).sum() * float("nan")).backward()
    freed = sum(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    norm = strategy.step(1e-3)  # the fused kernel skips it on the device: the norm is not read first
    after = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    return type(strategy).__name__, freed, norm, before, after


def test_zero2_whole_between_steps_after_a_skipped_update():
    for name, freed, norm, before, after in run_ranks(_update_skipped_through_step, 2):
        assert name == "ShardedUnits" and freed > 0 and math.isnan(norm)
        assert torch.equal(before, after)
