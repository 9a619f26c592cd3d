"""The examples/ scripts run as a user runs them, and do what their docstrings say."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.dist import run_cli, run_main

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _losses(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r"loss (\d+\.\d+)", stdout)]


def test_own_model_example_trains_saves_and_consolidates(tmp_path):
    out = tmp_path / "own"
    proc = subprocess.run([sys.executable, str(EXAMPLES / "own_model.py"), "--steps", "40", "--zero", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    losses = _losses(proc.stdout)
    assert losses[-1] < 0.25 * losses[0], proc.stdout
    consolidated = run_main("ckpt", "consolidate", str(out), str(tmp_path / "model.safetensors"))
    assert consolidated.returncode == 0, consolidated.stderr
    sys.path.insert(0, str(EXAMPLES))
    try:
        from own_model import TinyLM
    finally:
        sys.path.remove(str(EXAMPLES))
    model = TinyLM()
    state = load_file(str(tmp_path / "model.safetensors"))
    model.load_state_dict(state, strict=True)  # the persistent buffer included
    assert torch.equal(model.temperature, torch.tensor(1.0))


def test_the_readme_example_runs_as_written(tmp_path):
    """The README's first code block, as a user would paste it into a file and run it in one process."""
    pytest.importorskip("transformers")
    readme = (EXAMPLES.parent / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    (tmp_path / "script.py").write_text(code)
    proc = subprocess.run([sys.executable, "script.py"], cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "runs" / "llama" / "latest").read_text().strip() == "step-000030"


def test_hugging_face_llama_example_under_torchrun(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "llama"
    proc = run_cli(str(EXAMPLES / "hf_llama.py"), "--steps", "12", "--out", str(out), torchrun_nproc=2,
                   script=True, timeout_s=180)
    assert proc.returncode == 0, proc.stderr
    losses = _losses(proc.stdout)
    assert losses[-1] < losses[0], proc.stdout
    assert "tied head is the embedding: True" in proc.stdout
    assert (out / "latest").read_text().strip() == "step-000012"
