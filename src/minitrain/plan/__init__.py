"""The memory/time planner behind `minitrain plan`: will a model and a layout fit, and how long will a step take,
before anything is launched.

hardware.py  the machines (presets from datasheets, or this one measured)
inputs.py    what a plan is asked about, and the sizes it derives (P as laid out, bytes per element)
memory.py    bytes per rank, by kind, and the transients at each moment of a step
step_time.py FLOPs, each collective's alpha-beta time
servers.py   what parameter servers cost against a ring all-reduce
predict.py   plan(): all of it as one dict, which the `plan` command renders (apps/plan.py)

It sits above train/: its figures are those of train's optimizer (the chunk it upcasts at once) and of the
strategies, and it imports them rather than restating them.
"""
from ..models.size import model_params, model_units
from .hardware import GB, PRESETS, Hardware, Link, cpu_here
from .inputs import PlanInput, element_bytes, layout_params, padded_params, reduce_bytes, shard_ranks
from .memory import (activation_bytes, gathered_bytes, layer_activation_bytes, logprob_bytes, loss_backward_bytes,
                     model_state_bytes, offloaded_bytes, update_transients)
from .predict import context_needed, plan
from .step_time import communication, flops_per_token

__all__ = ["GB", "PRESETS", "Hardware", "Link", "PlanInput", "activation_bytes", "communication", "context_needed",
           "cpu_here",
           "element_bytes", "flops_per_token", "gathered_bytes", "layer_activation_bytes", "layout_params",
           "logprob_bytes", "loss_backward_bytes", "model_params", "model_state_bytes", "model_units",
           "offloaded_bytes", "padded_params", "plan", "reduce_bytes", "shard_ranks", "update_transients"]
