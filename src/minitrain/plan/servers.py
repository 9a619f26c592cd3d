"""`minitrain plan --servers S`: what parameter servers cost per step, against a ring all-reduce of the same gradient
(parallel/param_server/ runs them; docs/param-server.md derives this).

Each worker pushes its whole gradient (M bytes: a 1/S shard to each server) and pulls the whole parameter vector
(P bytes); each server receives W x M / S and sends W x P / S. On links of one bandwidth beta each, the busiest link
sets the time: max(M, W M / S) / beta to push and the same with P to pull, each after S message latencies, one after
the other (a server answers once the step's update is applied). A ring all-reduce moves 2 (W-1)/W x M through every
link, in 2 (W-1) steps in sequence.
"""
from __future__ import annotations


def _transfer_s(alpha_s: float, beta_Bps: float, messages: int, busiest_bytes: float) -> float:
    return messages * alpha_s + busiest_bytes / beta_Bps


def traffic(workers: int, servers: int, grad_bytes: float, param_bytes: float, alpha_s: float,
            beta_Bps: float) -> list[dict]:
    """The push and the pull of one step, as the planner's communication rows (bytes: this worker's)."""
    load = max(1.0, workers / servers)  # the busiest link's bytes per byte a worker sends
    return [{"what": f"push gradients to {servers} server(s)", "op": "send", "bytes": int(grad_bytes),
             "seconds": _transfer_s(alpha_s, beta_Bps, servers, load * grad_bytes), "calls": servers},
            {"what": f"pull parameters from {servers} server(s)", "op": "send", "bytes": int(param_bytes),
             "seconds": _transfer_s(alpha_s, beta_Bps, servers, load * param_bytes), "calls": servers}]


def ring_all_reduce_s(workers: int, grad_bytes: float, alpha_s: float, beta_Bps: float) -> float:
    if workers == 1:
        return 0.0
    return 2 * (workers - 1) * alpha_s + 2 * (workers - 1) / workers * grad_bytes / beta_Bps


def servers_needed(workers: int, grad_bytes: float, param_bytes: float, alpha_s: float, beta_Bps: float,
                   most: int = 4096) -> int | None:
    """The fewest servers whose push and pull take less than the ring all-reduce over the workers (None: no count
    up to `most` does: where the parameters cost as much to pull as the gradient to reduce, a ring moves less)."""
    ring = ring_all_reduce_s(workers, grad_bytes, alpha_s, beta_Bps)
    for servers in range(1, most + 1):
        if sum(r["seconds"] for r in traffic(workers, servers, grad_bytes, param_bytes, alpha_s, beta_Bps)) < ring:
            return servers
    return None


def server_state_bytes(params: int, servers: int, workers: int, staleness: int, param_elem: int,
                       reduce_elem: int) -> dict[str, int]:
    """Bytes one server holds: its shard of the parameters (what it sends), of the optimizer (master and Adam's
    two moments, float32), and the gradients it keeps until a step's are all in: up to K + 1 steps of each
    worker's shard."""
    shard = params / servers
    return {"params": round(param_elem * shard), "optimizer": round(12 * shard),
            "held_gradients": round((staleness + 1) * workers * reduce_elem * shard)}


def summary(workers: int, servers: int, staleness: int, params: int, grad_bytes: float, param_bytes: float,
            param_elem: int, reduce_elem: int, alpha_s: float, beta_Bps: float) -> dict:
    rows = traffic(workers, servers, grad_bytes, param_bytes, alpha_s, beta_Bps)
    return {"workers": workers, "servers": servers, "staleness": staleness,
            "push_pull_s": sum(r["seconds"] for r in rows),
            "ring_all_reduce_s": ring_all_reduce_s(workers, grad_bytes, alpha_s, beta_Bps),
            "servers_needed": servers_needed(workers, grad_bytes, param_bytes, alpha_s, beta_Bps),
            "bytes_per_server": server_state_bytes(params, servers, workers, staleness, param_elem, reduce_elem)}
