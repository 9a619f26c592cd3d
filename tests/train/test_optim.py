import math

import torch

from minitrain.config import PRESETS, ModelConfig, TrainConfig
from minitrain.models.minigpt.model import MiniGPT
from minitrain.parallel.core.norms import clip_coefficient
from minitrain.train.optim import FlatAdamW, lr_at
from minitrain.parallel.core.flat_parameters import FlatParameters


def test_flat_adamw_matches_torch_adamw_in_float64():
    cfg = TrainConfig(lr=1e-2, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8)
    torch.manual_seed(0)
    ours = MiniGPT(ModelConfig(**PRESETS["tiny"])).double()
    ref = MiniGPT(ModelConfig(**PRESETS["tiny"])).double()
    ref.load_state_dict(ours.state_dict())
    flat = FlatParameters(ours, world_size=3)  # padded: exercises the tail
    opt = FlatAdamW(flat.data.clone(), flat.decay_ranges(), (cfg.beta1, cfg.beta2), cfg.eps, cfg.weight_decay)
    decay = [p for p in ref.parameters() if p.dim() >= 2]
    no_decay = [p for p in ref.parameters() if p.dim() < 2]
    torch_opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    for step in range(5):
        x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(step))
        flat.grad.zero_()
        ours(x, x).backward()
        opt.step(flat.grad, lr=1e-2)
        flat.data.copy_(opt.master)
        torch_opt.zero_grad()
        ref(x, x).backward()
        torch_opt.step()
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=name)
    assert torch.all(flat.data[flat.numel:] == 0)  # padding never moves


def test_lr_schedule_warms_up_then_decays_to_min():
    cfg = TrainConfig(lr=1.0, min_lr_ratio=0.1, warmup_steps=4, steps=20)
    assert [lr_at(s, cfg) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, cfg) == 1.0 and math.isclose(lr_at(19, cfg), 0.1)
    lrs = [lr_at(s, cfg) for s in range(4, 20)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_clip_coefficient():
    assert clip_coefficient(0.5, 1.0) == 1.0
    assert math.isclose(clip_coefficient(4.0, 1.0) * 4.0, 1.0, rel_tol=1e-6)
    assert clip_coefficient(1e9, 0.0) == 1.0  # 0 disables clipping


def test_the_device_side_skip_and_clip_equal_the_host_decisions_bit_for_bit():
    """found_inf and a tensor clip coefficient (no host read of the norm) give exactly what the host's float
    decisions give: the same update when finite, nothing at all when not."""
    from minitrain.parallel.core.norms import clip_coefficient_tensor

    for dtype in (torch.float64, torch.float32):
        torch.manual_seed(0)
        start, grad = torch.randn(3000, dtype=dtype), torch.randn(3000, dtype=dtype)
        host, device = (FlatAdamW(start.clone(), [(0, 2000)], weight_decay=0.1) for _ in range(2))
        for step in range(3):
            norm = grad.double().norm() * (step + 1)
            host.step(grad.clone(), 1e-2, clip_coefficient(float(norm), 1.0) / 4.0)
            device.step(grad.clone(), 1e-2, clip_coefficient_tensor(norm, 1.0) / 4.0,
                        found_inf=torch.zeros((), dtype=torch.float32))
            assert all(torch.equal(getattr(host, n), getattr(device, n)) for n in FlatAdamW.STATE_NAMES), dtype
        before = {n: getattr(device, n).clone() for n in FlatAdamW.STATE_NAMES}
        device.step(grad.clone() * float("nan"), 1e-2, torch.tensor(float("nan")), found_inf=torch.ones(()))
        assert all(torch.equal(getattr(device, n), before[n]) for n in FlatAdamW.STATE_NAMES), dtype
        assert device.steps_taken == host.steps_taken == 3  # the kernel took the skipped step back from its count
        host.step(grad.clone(), 1e-2)
        device.step(grad.clone(), 1e-2, found_inf=torch.zeros(()))
        assert all(torch.equal(getattr(host, n), getattr(device, n)) for n in FlatAdamW.STATE_NAMES), dtype


def test_a_narrower_gradient_is_upcast_and_scaled_in_one_pass_with_the_same_bits():
    """Mixed precision: the chunk that the fused kernel steps on is g * scale in float32, computed by one
    multiplication that upcasts as it reads; the same bits as upcasting first and scaling after, with the scale a
    Python float (the host's clip decision) or a float64 tensor (the device's), and none changed when the scale
    is 1 or the gradient already has the master's dtype."""
    torch.manual_seed(0)
    where = torch.device("cpu")
    for narrow in (torch.bfloat16, torch.float16):
        g = (torch.randn(5000) * 1e-3).to(narrow)
        for scale in (0.37, 1.0 / 1024, torch.tensor(0.123456789012345, dtype=torch.float64), 1.0):
            one_pass = FlatAdamW._scaled_chunk(g, torch.float32, where, scale)
            two_passes = g.to(torch.float32)
            two_passes.mul_(scale)
            assert one_pass.dtype == torch.float32 and torch.equal(one_pass, two_passes), (narrow, scale)
            assert one_pass.data_ptr() != g.data_ptr()
            kept = torch.full((6000,), float("nan"))  # an offloaded step's buffer, longer than the chunk
            into = FlatAdamW._scaled_chunk(g, torch.float32, where, scale, out=kept)
            assert into.data_ptr() == kept.data_ptr() and torch.equal(into, two_passes), (narrow, scale)
    full = torch.randn(100)
    assert FlatAdamW._scaled_chunk(full, torch.float32, where, 1.0) is full  # nothing to copy or scale
    expected = full * 0.5
    assert torch.equal(FlatAdamW._scaled_chunk(full, torch.float32, where, 0.5), expected)
    assert torch.equal(full, expected)  # scaled in place: the caller's buffer, done with


def test_the_decay_folded_into_the_fused_kernel_matches_torchs_fused_adamw_in_float64():
    """On a GPU the fused kernel applies the weight decay (fold_decay): the same bits as torch.optim.AdamW with
    fused=True, chunk boundaries falling inside decayed and undecayed ranges (a 1000-element chunk), a tail, and
    skip decisions on the device that leave everything untouched."""
    torch.manual_seed(0)
    ours_model = MiniGPT(ModelConfig(**PRESETS["tiny"])).double()
    ref = MiniGPT(ModelConfig(**PRESETS["tiny"])).double()
    ref.load_state_dict(ours_model.state_dict())
    flat = FlatParameters(ours_model, world_size=3)
    opt = FlatAdamW(flat.data.clone(), flat.decay_ranges(), (0.9, 0.95), 1e-8, 0.1, chunk=1000, fold_decay=True)
    assert any(len(calls) == 2 for calls in opt._calls)  # some chunk holds runs with and without decay
    decay = [p for p in ref.parameters() if p.dim() >= 2]
    no_decay = [p for p in ref.parameters() if p.dim() < 2]
    torch_opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=True)
    for step in range(4):
        x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(step))
        flat.grad.zero_()
        ours_model(x, x).backward()
        opt.step(flat.grad, lr=1e-2, found_inf=torch.zeros(()))
        flat.data.copy_(opt.master)
        torch_opt.zero_grad()
        ref(x, x).backward()
        torch_opt.step()
    before = {n: getattr(opt, n).clone() for n in FlatAdamW.STATE_NAMES}
    opt.step(flat.grad, lr=1e-2, found_inf=torch.ones(()))
    assert all(torch.equal(getattr(opt, n), before[n]) for n in FlatAdamW.STATE_NAMES)
    assert opt.steps_taken == 4 and len({float(c) for c in opt._steps}) == 1
    for (name, a), b in zip(ours_model.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), name
    assert torch.all(flat.data[flat.numel:] == 0)
