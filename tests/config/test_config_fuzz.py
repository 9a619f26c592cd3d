"""Whatever value a setting is given on the command line, `minitrain train` either accepts a config it can
run (every number finite, everything JSON can hold) or refuses it with one line (exit 2), before anything
starts: never a traceback, and never a run that fails later on a value it should have refused."""
import json
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from minitrain.apps.cli import build_parser, resolve_config
from minitrain.config import ConfigError, field_specs
from minitrain.runtime.launch import check_local_ranks

# Settings that name files, or whose values start faults on purpose, are left to their own tests.
KEYS = sorted(key for key, *_ in field_specs() if not key.startswith(("fault.", "data.corpus", "ckpt.resume", "out")))
VALUES = (st.sampled_from(["nan", "inf", "-inf", "1e400", "-1", "0", "1", "2", "3.5", "", "true", "x", "1e-320",
                           str(2**63), "fp16", "bf16", "gloo", "nccl", "selective", "block"])
          | st.integers(-2**40, 2**40).map(str) | st.floats().map(repr) | st.text(max_size=8))




@settings(max_examples=300, deadline=None)
@given(choices=st.lists(st.tuples(st.sampled_from(KEYS), VALUES), min_size=1, max_size=3))
def test_any_setting_values_give_a_runnable_config_or_one_line_exit_2(choices, tmp_path_factory):
    argv = ["train", "--out", str(tmp_path_factory.mktemp("fuzz") / "run")]
    argv += [f"--{key}={value}" for key, value in choices]  # `=`: a value may start with "-"
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse itself: exit 2 with its usage line
        assert e.code == 2
        return
    try:
        cfg = resolve_config(args)
        check_local_ranks(cfg.dist.nproc)
    except ConfigError as e:
        assert "\n" not in str(e), str(e)
        return
    values = cfg.to_dict()
    json.dumps(values, allow_nan=False)  # finite: a manifest and metrics.jsonl can hold it
    for key, kind, _, _ in field_specs():
        if kind is float:
            section, _, name = key.rpartition(".")
            assert math.isfinite((values[section] if section else values)[name]), key
