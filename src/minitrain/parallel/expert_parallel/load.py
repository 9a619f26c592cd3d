"""What a mixture-of-experts layer counts of its routing between two reads: the trainer logs it each step
(models/spec.py: CountsExpertLoad), a user's loop reads it through minitrain.moe_stats (api/moe_stats.py)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ExpertLoad:
    """What a mixture-of-experts layer counted over the training forwards since it was last asked."""

    load: list[float]  # the slots (token x choice) each expert received
    dropped: float = 0.0  # the slots dropped over capacity
    # The sum over those forwards of the router's auxiliary losses as the gradient carries them (coefficients
    # applied): a float, or a 0-dim tensor kept on the device until the step's exchange reads it.
    router_loss: float | object = 0.0
    forwards: int = 0  # how many forwards the sums cover

    def mean_router_loss(self):
        """The router loss per forward (0 when none was counted)."""
        return self.router_loss / self.forwards if self.forwards else 0.0


def imbalance(loads: list[list[float]]) -> float:
    """The busiest expert's slots over the mean, at the worst layer (1.0 is perfectly balanced); per layer, each
    expert's slots."""
    return max((max(layer) * len(layer) / sum(layer) for layer in loads if sum(layer)), default=0.0)


def dropped_share(loads: list[list[float]], dropped: list[float]) -> float:
    """The share of all slots dropped over capacity."""
    slots = sum(sum(layer) for layer in loads)
    return sum(dropped) / slots if slots else 0.0
