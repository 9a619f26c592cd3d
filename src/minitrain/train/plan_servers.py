"""`minitrain plan --servers S`: what parameter servers cost per step, against a ring all-reduce of the same gradient
(parallel/param_server/param_server.py runs them; docs/param-server.md derives this).

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


def render(s: dict, human_bytes) -> list[str]:
    """The summary as text lines."""
    held = s["bytes_per_server"]
    needed = ("no number of servers beats it on these links: a worker's link carries its gradient, then the "
              "parameters, where a ring's carries 2(W-1)/W of the gradient" if s["servers_needed"] is None
              else f"the fewest servers that would beat it: {s['servers_needed']} (each server's link carries W/S "
              "of every worker's bytes, each server adds a message latency)")
    faster = "faster" if s["push_pull_s"] < s["ring_all_reduce_s"] else "slower"
    return ["", f"Parameter servers: {s['workers']} worker(s), {s['servers']} server(s), staleness bound K = "
                f"{s['staleness']}",
            f"push + pull {1e3 * s['push_pull_s']:.2f} ms per step, {faster} than a ring all-reduce of the same "
            f"gradient over the workers ({1e3 * s['ring_all_reduce_s']:.2f} ms); {needed}",
            f"each server holds {human_bytes(sum(held.values()))}: parameters {human_bytes(held['params'])}, "
            f"optimizer {human_bytes(held['optimizer'])}, gradients waiting for their step "
            f"{human_bytes(held['held_gradients'])}; a worker holds no optimizer state"]
