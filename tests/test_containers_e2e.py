"""The stack in real containers: build every CPU image, train -> evaluate -> export -> serve -> play across them.

The trainer container submits a minimal GRPO run of the tiny profile to the Ray head container, which runs it on
the `shared` volume; the evaluator container scores its export; the exporter container stages it in the S3
container; the server container loads base + adapter from the volume and S3; a client on this host plays a maze
through the server's OpenAI API. Prometheus (a container too) must hold Ray's metrics. No container sees the
repository: only the named volume and S3. The stack is removed whatever happens.
Skips (one line) where no Docker engine answers; `bash .ci/run` starts one where it can.
"""

import json
import os
import random
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "docker"))

import build  # noqa: E402  (docker/build.py)
import stack  # noqa: E402  (docker/stack.py)

pytestmark = pytest.mark.timeout(3000)  # a first build on a fresh machine takes most of it
# Per session, so two test runs on one engine (or one machine) never take each other's stack or ports.
PROJECT = f"mgtest-e2e-{os.getpid()}"


def _free_ports(count: int, first: int = 18100, last: int = 18199) -> list[str]:
    free = [port for port in range(first, last + 1) if not stack.port_in_use("127.0.0.1", port)]
    random.Random(os.getpid()).shuffle(free)
    return [str(port) for port in free[:count]]


_PORTS = _free_ports(7)
PORTS = dict(zip(["S3_PORT", "RAY_DASHBOARD_PORT", "PROMETHEUS_PORT", "SERVER_PORT"], _PORTS[:4]))
COMPOSE_PORT, BUSY_PORT, _ = _PORTS[4:]
API_KEY = "mgtest-key"
RUN_ID = "e2e"
# A minimal run of the tiny profile: a short SFT warm start, 2 steps of 2 mazes x 2 samples, 4-turn episodes.
MINIMAL = [
    f"run_id={RUN_ID}", "sft.num_mazes=200", "rollout.train_batch_size=2",
    "rollout.n_samples_per_prompt=2", "env.max_turns=4", "env.reward=task_progress", "rollout.eval_samples=0", "env.eval_seeds=0-3", "env.extended_eval_seeds=4-7", "schedule.total_steps=2",
    "schedule.eval_interval=2", "schedule.ckpt_interval=2", "schedule.hf_save_interval=2", "lora.rank=4", "lora.alpha=8",
]
CONFIG = ["--config", "configs/tiny-cpu.yaml"]


def _say(*_):
    pass


@pytest.fixture(scope="module")
def client():
    try:
        return stack.connect()
    except stack.StackError as exc:
        pytest.skip(f"no Docker engine, container tests skipped: {exc}")


@pytest.fixture(scope="module")
def images(client):
    """Builds every CPU image with `make images`' script (cached layers make a rebuild quick)."""
    try:
        build.resolve_base(client, build.dockerfile_arg("BASE_IMAGE"), explicit=False)
    except build.BuildError:
        base = subprocess.run(["bash", "docker/base-image.sh"], cwd=REPO, capture_output=True, text=True, timeout=900)
        assert base.returncode == 0, base.stdout[-2000:] + base.stderr[-2000:]
    proc = subprocess.run([sys.executable, "docker/build.py"], cwd=REPO, capture_output=True, text=True, timeout=3000)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    print(proc.stdout[proc.stdout.rindex("\nimage "):])  # the size table
    return proc.stdout


@pytest.fixture(scope="module")
def environ():
    return {**os.environ, **PORTS, "SERVER_API_KEY": API_KEY, "COMPOSE_PROFILES": ""}


def _remove_stale_projects(client) -> None:
    """Takes down what interrupted earlier runs on this machine left (their test process is gone)."""
    label = {"label": stack.PROJECT_LABEL}
    found = [c.labels for c in client.containers.list(all=True, filters=label)]
    found += [n.attrs["Labels"] or {} for n in client.networks.list(filters=label)]
    found += [v.attrs["Labels"] or {} for v in client.volumes.list(filters=label)]
    for project in {labels.get(stack.PROJECT_LABEL, "") for labels in found}:
        match = re.fullmatch(r"mgtest-e2e-(\d+)(-.*)?", project)
        if match and not _alive(int(match.group(1))):
            stack.down(project, volumes=True, log=_say)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


@pytest.fixture(scope="module")
def infra(images, environ):
    """S3, the Ray head and Prometheus up; everything of the project (volume included) removed afterwards."""
    _remove_stale_projects(stack.connect())
    try:
        stack.up(["s3", "ray-head", "prometheus"], PROJECT, environ, log=_say)
        yield environ
    finally:
        stack.down(PROJECT, volumes=True, log=_say)


def _run(service: str, command: list[str], environ: dict, timeout_s: float = 900, **kwargs) -> str:
    code, log = stack.run(service, command, PROJECT, environ, timeout_s=timeout_s, **kwargs)
    assert code == 0, f"{service} {' '.join(command)} exited {code}:\n{log[-4000:]}"
    return log


def _read(path: str, environ: dict) -> str:
    """Returns a file from the shared volume, read by a service container (the host does not mount the volume)."""
    return _run("exporter", [path], environ, timeout_s=60, entrypoint=["cat"])


@pytest.fixture(scope="module")
def pipeline(infra):
    environ = infra
    started = time.time()
    trained = _run("trainer", ["submit", *CONFIG, *MINIMAL], environ, timeout_s=1200)
    assert "SUCCEEDED" in trained, trained[-3000:]
    export = f"/shared/runs/{RUN_ID}/exports/global_step_2/policy"
    assert json.loads(_read(f"{export}/manifest.json", environ))["files"]
    _run("evaluator", ["--run", RUN_ID, "--name", "containers", "--no-gifs", *MINIMAL[1:]], environ)
    summary = json.loads(_read(f"/shared/runs/{RUN_ID}/evals/containers/summary.json", environ))
    _run("exporter", ["--run", RUN_ID, "--alias", RUN_ID, *MINIMAL], environ)
    stack.up(["server"], PROJECT, environ, log=_say)
    return {"summary": summary, "environ": environ, "seconds": time.time() - started}


def _wait_for_server(url: str, timeout_s: float = 300) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/healthz", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise AssertionError(f"the server container did not answer {url}/healthz in {timeout_s} s")


def test_evaluator_container_scores_the_trainers_export(pipeline):
    summary = pipeline["summary"]
    assert summary["total"] == 4 and summary["seeds"] == "0-3" and summary["adapter"]
    assert 0.0 <= summary["solve_rate"] <= 1.0


def test_exporter_container_staged_the_adapter_in_s3(pipeline):
    from shared.storage.s3 import s3_client

    s3 = s3_client(f"http://127.0.0.1:{PORTS['S3_PORT']}")
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket="maze-grpo", Prefix=f"local/adapters/{RUN_ID}/")["Contents"]}
    assert {f"local/adapters/{RUN_ID}/{name}" for name in
            ("adapter_model.safetensors", "adapter_config.json", "README.md", "manifest.json")} <= keys


def test_host_client_plays_a_maze_through_the_server_container(pipeline, tmp_path):
    url = f"http://127.0.0.1:{PORTS['SERVER_PORT']}"
    _wait_for_server(url)
    proc = subprocess.run(
        [sys.executable, "-m", "services.evaluator", "play", "--base-url", url, "--model-name",
         f"tiny-qwen3vl-sft:{RUN_ID}", "--seed", "0", "--out", str(tmp_path), "env.max_turns=4"],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "SERVER_API_KEY": API_KEY})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    episode = json.loads((tmp_path / "episodes.jsonl").read_text().splitlines()[0])
    assert episode["steps"], "no turn was played"
    for turn in episode["steps"]:
        assert turn["action"] and turn["action"][0] in ("move", "stop"), f"illegal move {turn['text']!r}"


def test_prometheus_container_holds_ray_metrics(pipeline):
    url = f"http://127.0.0.1:{PORTS['PROMETHEUS_PORT']}/api/v1/query"
    deadline, names = time.time() + 60, set()
    while time.time() < deadline and not names:
        result = httpx.get(url, params={"query": 'count by (__name__) ({__name__=~"ray_.+"})'}, timeout=10).json()
        names = {r["metric"]["__name__"] for r in result["data"]["result"]}
        time.sleep(2)
    assert "ray_node_cpu_utilization" in names, sorted(names)[:20]


def test_services_see_only_the_volume_and_s3(pipeline, client):
    seen = stack.containers(client, PROJECT)
    assert {c.labels[stack.SERVICE_LABEL] for c in seen} >= {"s3", "ray-head", "prometheus", "server"}
    for container in seen:
        mounts = container.attrs["Mounts"]
        assert all(m["Type"] == "volume" for m in mounts), (container.name, mounts)
        if container.labels[stack.SERVICE_LABEL] in ("ray-head", "server"):
            assert [m["Name"] for m in mounts if m["Destination"] == "/shared"] == [f"{PROJECT}_shared"]


def test_images_are_labelled_tagged_non_root_and_clean(images, client):
    rev = build.commit()
    for name in [n for n in build.IMAGES if n not in build.GPU_IMAGES]:
        image = client.images.get(f"maze-grpo/{name}:latest")
        assert {f"maze-grpo/{name}:{build.version()}", f"maze-grpo/{name}:{rev}"} <= set(image.tags)
        labels = image.labels
        assert labels["org.opencontainers.image.version"] == build.version()
        assert labels["org.opencontainers.image.revision"] == rev
        assert image.attrs["Config"]["User"] not in ("", "root", "0"), f"{name} runs as root"
        # The images earlier commits built were removed by this build (they would fill the disk commit by commit).
        assert [i.id for i in client.images.list(name=f"maze-grpo/{name}")] == [image.id], name
    # Nothing of the build or the tests in a service image: no wheels, pip cache, tests or build folders.
    # (Debian's ensurepip wheels and virtualenv's seed wheels are parts of installed packages, not leftovers.)
    # And every package an image shares with this venv is at the venv's version (torch aside: the images' own CPU pin).
    for name in ("trainer-cpu", "exporter"):
        container = client.containers.run(
            f"maze-grpo/{name}:latest", entrypoint=["sh", "-c"], detach=True, user="0",
            command=["ls -d /tmp/* /root/.cache /home/app/.cache /app/tests /app/build /app/*.egg-info /app/.git "
                     "/app/README.md /app/docker 2>/dev/null; find /tmp /app /root /home -name '*.whl'; "
                     "echo FREEZE; python -m pip freeze --exclude-editable; true"])
        container.wait(timeout=60)
        leftovers, freeze = container.logs().decode().split("FREEZE\n")
        container.remove(v=True)  # v: the anonymous volume the image's VOLUME /shared made
        assert leftovers.strip() == "", (name, leftovers)
        pins = dict(line.split("==") for line in freeze.splitlines() if "==" in line)
        assert len(pins) > 50, (name, freeze[-2000:])
        ours = {package: _venv_version(package) for package in pins if package.lower() not in ("torch", "torchvision")}
        drift = {package: (pins[package], have) for package, have in ours.items() if have not in (None, pins[package])}
        assert not drift, f"{name}: image version != venv version: {drift}"


def _venv_version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


# ---- bad input: one clear line, nothing half-started ---------------------------------------------


def _stack_cli(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "docker/stack.py", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_up_without_an_engine_says_so():
    proc = _stack_cli("up", env={"DOCKER_HOST": "unix:///nonexistent/docker.sock"})
    assert proc.returncode != 0 and proc.stderr.startswith("error: no Docker engine reachable")
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_missing_base_image_names_make_base_image(client):
    proc = subprocess.run([sys.executable, "docker/build.py", "--only", "exporter", "--base-image", "mgtest-missing:1"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "base image mgtest-missing:1 is not here" in proc.stderr
    assert "make base-image" in proc.stderr and "Traceback" not in proc.stderr


def test_port_in_use_starts_nothing(images, client):
    project = f"{PROJECT}-port"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", int(BUSY_PORT)))
        taken.listen()
        proc = _stack_cli("up", "s3", "--project", project, env={"S3_PORT": BUSY_PORT})
    assert proc.returncode != 0 and f"port 127.0.0.1:{BUSY_PORT} (service s3) is in use" in proc.stderr
    assert "S3_PORT" in proc.stderr and "Traceback" not in proc.stderr
    assert stack.containers(client, project) == []


@pytest.mark.parametrize("tool", ["sdk", "compose"])
def test_failed_health_check_removes_what_it_started(images, client, tmp_path, tool):
    if tool == "compose" and stack.compose_tool() is None:
        pytest.skip("neither docker-compose nor `docker compose` is installed: the SDK path is the one `make up` takes")
    compose = tmp_path / "compose.yaml"
    compose.write_text(
        "services:\n"
        "  good:\n    image: maze-grpo/exporter:latest\n    entrypoint: [sleep, '300']\n"
        "  sick:\n    image: maze-grpo/exporter:latest\n    entrypoint: [sleep, '300']\n    depends_on: [good]\n"
        "    healthcheck: {test: [CMD, 'false'], interval: 1s, timeout: 2s, retries: 2}\n")
    project = f"{PROJECT}-sick-{tool}"
    proc = _stack_cli("up", "--project", project, "--file", str(compose), *(["--sdk"] if tool == "sdk" else []))
    try:
        assert proc.returncode != 0 and "service sick did not become healthy" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
        assert stack.containers(client, project) == []
        assert client.networks.list(names=[f"{project}_default"]) == []
    finally:
        stack.down(project, volumes=True, log=_say)


def test_up_takes_the_compose_tool_where_installed_and_down_removes_it(images, client):
    tool = stack.compose_tool()
    if tool is None:
        pytest.skip("neither docker-compose nor `docker compose` is installed: `make up` uses the SDK path")
    project = f"{PROJECT}-compose"
    proc = _stack_cli("up", "s3", "--project", project, env={"S3_PORT": COMPOSE_PORT})
    try:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert f"with {' '.join(tool)}" in proc.stdout
        (s3,) = stack.containers(client, project)
        assert stack.health(s3) == "healthy"
        assert httpx.get(f"http://127.0.0.1:{COMPOSE_PORT}/", timeout=10).status_code == 200
    finally:
        down = _stack_cli("down", "--project", project, "--volumes")
    assert down.returncode == 0 and stack.containers(client, project) == []
    assert client.networks.list(names=[f"{project}_default"]) == []
