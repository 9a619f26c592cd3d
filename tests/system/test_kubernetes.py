"""examples/kubernetes/pytorchjob.yaml: read as Kubernetes would (YAML, anchors resolved), checked against what
minitrain and torchrun expect, and its command run as two local "Pods" (the operator's MASTER_ADDR on loopback,
the shared volume a temporary directory, the object store moto's S3 server, a tiny model)."""
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from minitrain.runtime.launch import free_port

yaml = pytest.importorskip("yaml")

MANIFEST = Path(__file__).resolve().parents[2] / "examples" / "kubernetes" / "pytorchjob.yaml"


@pytest.fixture(scope="module")
def job() -> dict:
    return yaml.safe_load(MANIFEST.read_text())


def _pods(job: dict) -> list[dict]:
    """One pod spec per Pod the operator makes: Master, then each Worker."""
    specs = job["spec"]["pytorchReplicaSpecs"]
    return [specs[kind]["template"]["spec"] for kind in ("Master", "Worker") for _ in range(specs[kind]["replicas"])]


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"]}


def test_every_pod_runs_the_same_torchrun_agent_sized_to_the_job(job):
    assert job["kind"] == "PyTorchJob" and job["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"] == 1
    pods = _pods(job)
    assert all(pod == pods[0] for pod in pods)  # one command for every Pod: torchrun tells them apart
    [container] = pods[0]["containers"]
    env = _env(container)
    assert int(env["NNODES"]) == len(pods)
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"  # a restarted Pod rejoins the rendezvous
    assert int(env["NPROC_PER_NODE"]) == int(container["resources"]["limits"]["nvidia.com/gpu"])
    script = container["args"][0]
    assert script.startswith("exec ")  # torchrun is PID 1: the Pod's SIGTERM reaches it
    for flag in ('--nnodes="$NNODES"', '--nproc-per-node="$NPROC_PER_NODE"', "--rdzv-backend=c10d",
                 '--rdzv-endpoint="$MASTER_ADDR:$RDZV_PORT"', '--rdzv-id="$RUN_NAME"', "--resume auto"):
        assert flag in script, flag
    # The grace period outlasts torchrun's wait for its saving ranks.
    assert pods[0]["terminationGracePeriodSeconds"] > int(env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]) >= 60
    # The run directory is on the volume every Pod mounts.
    [mount] = container["volumeMounts"]
    [volume] = [v for v in pods[0]["volumes"] if v["name"] == mount["name"]]
    assert "persistentVolumeClaim" in volume and f'--out "{mount["mountPath"]}/' in script
    assert all(job["spec"]["pytorchReplicaSpecs"][k]["restartPolicy"] == "OnFailure" for k in ("Master", "Worker"))
    # Checkpoints also go to object storage, its credentials from a Secret (AWS_* variables).
    assert env["CKPT_DIR"].startswith("s3://") and '${CKPT_DIR:+--ckpt.dir "$CKPT_DIR"}' in script
    assert {"secretRef": {"name": "minitrain-s3"}} in container["envFrom"]


def test_the_train_arguments_are_ones_minitrain_accepts(job):
    from minitrain.apps.cli import build_parser

    env = _env(_pods(job)[0]["containers"][0])
    argv = ["train", *shlex.split(env["TRAIN_ARGS"]), "--resume", "auto", "--ckpt-every-steps", env["CKPT_EVERY"],
            "--out", "/shared/runs/x"]
    build_parser().parse_args(argv)  # exits 2 on a flag minitrain does not know


@pytest.mark.multirank  # torchrun in each Pod starts the ranks, not the harness
def test_its_command_trains_as_two_local_pods_with_checkpoints_in_the_store(job, tmp_path):
    pytest.importorskip("s3fs", reason="s3fs is not installed (pip install 'minitrain[s3]')")
    pytest.importorskip("moto.server", reason="moto is not installed (the test extra installs it)")
    from minitrain.checkpoint import remote

    from tests.helpers.s3_server import s3_server

    with s3_server("k8s"):
        _two_pods(job, tmp_path, "s3://k8s/runs/x")
        assert remote.committed_steps("s3://k8s/runs/x") == [4, 2] and remote.latest_step("s3://k8s/runs/x") == 4


def _two_pods(job: dict, tmp_path: Path, ckpt_dir: str) -> None:
    [container] = _pods(job)[0]["containers"]
    mount = container["volumeMounts"][0]["mountPath"]
    script = container["args"][0].replace(f'"{mount}/', f'"{tmp_path}/')  # the shared volume, here
    env = {**os.environ, **_env(container),
           "MASTER_ADDR": "127.0.0.1",  # what the operator sets in every Pod
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # `python` is this one
           "RDZV_PORT": str(free_port()), "NPROC_PER_NODE": "1", "CKPT_EVERY": "2", "MAX_RESTARTS": "0",
           "CKPT_DIR": ckpt_dir,
           "TRAIN_ARGS": "--preset tiny --steps 4 --backend gloo --train.log_every 0"}
    pods = [subprocess.Popen([*container["command"], script], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True) for _ in range(2)]
    outputs = []
    for pod in pods:
        try:
            outputs.append(pod.communicate(timeout=150)[0])
        except subprocess.TimeoutExpired:
            for p in pods:
                os.killpg(p.pid, 9)
            pytest.fail("the two pods did not finish in 150 s")
    assert [p.returncode for p in pods] == [0, 0], outputs
    run = tmp_path / "runs" / _env(container)["RUN_NAME"]
    assert (run / "checkpoints" / "step-000004" / "manifest.json").is_file(), outputs
    assert "done: 4 steps on 2 rank(s)" in "".join(outputs)
