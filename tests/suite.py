"""`make test` from nothing: installs and test phases run side by side where they wait on different things.

    python3 tests/suite.py [--fast] [-- PYTEST_ARGS...]

Standard library only: it runs before any venv exists. Each job logs to .test-logs/<job>.log; a test job's log is
printed whole when it ends, an install's only when it fails. The last lines name every job's start and length, then
one count over all the test jobs ('tests: N passed, N failed').

The graph (what each job waits for):
    venv (make setup) | system (apt: prometheus, chromium, docker) | vllm-env       all three at once
    lint, skyrl-env, images (engine + base image + CPU images)                       once venv (and system) are in
    tests: every test but the container ones, one at a time                        once lint, system, vllm-env are
    skyrl-checks: SkyRL's own code against ours (.venv-skyrl)                       once skyrl-env and tests are
    container-tests: the stack in real containers (conftest marks them `docker`)   once images and tests are
The installs wait on the network and the disk and the image build mostly writes to disk, so they run beside the
tests. Beside the main test run a second test stream did not pay on 2 cores: two trainer runs side by side each
took two to four times as long, and Ray and vLLM start-ups timed out under that load. SkyRL's checks and the
container tests, after it, go side by side: each leaves about a third of the cores idle (waiting on Ray, vLLM and
the containers' start-ups), and their start-ups wait minutes, not seconds.
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


@dataclass
class Job:
    name: str
    command: list[str]
    after: list[str] = field(default_factory=list)
    tests: bool = False  # a pytest run: its log is printed whole, its junit counts summed
    background: bool = False  # a service held for the other jobs (the Docker engine): stopped at the end
    ready: str = ""  # for a background job: the line its log holds once it serves
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


def pytest_job(name: str, python: str, selection: list[str], after: list[str], workers: int) -> Job:
    parallel = ["-n", str(workers), "--dist", "loadgroup"] if workers > 1 else []
    command = [python, "-m", "pytest", *selection, *parallel, "--durations=12", f"--junitxml={LOGS / f'{name}.xml'}"]
    return Job(name, command, after, tests=True)


def make(name: str, target: str, after: tuple[str, ...] = ()) -> Job:
    """Returns a job running one Makefile target (where every install and the lint command live)."""
    return Job(name, ["make", "--no-print-directory", target], list(after))


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
    return [
        make("venv", "setup"),
        make("system", "system-deps"),
        make("vllm-env", "vllm-env"),
        make("lint", "lint", ("venv",)),
        make("skyrl-env", "skyrl-env", ("venv",)),
        Job("engine", engine, ["system"], background=True, ready="engine-ready"),
        Job("images", ["bash", "-c", images], ["venv", "engine"]),
        # One worker: most of these start Ray, servers and engines, each of which wants both cores, and the second
        # core serves the other stream (installs, images, the container and SkyRL tests).
        pytest_job("tests", PY, ["-m", "not docker", *pytest_args], ["lint", "system", "vllm-env"], workers=1),
        # The other test runs wait for the first: beside it, a Ray or vLLM start-up in a second test stream timed out
        # (seen three times on the slow machines); the installs and the image build are what overlaps it. The two
        # then run side by side (the docstring says why).
        pytest_job("skyrl-checks", ".venv-skyrl/bin/python", ["tests/skyrl_checks", *pytest_args],
                   ["skyrl-env", "tests"], workers=1),
        pytest_job("container-tests", PY, ["-m", "docker", *pytest_args], ["images", "tests"], workers=1),
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
        job.process = subprocess.Popen(job.command, cwd=REPO, env=self.env, stdout=handle, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        self.say(f"start {job.name}: {' '.join(job.command)}")

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
                elif all(dep.code == 0 for dep in waits):
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
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)  # CI's stop, or a kill: every job's process group goes with it
    try:
        code = runner.run()
    except KeyboardInterrupt:
        code = 130
    finally:
        runner.stop_all()
    runner.report()
    return code


if __name__ == "__main__":
    sys.exit(main())
