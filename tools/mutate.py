"""Mutation check: do the tests catch the bugs they exist for?

Each entry of tools/mutations.toml is a realistic one-line bug. Each is applied alone to a fresh scratch
copy of the repository whose src/ comes first on PYTHONPATH, so the mutated package shadows the editable
install in pytest and in every process the tests start (checked first, as is that the tests pass on the
unmutated copy); then its tests run there. Verdicts: caught (pytest failed), survived (it passed),
timeout (counted as caught: a hang fails the suite too), error (the tests could not run, e.g. exit 4).

    python tools/mutate.py              # all of them (`make mutate`); exit 1 unless all are caught
    python tools/mutate.py --list       # the list, and whether each entry still applies
    python tools/mutate.py --only ID... # some of them
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # the project supports 3.10, which has tomli (a dependency there) instead
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
LIST = Path(__file__).with_name("mutations.toml")
RESULTS = Path(__file__).with_name("mutation_results.json")
PACKAGE = Path("src/minitrain")
FIELDS = ("id", "file", "find", "replace", "why", "tests")
# pytest runs in a session of its own (so a timeout can end all it started), which Ctrl-C does not
# reach: main() ends these itself when interrupted.
RUNNING: set[subprocess.Popen] = set()

# Run inside the scratch copy: where does `minitrain` come from in this process, in a fresh interpreter
# (as `python -m minitrain` and torchrun's ranks start) and in ranks forked by the launcher's fork server?
PROBE = '''
import subprocess, sys
import minitrain
from minitrain.runtime.launch import launch

def where(_topo):
    import minitrain
    return minitrain.__file__

def main():
    child = subprocess.run([sys.executable, "-c", "import minitrain; print(minitrain.__file__)"],
                           capture_output=True, text=True, check=True).stdout.strip()
    for path in [minitrain.__file__, child, *launch(where, 2, backend="gloo", timeout_s=120)]:
        print(path)
'''


def load(path: Path = LIST) -> list[dict]:
    entries = tomllib.loads(path.read_text())["mutation"]
    for m in entries:
        missing = [f for f in FIELDS if f not in m]
        if missing or not isinstance(m["tests"], list) or not m["tests"] or m["find"] == m["replace"]:
            raise SystemExit(f"{path}: mutation {m.get('id', '?')} is malformed (missing {missing}, empty "
                             "tests, or find == replace)")
    ids = [m["id"] for m in entries]
    if len(set(ids)) != len(ids):
        raise SystemExit(f"{path}: duplicate ids {sorted({i for i in ids if ids.count(i) > 1})}")
    return entries


def stale_reason(m: dict, root: Path = ROOT) -> str | None:
    """Why the mutation no longer applies to the source or the tests as they are, or None."""
    # A selection names its test file first ("tests/x.py::test_y" or "tests/x.py -k EXPR"): a file that moved
    # would make pytest exit 4, an error, not a verdict.
    gone = [f for f in dict.fromkeys(shlex.split(s)[0].split("::")[0] for s in m["tests"]) if not (root / f).is_file()]
    if gone:
        return f"test file {', '.join(gone)} does not exist"
    path = root / PACKAGE / m["file"]
    if not path.is_file():
        return f"{PACKAGE / m['file']} does not exist"
    text = path.read_text()
    count = text.count(m["find"])
    if count != 1:
        return f"`find` occurs {count} times in {PACKAGE / m['file']} (must be once)"
    try:  # the source moved around the text (an indentation, a new enclosing block): the mutant would not compile
        compile(text.replace(m["find"], m["replace"], 1), str(path), "exec")
    except SyntaxError as e:
        return f"the mutated {PACKAGE / m['file']} does not compile: {e.msg} (line {e.lineno})"
    return None


def repo_files() -> list[str]:
    """Tracked files plus new ones git does not ignore (tests being written count), that exist."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, capture_output=True, check=True).stdout.decode()
    return [f for f in out.split("\0") if f and (ROOT / f).is_file()]


def scratch_copy(files: list[str]) -> Path:
    """A fresh copy of the repository (no .git, no .venv, no caches): one per run of pytest, so no
    bytecode or pytest cache of an earlier mutation can leak into the next."""
    scratch = Path(tempfile.mkdtemp(prefix="minitrain-mutate-"))
    for f in files:
        (scratch / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, scratch / f)
    return scratch


def environment(scratch: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(scratch / "src"), env.get("PYTHONPATH")) if p)
    return env


def check_shadowing(files: list[str]) -> None:
    scratch = scratch_copy(files)
    try:
        (scratch / "_mutate_probe.py").write_text(PROBE)
        proc = subprocess.run([sys.executable, "-c", "import _mutate_probe; _mutate_probe.main()"], cwd=scratch,
                              env=environment(scratch), capture_output=True, text=True, timeout=300, check=False)
        where = proc.stdout.split()
        expected = str(scratch / PACKAGE / "__init__.py")
        if proc.returncode != 0 or len(where) != 4 or any(w != expected for w in where):
            raise SystemExit(f"the scratch copy does not shadow the installed minitrain (want {expected}; "
                             f"this process, a child and 2 ranks gave {where}):\n{proc.stderr[-2000:]}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print("shadowing: this process, a fresh interpreter and forked ranks all import the scratch copy", flush=True)


def pytest_args(selections: list[str]) -> list[str]:
    return [arg for s in selections for arg in shlex.split(s)]


def run_pytest(scratch: Path, args: list[str], timeout: float) -> tuple[int | None, float, str]:
    """(exit code or None on timeout, seconds, output). In a session of its own, so a timeout kills
    pytest with its process group (forked ranks, the fork server) and nothing of ours; a CLI run a
    test started in its own session loses its parent and ends on its own."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *args]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=scratch, env=environment(scratch), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    RUNNING.add(proc)
    try:
        out, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, _ = proc.communicate()
        code = None
    finally:
        RUNNING.discard(proc)
    return code, time.monotonic() - start, out


def kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):  # it may have ended on its own meanwhile
        os.killpg(proc.pid, signal.SIGKILL)


def first_failure(output: str) -> str:
    found = re.search(r"^(?:FAILED|ERROR) (\S+)", output, re.MULTILINE)
    return found.group(1) if found else ""


def pytest_runs(selections) -> list[list[str]]:
    """The pytest runs that cover `selections`: plain node ids together; a selection with options (-k)
    alone, since pytest keeps only the last -k (given two, it would run the last one only)."""
    ids, optioned = [], []
    for s in dict.fromkeys(selections):
        (optioned if any(a.startswith("-") for a in shlex.split(s)) else ids).append(s)
    return ([ids] if ids else []) + [[s] for s in optioned]


def baseline(entries: list[dict], files: list[str], timeout: float) -> None:
    """Every selected test passes on the unmutated copy."""
    for group in pytest_runs(s for m in entries for s in m["tests"]):
        scratch = scratch_copy(files)
        try:
            code, seconds, out = run_pytest(scratch, pytest_args(group), timeout * max(1, len(group)))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        if code != 0:
            raise SystemExit(f"baseline: the tests fail (exit {code}) on the unmutated tree, nothing to measure:\n"
                             f"{out[-3000:]}")
        print(f"baseline: {' '.join(group)} pass ({seconds:.0f} s)", flush=True)


def mutate_one(m: dict, files: list[str], timeout: float) -> dict:
    scratch = scratch_copy(files)
    try:
        target = scratch / PACKAGE / m["file"]
        text = target.read_text().replace(m["find"], m["replace"], 1)
        try:  # a mutation that does not compile would be "caught" by any test: refuse it instead
            compile(text, str(target), "exec")
        except SyntaxError as e:
            return {"id": m["id"], "verdict": "error", "seconds": 0.0, "failed": f"does not compile: {e}", "output": ""}
        target.write_text(text)
        seconds = 0.0
        for group in pytest_runs(m["tests"]):  # in order, until one fails: the mutation is caught
            code, took, out = run_pytest(scratch, pytest_args(group), timeout)
            seconds += took
            if code != 0:
                break
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    verdict = {None: "timeout", 0: "survived", 1: "caught"}.get(code, "error")
    failed = first_failure(out) if code == 1 else ("" if code in (0, None) else f"pytest exit {code}")
    result = {"id": m["id"], "verdict": verdict, "seconds": round(seconds, 1), "failed": failed}
    if verdict == "error":
        result["output"] = out[-3000:]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="ID", help="run these mutations only")
    parser.add_argument("--list", action="store_true", help="list the mutations and whether each applies; run nothing")
    parser.add_argument("--jobs", type=int, default=1, help="mutations run at once (default 1)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per mutation (default 600)")
    parser.add_argument("--json", type=Path, help=f"results file (default: {RESULTS.relative_to(ROOT)} for a full run, "
                        "none with --only)")
    args = parser.parse_args(argv)

    entries = load()
    if args.only:
        unknown = sorted(set(args.only) - {m["id"] for m in entries})
        if unknown:
            parser.error(f"no mutation {', '.join(unknown)} in {LIST.name}")
        entries = [m for m in entries if m["id"] in args.only]
    stale = {m["id"]: stale_reason(m) for m in entries}
    if args.list:
        for m in entries:
            print(f"{m['id']:<42} {m['file']:<24} {'STALE: ' + stale[m['id']] if stale[m['id']] else m['why']}")
            print(f"{'':<42} tests: {' | '.join(m['tests'])}")
        return 1 if any(stale.values()) else 0
    if any(stale.values()):
        for key, reason in stale.items():
            if reason:
                print(f"{key:<42} stale    {reason}")
        print("update the stale entries of tools/mutations.toml to the current source")
        return 1

    files = repo_files()
    results = []
    pool = ThreadPoolExecutor(max_workers=max(1, args.jobs))
    try:
        check_shadowing(files)
        baseline(entries, files, args.timeout)
        for r in pool.map(lambda m: mutate_one(m, files, args.timeout), entries):
            results.append(r)
            print(f"{r['id']:<42} {r['verdict']:<9} {r['seconds']:6.1f} s  {r['failed']}", flush=True)
            if r["verdict"] == "error":
                print(r["output"], flush=True)
    except KeyboardInterrupt:
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in list(RUNNING):
            kill_group(proc)
        print("interrupted: the tests that were running are stopped", file=sys.stderr)
        return 130
    pool.shutdown()
    caught = sum(r["verdict"] in ("caught", "timeout") for r in results)
    hangs = sum(r["verdict"] == "timeout" for r in results)
    print(f"caught {caught} of {len(results)}" + (f" ({hangs} by timeout)" if hangs else ""))
    out = args.json or (None if args.only else RESULTS)
    if out is not None:
        write_results(out, caught, results)
    return 0 if caught == len(results) else 1


def write_results(path: Path, caught: int, results: list[dict]) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=False).stdout
    kept = [{k: v for k, v in r.items() if k != "output"} for r in results]
    path.write_text(json.dumps({"commit": commit.strip(), "caught": caught, "total": len(results), "results": kept},
                               indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
