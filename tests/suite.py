"""`make test` from nothing: installs and test phases run side by side where they wait on different things.

    python3 tests/suite.py [--fast] [-- PYTEST_ARGS...]

Standard library only: it runs before any venv exists. Each job logs to .test-logs/<job>.log; a test job's log is
printed whole when it ends, an install's only when it fails. The last lines name every job's start and length, then
one count over all the test jobs ('tests: N passed, N failed').

The graph (what each job waits for):
    venv (make setup) | system (apt: prometheus, chromium, docker) | vllm-env       all three at once
    lint, skyrl-env, images (engine + base image + CPU images)                       once venv (and system) are in
    tests-<group>: the main run in groups of whole modules (GROUPS)                 once lint and system are in (and
                                                                                     vllm-env for the vLLM groups)
    skyrl-checks: SkyRL's own code against ours (.venv-skyrl)                       once skyrl-env is in
    container-tests: the stack in real containers (conftest marks them `docker`)   once the images are built
Test jobs take one of two slots, in the order ORDER gives (the longest first): one while an install or the
image build runs, which waits on the network and the disk and takes the other core, then two. One test stream
leaves a third of the cores idle (each trainer, server or engine start-up is mostly one busy process: the main run
alone kept 2 cores 66% busy), and two trainer runs side by side took 33 s where one after the other took 46 s. A
group is a pytest process of its own: its session fixtures (the tiny model, 4 s; a local S3) are built again, so
the modules sharing a costly fixture stay in one group.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LOGS = REPO / ".test-logs"
PY = ".venv/bin/python"
# Every job's processes carry its name (.ci/measure --cpu-by-job reads it to say which job spent the CPU).
JOB_VARIABLE = "MAZE_GRPO_TEST_JOB"


@dataclass
class Job:
    name: str
    command: list[str]
    after: list[str] = field(default_factory=list)
    tests: bool = False  # a pytest run: its log is printed whole, its junit counts summed; takes a slot
    background: bool = False  # a service held for the other jobs (the Docker engine): stopped at the end
    ready: str = ""  # for a background job: the line its log holds once it serves
    env: dict = field(default_factory=dict)  # set for this job's processes on top of the suite's environment
    started: float = 0.0
    ended: float = 0.0
    process: subprocess.Popen | None = None
    code: int | None = None

    @property
    def log(self) -> Path:
        return LOGS / f"{self.name}.log"

    @property
    def junit(self) -> Path:
        return LOGS / f"{self.name}.xml"


# One thread per process in the test jobs (torch's, and vLLM's engine unpinned from the cores): two test streams
# share 2 cores, and a process whose threads wait on each other at every op stalls as soon as another takes a core.
# Beside the image build and a second stream, the transfer test took 441 s with two threads, against 87 s alone;
# alone, one thread took 110 s with 23% less CPU (docs/experiments.md).
ONE_THREAD = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def pytest_job(name: str, python: str, selection: list[str], after: list[str], workers: int) -> Job:
    parallel = ["-n", str(workers), "--dist", "loadgroup"] if workers > 1 else []
    command = [python, "-m", "pytest", *selection, *parallel, "--durations=12", f"--junitxml={LOGS / f'{name}.xml'}"]
    return Job(name, command, after, tests=True, env=ONE_THREAD)


def make(name: str, target: str, after: tuple[str, ...] = ()) -> Job:
    """Returns a job running one Makefile target (where every install and the lint command live)."""
    return Job(name, ["make", "--no-print-directory", target], list(after))


# The main run's groups (the seconds each took in 859c345's one-stream run, faster kind). A module in no group runs
# in `tests-rest`, so a new test module is never left out. The vLLM groups wait for .venv-vllm; the others do not.
GROUPS = {
    "trainer": ["test_trainer"],  # 264 s: the session's Ray head serves only these
    "vllm-server": ["test_server_vllm"],  # 208 s
    "services": ["test_evaluator", "test_server", "test_server_hostile", "test_hostile_input", "test_exporter",
                 "test_bad_input", "test_storage"],  # 233 s: `server` and the exported run's fixtures
    "cluster": ["test_submit", "test_dashboards", "test_run_lock", "test_containers", "test_gpu_image",
                "test_deploy", "test_skyrl_backend"],  # 191 s
    "vllm-rollout": ["test_rollout_vllm"],  # 101 s
}
VLLM_GROUPS = {"vllm-server", "vllm-rollout"}
# The order in which test jobs take a free slot: the longest first (their lengths in two streams at 5462dac, faster
# kind: 5m11s, 4m40s, 4m23s, 3m47s, 2m48s, 2m08s, 1m38s, 0m20s), so the last to end is a short one. With the container
# tests last but one they ran alone for their last 1m46s, the cores half idle while Docker started the stack; after
# SkyRL's checks, the vLLM rollout tests still ran alone for the last 36 to 63 s of a run at half speed (runs 27 and
# 28, docs/experiments.md): the container tests go before SkyRL's checks, whose 6 to 7 minutes cover their end.
ORDER = ["tests-trainer", "tests-services", "tests-vllm-server", "tests-cluster", "container-tests", "skyrl-checks",
         "tests-vllm-rollout", "tests-rest"]


def selects_paths(pytest_args: list[str]) -> bool:
    """Whether ARGS name test files or ids themselves (then the main run is one job over what they name)."""
    return any((REPO / arg.split("::")[0]).exists() for arg in pytest_args if not arg.startswith("-"))


def main_run(pytest_args: list[str]) -> list[Job]:
    needs = ["lint", "system"]
    if selects_paths(pytest_args):
        return [pytest_job("tests", PY, ["-m", "not docker", *pytest_args], [*needs, "vllm-env"], workers=1)]
    grouped = {module for modules in GROUPS.values() for module in modules}
    rest = sorted(path.stem for path in (REPO / "tests").glob("test_*.py") if path.stem not in grouped)
    plan = []
    for name, modules in [*GROUPS.items(), ("rest", rest)]:
        files = [f"tests/{module}.py" for module in modules]
        after = [*needs, "vllm-env"] if name in VLLM_GROUPS else needs
        plan.append(pytest_job(f"tests-{name}", PY, [*files, "-m", "not docker", *pytest_args], after, workers=1))
    return plan


def jobs(fast: bool, pytest_args: list[str]) -> list[Job]:
    if fast:
        return [make("venv", "setup"), make("lint", "lint", ("venv",)),
                pytest_job("tests", PY, ["-m", "not slow", *pytest_args], ["lint"], workers=2)]
    # The engine is held for the image build and the container tests; with-engine.sh installs and starts one where
    # it can (root with apt) and says why not elsewhere, and the container tests then skip with that reason.
    engine = ["bash", "docker/with-engine.sh", "bash", "-c", "echo engine-ready; exec sleep infinity"]
    # The image build runs beside the main test run and yields it the cores: niced on this host, its steps at a
    # quarter of a process's CPU weight in the engine.
    images = (f"if docker info >/dev/null 2>&1; then nice -n 10 bash docker/base-image.sh && "
              f"nice -n 10 {PY} docker/build.py --yield-cpu; fi")
    tests = [*main_run(pytest_args),
             pytest_job("skyrl-checks", ".venv-skyrl/bin/python", ["tests/skyrl_checks", *pytest_args], ["skyrl-env"],
                        workers=1),
             pytest_job("container-tests", PY, ["-m", "docker", *pytest_args], ["images"], workers=1)]
    tests.sort(key=lambda job: ORDER.index(job.name) if job.name in ORDER else -1)
    return [
        make("venv", "setup"),
        make("system", "system-deps"),
        make("vllm-env", "vllm-env"),
        make("lint", "lint", ("venv",)),
        make("skyrl-env", "skyrl-env", ("venv",)),
        Job("engine", engine, ["system"], background=True, ready="engine-ready"),
        Job("images", ["bash", "-c", images], ["venv", "engine"]),
        *tests,
    ]


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


def counts(job: Job) -> dict[str, int]:
    """Returns the pytest job's passed/failed/skipped counts from its junit report."""
    if not job.junit.exists():
        return {"passed": 0, "failed": 0, "skipped": 0}
    suites = ElementTree.parse(job.junit).getroot()
    total = failed = skipped = 0
    for suite in suites.iter("testsuite"):
        total += int(suite.get("tests", 0))
        failed += int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        skipped += int(suite.get("skipped", 0))
    return {"passed": total - failed - skipped, "failed": failed, "skipped": skipped}


class Runner:
    def __init__(self, plan: list[Job], env: dict):
        self.plan = {job.name: job for job in plan}
        self.env = env
        self.t0 = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def say(self, text: str) -> None:
        print(f"[{minutes(self.now())}] {text}", flush=True)

    def start(self, job: Job) -> None:
        job.started = self.now()
        handle = open(job.log, "w")
        env = {**self.env, **job.env, JOB_VARIABLE: job.name}
        job.process = subprocess.Popen(job.command, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        self.say(f"start {job.name}: {' '.join(job.command)}")

    @staticmethod
    def slot_free(running: list[Job]) -> bool:
        """A test job may start: none is running, or a second while no install or image build is."""
        tests = sum(job.tests for job in running)
        return tests == 0 or (tests == 1 and all(job.tests or job.background for job in running))

    def ready(self, job: Job) -> bool:
        """A background job counts as done once its log holds its ready line."""
        return job.process.poll() is None and job.ready in job.log.read_text(errors="replace")

    def finish(self, job: Job, code: int) -> None:
        job.code, job.ended = code, self.now()
        state = "ok" if code == 0 else f"FAILED (exit {code})"
        if job.background and code == 0:
            state = "up"
        self.say(f"{job.name} {state} after {minutes(job.ended - job.started)}")
        if job.tests:
            sys.stdout.write(job.log.read_text(errors="replace"))
        elif code != 0:
            tail = job.log.read_text(errors="replace").splitlines()[-60:]
            sys.stdout.write(f"--- last lines of {job.log.relative_to(REPO)} ---\n" + "\n".join(tail) + "\n")
        sys.stdout.flush()

    def run(self) -> int:
        pending = list(self.plan.values())
        running: list[Job] = []
        while pending or running:
            for job in list(pending):
                waits = [self.plan[name] for name in job.after if name in self.plan]
                if any(dep.code not in (None, 0) for dep in waits):
                    pending.remove(job)  # a job it needs failed: never started
                    job.code = -1
                    self.say(f"{job.name} not started: {', '.join(d.name for d in waits if d.code)} failed")
                elif all(dep.code == 0 for dep in waits) and (not job.tests or self.slot_free(running)):
                    pending.remove(job)
                    self.start(job)
                    running.append(job)
            time.sleep(0.5)
            for job in list(running):
                code = job.process.poll()
                if job.background and job.code is None and self.ready(job):
                    self.finish(job, 0)
                    running.remove(job)
                elif code is not None:
                    self.finish(job, 0 if job.tests and code == 5 else code)  # 5: ARGS selected nothing here
                    running.remove(job)
        return 0 if all(job.code == 0 for job in self.plan.values()) else 1

    def stop_all(self) -> None:
        for job in self.plan.values():
            if job.process and job.process.poll() is None:
                try:
                    os.killpg(job.process.pid, signal.SIGTERM)
                    job.process.wait(timeout=60)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    os.killpg(job.process.pid, signal.SIGKILL)

    def report(self) -> None:
        parts = [f"{job.name} {minutes(job.ended - job.started)} (from {minutes(job.started)})"
                 for job in self.plan.values() if job.ended and not job.background]
        print(f"phase times: {' | '.join(parts)} | wall {minutes(self.now())}", flush=True)
        totals = {"passed": 0, "failed": 0, "skipped": 0}
        for job in self.plan.values():
            if job.tests:
                for key, value in counts(job).items():
                    totals[key] += value
        print(f"tests: {totals['passed']} passed, {totals['failed']} failed, {totals['skipped']} skipped", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--fast", action="store_true", help="lint and the tests that start no engine (make test-fast)")
    parser.add_argument("pytest_args", nargs="*", help="passed to every pytest run (after --)")
    args = parser.parse_args()
    LOGS.mkdir(exist_ok=True)
    require_all = os.geteuid() == 0 and subprocess.run(["sh", "-c", "command -v apt-get"], capture_output=True).returncode == 0
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # Bytecode is cached on first import (the Makefile says why): without it every test's processes compile torch,
    # transformers, Ray and vLLM from source again.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if require_all:
        # Where make test can install every dependency itself, a skipped test is a missing install step.
        env["MAZE_GRPO_REQUIRE_ALL_TESTS"] = "1"
    runner = Runner(jobs(args.fast, args.pytest_args), env)

    def interrupted(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: make passes its group's SIGTERM on to this process again
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)  # CI's stop, or a kill: every job's process group goes with it
    try:
        code = runner.run()
    except KeyboardInterrupt:
        code = 130
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # every job is stopped, whatever else arrives meanwhile
            signal.signal(sig, signal.SIG_IGN)
        runner.stop_all()
    runner.report()
    return code


if __name__ == "__main__":
    sys.exit(main())
