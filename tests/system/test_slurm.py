"""examples/slurm/train.sbatch on a one-node Slurm cluster that the test starts itself.

slurmctld and slurmd run as children of the test from a slurm.conf in a temporary directory (this
machine is the only node; its own ports, state and spool directories), and are stopped afterwards
with every process of theirs. Needs root and the Slurm daemons and clients on PATH (Debian/Ubuntu:
`apt-get install --no-install-recommends slurmctld slurmd slurm-client`); skipped otherwise.
Authentication is auth/none where the installed Slurm still has it, else a munged the test starts
with a key of its own.

- a short run (2 ranks, 4 steps) completes with exit 0, checkpoints and the `done:` line;
- the time-limit warning (SIGUSR1 to the batch shell, which is what `--signal=B:USR1@120` sends)
  makes every rank save and exit 0, the job requeue itself, and the requeued job resume from that
  checkpoint and finish the run.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minitrain import checkpoint
from minitrain.runtime.launch import free_port

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "slurm" / "train.sbatch"
DAEMONS = ("slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "scancel", "sinfo", "squeue")
PLUGIN_DIRS = ("/usr/lib/*/slurm-wlm", "/usr/lib/*/slurm", "/usr/lib64/slurm", "/usr/lib/slurm",
               "/usr/local/lib/slurm", "/usr/local/lib64/slurm", "/opt/slurm/lib/slurm")
START_TIMEOUT_S = 30.0
JOB_TIMEOUT_S = 120.0
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                "DEADLINE", "PREEMPTED"}


def _why_not() -> str | None:
    if not sys.platform.startswith("linux"):
        return "Slurm test runs on Linux only"
    missing = [b for b in (*DAEMONS, *CLIENTS) if shutil.which(b) is None]
    if missing:
        return (f"Slurm not installed ({', '.join(missing)} not on PATH); "
                "apt-get install --no-install-recommends slurmctld slurmd slurm-client")
    if os.geteuid() != 0:
        return "the Slurm test starts slurmctld and slurmd, which needs root"
    return None


def _plugin_dir() -> Path | None:
    for pattern in PLUGIN_DIRS:
        for d in sorted(glob.glob(pattern)):
            if glob.glob(os.path.join(d, "auth_*.so")):
                return Path(d)
    return None


def _clean_env(conf: Path) -> dict:
    """The environment for Slurm commands: ours, without any Slurm job this test itself may run in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
    env["SLURM_CONF"] = str(conf)
    return env


class Cluster:
    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = _clean_env(self.conf)
        self.procs: dict[str, subprocess.Popen] = {}
        self.jobs: list[str] = []

    # -- setting up ---------------------------------------------------------------------------
    def write_conf(self, node_line: str, node: str, auth: list[str]) -> None:
        r = self.root
        self.conf.write_text("\n".join([
            "ClusterName=minitrain-test",
            f"SlurmctldHost={node}",
            *auth,
            "SlurmUser=root",
            "SlurmdUser=root",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",  # no cgroups needed
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/builtin",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "ReturnToService=2",
            "KillWait=10",
            "MinJobAge=600",  # finished jobs stay visible to `scontrol show job`
            f"{node_line} NodeAddr=127.0.0.1 State=UNKNOWN",
            f"PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP",
        ]) + "\n")

    def spawn(self, name: str, argv: list[str]) -> None:
        with open(self.root / "log" / f"{name}.out", "wb") as log:
            self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                env=self.env, start_new_session=True)

    def start_munge(self) -> list[str]:
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        sock = self.root / "munge.sock"
        self.spawn("munged", ["munged", "--foreground", "--force", f"--key-file={key}", f"--socket={sock}",
                              f"--pid-file={self.root / 'munged.pid'}", f"--seed-file={self.root / 'munged.seed'}",
                              f"--log-file={self.root / 'log' / 'munged.log'}"])
        deadline = time.monotonic() + 10
        while not sock.exists():
            if self.procs["munged"].poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"munged did not start:\n{self.logs()}", pytrace=False)
            time.sleep(0.1)
        return ["AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={sock}"]

    def start(self) -> None:
        plugins = _plugin_dir()
        if plugins is None:
            pytest.skip(f"no Slurm plugin directory found (looked in {', '.join(PLUGIN_DIRS)})")
        node_line = subprocess.run(["slurmd", "-C"], capture_output=True, check=False, text=True, env=self.env,
                                   timeout=30).stdout.splitlines()[0]  # NodeName=... CPUs=... RealMemory=...
        node = re.match(r"NodeName=(\S+)", node_line).group(1)
        for d in ("state", "spool", "log"):
            (self.root / d).mkdir()
        try:
            socket.gethostbyname(node)  # the rendezvous endpoint is this name
        except OSError:
            pytest.skip(f"this machine's name {node!r} does not resolve")
        if (plugins / "auth_none.so").exists() and (plugins / "cred_none.so").exists():
            auth = ["AuthType=auth/none", "CredType=cred/none"]
        elif (plugins / "auth_munge.so").exists() and shutil.which("munged"):
            auth = self.start_munge()
        else:
            pytest.skip(f"Slurm in {plugins} has neither auth/none nor auth/munge with munged on PATH")
        self.write_conf(node_line, node, [f"PluginDir={plugins}", *auth])
        self.spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self.spawn("slurmd", ["slurmd", "-D", "-f", str(self.conf), "-N", node])
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            state = self.cmd("sinfo", "-h", "-o", "%T", check=False).stdout.strip()
            if state == "idle":
                return
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                pytest.fail(f"Slurm did not come up ({', '.join(dead) or 'node ' + repr(state)}):\n{self.logs()}",
                            pytrace=False)
            time.sleep(0.2)

    # -- using it -----------------------------------------------------------------------------
    def cmd(self, *argv: str, check: bool = True, cwd=None, env=None) -> subprocess.CompletedProcess:
        proc = subprocess.run(argv, capture_output=True, text=True, env=env or self.env, cwd=cwd, timeout=60, check=False)
        if check and proc.returncode:
            pytest.fail(f"`{' '.join(argv)}` exited {proc.returncode}: {proc.stderr}\n{self.logs()}", pytrace=False)
        return proc

    def submit(self, cwd: Path, **env: str) -> str:
        job = self.cmd("sbatch", "--parsable", "--nodes=1", "--time=5", str(SCRIPT), cwd=cwd,
                       env={**self.env, **env}).stdout.strip().split(";")[0]
        self.jobs.append(job)
        return job

    def job(self, job: str) -> dict:
        line = self.cmd("scontrol", "show", "job", "-o", job).stdout
        return {k: re.search(rf"\b{k}=(\S*)", line).group(1) for k in ("JobState", "ExitCode", "Restarts")}

    def wait(self, job: str, until, what: str, output: Path, timeout_s: float = JOB_TIMEOUT_S) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.job(job)
            if until(info):
                return info
            if info["JobState"] in FINAL_STATES or time.monotonic() > deadline:
                pytest.fail(f"job {job}: waited for {what}, got {info}\n{_read(output)}\n{self.logs()}",
                            pytrace=False)
            time.sleep(0.2)

    def logs(self) -> str:
        parts = []
        for f in sorted((self.root / "log").glob("*")):
            lines = f.read_text(errors="replace").splitlines()[-15:]
            parts.append(f"--- {f.name} (end) ---\n" + "\n".join(lines))
        return "\n".join(parts)

    # -- tearing down -------------------------------------------------------------------------
    def stop(self) -> None:
        if self.jobs and self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            subprocess.run(["scancel", *self.jobs], env=self.env, capture_output=True, timeout=30, check=False)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                q = subprocess.run(["squeue", "-h", "-o", "%i"], env=self.env, capture_output=True, check=False, text=True,
                                   timeout=30)
                if q.returncode or not q.stdout.strip():
                    break
                time.sleep(0.2)
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        # Anything left that this cluster started (slurmstepd, a job's processes) carries its SLURM_CONF.
        mark = f"SLURM_CONF={self.conf}".encode()
        for env_file in Path("/proc").glob("[0-9]*/environ"):
            pid = int(env_file.parent.name)
            try:
                if pid != os.getpid() and mark in env_file.read_bytes().split(b"\0"):
                    os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else f"({path} not written)"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    why = _why_not()
    if why:
        pytest.skip(why)
    cluster = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def _env(**extra: str) -> dict:
    """The script's knobs, shrunk: this interpreter, 2 CPU ranks, no torchrun restarts (fail fast)."""
    return {"PYTHON": sys.executable, "NPROC_PER_NODE": "2", "RDZV_PORT": str(free_port()), "MAX_RESTARTS": "0",
            **extra}


@pytest.mark.multirank  # srun's torchrun starts the ranks, not the harness
def test_a_short_run_completes_with_checkpoints(slurm, tmp_path):
    job = slurm.submit(tmp_path, **_env(CKPT_EVERY="2", TRAIN_ARGS="--steps 4 --backend gloo"))
    output = tmp_path / f"slurm-minitrain-{job}.out"
    info = slurm.wait(job, lambda i: i["JobState"] in FINAL_STATES, "the end", output)
    log = _read(output)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log
    assert "done: 4 steps on 2 rank(s)" in log, log
    out = tmp_path / "runs" / "minitrain"  # the script's default: $SLURM_SUBMIT_DIR/runs/$SLURM_JOB_NAME
    assert checkpoint.verify(out / "checkpoints")[1]["step"] == 4
    assert (out / "checkpoints" / "step-000002").is_dir()  # --ckpt-every-steps came through
    assert (out / "metrics.jsonl").is_file()


@pytest.mark.multirank  # srun's torchrun starts the ranks, not the harness
def test_the_time_limit_warning_saves_requeues_and_resumes(slurm, tmp_path):
    # Every step of the first attempt sleeps 50 ms (--fault.kind slow, which never fires in a resumed
    # run), so the warning lands mid-run; the requeued attempt runs the rest at full speed.
    job = slurm.submit(tmp_path, **_env(
        CKPT_EVERY="50", MAX_REQUEUES="1",
        TRAIN_ARGS="--steps 200 --backend gloo --train.log_every 10 --fault.kind slow --fault.step 1 "
                   "--fault.slow_s 0.05"))
    output = tmp_path / f"slurm-minitrain-{job}.out"
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not re.search(r"step\s+10/200", _read(output)):
        info = slurm.job(job)
        if info["JobState"] in FINAL_STATES or time.monotonic() > deadline:
            pytest.fail(f"job {job} never reached step 10: {info}\n{_read(output)}\n{slurm.logs()}", pytrace=False)
        time.sleep(0.2)
    # What `#SBATCH --signal=B:USR1@120` does 120 s before the time limit.
    slurm.cmd("scancel", "--batch", "--signal=USR1", job)
    slurm.wait(job, lambda i: i["Restarts"] == "1" and i["JobState"] == "PENDING", "the requeue", output)
    # Slurm holds a requeued job back for about two minutes; start it now instead. Not at once: slurmd
    # refuses to launch a job whose credential was revoked (by the requeue) in the same second
    # ("Job credential revoked").
    time.sleep(2)
    slurm.cmd("scontrol", "update", f"JobId={job}", "StartTime=now")
    info = slurm.wait(job, lambda i: i["Restarts"] == "1" and i["JobState"] in FINAL_STATES, "the requeued end",
                      output)
    log = _read(output)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log
    # The signal reaches each rank when it does: whichever had it by a step's exchange are named; all stop there.
    stopped = re.search(r"SIGUSR1 received by rank \[[0-9, ]+\]: stopped after step (\d+)", log)
    assert stopped, log
    step = int(stopped.group(1))
    assert 10 <= step < 200, log
    assert "srun exited with status 0\nrequeueing job" in log, log  # torchrun exited 0: it ignored SIGUSR1
    assert f"resumed from {tmp_path / 'runs' / 'minitrain' / 'checkpoints' / checkpoint.step_dir_name(step)} " \
           f"at step {step}" in log, log
    assert "done: 200 steps on 2 rank(s)" in log, log
    assert checkpoint.verify(tmp_path / "runs" / "minitrain" / "checkpoints")[1]["step"] == 200
