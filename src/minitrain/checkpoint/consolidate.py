"""A checkpoint's model as the model's own state_dict: exactly its keys, whole shapes and dtypes, whatever world size,
ZeRO stage or dp x tp x pp layout wrote it (what `minitrain ckpt consolidate` and `minitrain export` write)."""
from __future__ import annotations

import torch

from ..parallel.state.placement import check_state
from .files import read_tensor, verify
from .format import CheckpointError
from .reading import assemble_flat


def consolidated_state_dict(path: str) -> dict[str, torch.Tensor]:
    """The checkpoint's model as its own state_dict (each tensor its own copy), keys in the model's order."""
    step_dir, manifest = verify(path)
    params = assemble_flat(step_dir, manifest)["params"]
    by_param = {}
    for seg in manifest["flat"]["segments"]:
        n = 1
        for d in seg["shape"]:
            n *= d
        by_param[seg["name"]] = params[seg["offset"]:seg["offset"] + n].view(seg["shape"])
    stored = {t["key"]: t["file"] for t in manifest["tensors"] if t["key"].startswith("model.")}
    state = {}
    for entry in manifest["state_dict"]:
        key = entry["key"]
        if "param" in entry and entry["param"] in by_param:
            state[key] = by_param[entry["param"]].clone()  # tied weights: two keys, two copies (no aliases in files)
        elif entry.get("tensor") in stored:
            state[key] = read_tensor(step_dir / stored[entry["tensor"]], entry["tensor"])
        else:
            raise CheckpointError(f"checkpoint {step_dir} has no tensor for '{key}'")
    # The result is checked against the model's own state_dict as the save recorded it (names, whole shapes,
    # dtypes): a slice or a stray tensor is an error naming its key, never a file.
    check_state(state, {e["key"]: (e["shape"], e["dtype"]) for e in manifest["state_dict"]},
                f"checkpoint {step_dir} consolidated", CheckpointError)
    return state
