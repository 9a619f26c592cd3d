"""plan(): memory and time put together into one prediction, for `minitrain plan` and the benchmarks that
compare it with measurement."""
from __future__ import annotations

from dataclasses import asdict, replace

from ..parallel.pipeline_parallel.schedules import expected_bubble
from . import servers
from .inputs import PlanInput, element_bytes, layout_params, local_seq, reduce_bytes
from .memory import (activation_bytes, gathered_bytes, loss_backward_bytes, model_state_bytes, offloaded_bytes,
                     replay_bytes, update_transients)
from .step_time import communication, flops_per_token, server_link


def plan(inp: PlanInput) -> dict:
    """The whole prediction as one JSON-able dict: bytes per rank at the peak, whether it fits, FLOPs, each
    collective, the step's time and tokens per second (the `plan` command renders it)."""
    state = model_state_bytes(inp)
    acts, gathered = activation_bytes(inp), gathered_bytes(inp)
    in_backward, in_update = update_transients(inp)
    loss_grads = loss_backward_bytes(inp)
    # The peak is the largest of three moments: the loss's backward (forward's activations all alive, the
    # log-probabilities' gradients beside them; no layer replayed and no gradient reduced yet), the layers'
    # backward (a layer replayed, the gradient sync's float32 copy begun) and the update.
    transient = max(gathered + acts - replay_bytes(inp) + loss_grads, gathered + acts + in_backward, in_update)
    host, disk = offloaded_bytes(inp, state)
    total = sum(state.values()) - host - disk + transient
    hw = inp.hardware
    tokens_rank = inp.micro_batch * local_seq(inp) * inp.grad_accum * max(1, inp.microbatches)
    model_fpt, hw_fpt = flops_per_token(inp)
    flops_rank = hw_fpt * tokens_rank / (inp.tp * inp.pp)
    peak = hw.peak_flops[inp.precision]
    compute_s = flops_rank / (peak * inp.mfu)
    bubble = expected_bubble(inp.pp, inp.microbatches, inp.schedule, inp.virtual_stages) if inp.pp > 1 else 0.0
    comm = communication(inp)
    comm_s = sum(r["seconds"] for r in comm)
    step_s = compute_s / (1 - bubble) + comm_s
    global_tokens = tokens_rank * inp.dp * inp.cp
    on_servers = None
    if inp.servers:
        P, elem = layout_params(inp), element_bytes(inp.precision)
        link = server_link(inp)
        on_servers = servers.summary(inp.dp, inp.servers, inp.staleness, P, reduce_bytes(inp) * P, elem * P, elem,
                                       reduce_bytes(inp), link.alpha_s, link.beta_Bps)
    return {
        "input": {k: v for k, v in asdict(inp).items() if k not in ("model", "hardware")}
        | {"model": None if inp.model is None else asdict(inp.model), "hardware": hw.name},
        "world_size": inp.dp * inp.tp * inp.pp * inp.cp + inp.servers,
        "parameter_servers": on_servers,
        # total is the predicted peak: state at rest plus the largest of the three moments above
        "bytes_per_rank": {**state, "gathered": gathered, "activations": acts, "loss_backward": loss_grads,
                           "reduce_copy": in_backward,
                           "update": in_update, "total": total,
                           "host": host, "disk": disk},
        "device_memory_bytes": hw.memory_bytes,
        "fits": total <= hw.memory_bytes,
        "flops_per_token": model_fpt, "flops_per_token_with_recompute": hw_fpt,
        "flops_per_rank_step": flops_rank, "peak_flops": peak, "mfu": inp.mfu,
        "compute_s": compute_s, "pipeline_bubble": bubble, "communication": comm, "communication_s": comm_s,
        "step_s": step_s, "tokens_per_step": global_tokens, "tokens_per_s": global_tokens / step_s,
        "hardware_source": hw.source,
    }


def context_needed(inp: PlanInput, most: int = 64) -> int | None:
    """The smallest context-parallel degree (a power of two that cuts the sequence into 2 cp chunks, at most `most`)
    at which the plan fits the device, all else as given; None when none does. Context parallelism cuts the
    activations, not the model state, so a model too large for the device stays too large."""
    if inp.model is None:
        return None
    cp = 1
    while cp <= most and inp.model.seq_len % (2 * cp if cp > 1 else 1) == 0:
        if plan(replace(inp, cp=cp))["fits"]:
            return cp
        cp *= 2
    return None
