"""Containers and workflows, checked where no Docker engine runs: schemas, Dockerfile rules, image coverage."""

import fnmatch
import re
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SERVICES = ["trainer", "evaluator", "exporter", "server", "dashboards"]
sys.path.insert(0, str(REPO / "docker"))


def _check(schema: str, *files: Path):
    proc = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", schema, *map(str, files)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_workflows_match_the_github_schema():
    _check("vendor.github-workflows", *sorted((REPO / ".github" / "workflows").glob("*.yml")))


def test_compose_matches_the_compose_spec():
    _check("vendor.compose-spec", REPO / "docker" / "compose.yaml")


def _stages(dockerfile: Path) -> dict[str, list[str]]:
    """Returns {stage name: its instruction lines}, with line continuations joined."""
    text = re.sub(r"\\\n\s*", " ", dockerfile.read_text())
    stages, current = {}, None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.match(r"FROM\s+(\S+)(?:\s+AS\s+(\S+))?", line, re.IGNORECASE)
        if match:
            current = match.group(2) or match.group(1)
            stages[current] = [line]
        elif current:
            stages[current].append(line)
    return stages


DOCKERFILES = [REPO / "docker" / "Dockerfile", REPO / "docker" / "Dockerfile.gpu"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_rules(dockerfile):
    text = dockerfile.read_text()
    args = {name: value.strip('"') for name, value in re.findall(r'^ARG\s+(\w+)=("[^"]*"|\S+)', text, re.MULTILINE)}
    for stage, lines in _stages(dockerfile).items():
        base = lines[0].split()[1]
        base = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), base)
        if base not in _stages(dockerfile):
            assert re.search(r":[\w.-]*\d[\w.-]*$", base) and ":latest" not in base, f"{stage}: base {base} is not pinned"
        for line in lines:
            if line.upper().startswith("COPY") and "--from=" not in line:
                sources = [p for p in line.split()[1:-1] if not p.startswith("--")]
                for source in sources:
                    # a wildcard may match nothing (docker/wheels/*.txt before a build) beside a committed file
                    if "*" not in source:
                        assert (REPO / source).exists(), f"{dockerfile.name}:{stage}: COPY source {source} does not exist"
                assert any((REPO / source).exists() for source in sources), f"{stage}: {line} may copy nothing"
            if "PIP INSTALL" in line.upper():
                # each of these packages, wherever it is installed, carries its own exact pin
                expanded = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), line)
                for token in expanded.replace('"', " ").replace("'", " ").split():
                    spec = re.fullmatch(r"(torch|torchvision|ray(?:\[[\w,]+\])?|skyrl\[fsdp\])(==\S+)?", token)
                    assert not spec or spec.group(2), f"{stage}: {token} is not pinned with == in: {line[:120]}"
        if any(line.upper().startswith("ENTRYPOINT") for line in lines):
            users = [line.split()[1] for line in lines if line.upper().startswith("USER ")]
            assert users and users[-1] not in ("root", "0"), f"{stage}: runs as root"
            assert any("VOLUME" in line and "/shared" in line for lines_ in _stages(dockerfile).values() for line in lines_)
            assert "SHARED_DIR=/shared" in text


def test_every_service_has_an_image_and_the_server_a_healthcheck():
    from build import IMAGES

    stages = {**_stages(DOCKERFILES[0]), **_stages(DOCKERFILES[1])}
    for service in SERVICES:
        targets = [name for name in IMAGES if name.split("-")[0] == service]
        assert targets, f"no image for {service}"
        for target in targets:
            dockerfile, stage = IMAGES[target]
            assert stage in _stages(REPO / dockerfile)
            entry = [line for line in stages[stage] if line.upper().startswith("ENTRYPOINT")]
            assert entry and f"services.{service}" in entry[0]
    assert {"trainer", "trainer-cpu", "server", "server-cpu"} <= set(IMAGES)
    for stage in ("server", "server-cpu"):
        assert any(line.upper().startswith("HEALTHCHECK") for line in stages[stage])


def _health_checks() -> dict[str, tuple[list[str], int, str]]:
    """Returns {container: (its health check's command, the port it asks, the path)}: docker/compose.yaml's services
    and the server image's HEALTHCHECK."""
    import json

    import stack

    checks = {}
    for name, service in stack.load_services(environ={}).items():
        if service.get("healthcheck"):
            command = service["healthcheck"]["test"]
            assert command[0] == "CMD", (name, command)
            checks[name] = (command[1:], int(command[-2]), command[-1])
    [line] = [line for line in _stages(DOCKERFILES[0])["server-cpu"] if line.upper().startswith("HEALTHCHECK")]
    command = json.loads(line[line.index(" CMD ") + 5:])
    port, page = re.search(r"/dev/tcp/127\.0\.0\.1/(\d+) .*GET (\S+) HTTP", command[-1]).groups()
    checks["server-cpu"] = (command, int(port), page)
    return checks


def test_health_checks_ask_their_page_and_pass_only_on_a_200():
    """Each check runs on this host as the engine runs it in the container, against a real HTTP server on a free
    port: healthy when its page answers 200, not when it answers 503 (or another page is asked) or nothing listens. No
    Python: the stack's checks run every 2 s while it is up, and a Python start each took about 6% of a core (an
    idle stack at 15% of a core, 9% without; 12.5 CPU-s in a whole half-speed `make test`, docs/experiments.md)."""
    import http.server
    import threading

    from shared.net import free_port

    status = {"code": 200}

    class Pages(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(status["code"] if self.path == self.server.page else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    def exit_code(argv: list[str]) -> int:
        return subprocess.run(argv, capture_output=True, timeout=10).returncode

    checks = _health_checks()
    assert {"s3", "ray-head", "prometheus", "server-cpu"} <= set(checks)
    for name, (command, port, page) in checks.items():
        assert not any("python" in part for part in command), f"{name}: a Python start for each check"
        server = http.server.HTTPServer(("127.0.0.1", free_port()), Pages)
        server.page = page
        threading.Thread(target=server.serve_forever, daemon=True).start()
        here = [re.sub(rf"\b{port}\b", str(server.server_port), part) for part in command]
        try:
            status["code"] = 200  # on `page` only: another path answers 404
            assert exit_code(here) == 0, f"{name}: unhealthy although {page} answers 200"
            status["code"] = 503
            assert exit_code(here) != 0, f"{name}: healthy although {page} answers 503"
        finally:
            server.shutdown()
            server.server_close()
        assert exit_code(here) != 0, f"{name}: healthy with nothing listening"


def test_dockerignore_keeps_state_out():
    patterns = (REPO / ".dockerignore").read_text().split()
    for entry in (".venv", ".venv-skyrl", ".venv-vllm", ".shared", ".git", "docker/wheels/torch-2.13.0+cpu.whl"):
        assert any(fnmatch.fnmatchcase(entry, pattern) for pattern in patterns), entry


def test_the_images_are_pinned_to_the_versions_this_venv_holds():
    """`make setup`'s venv holds every requirement of the extras docker/Dockerfile installs, so docker/build.py pins
    the images to its versions. (Checked against every extra in pyproject.toml, the SkyRL checks' own made it pin
    nothing, and the images took the index's newest boto3, pyarrow and regex instead of the tested ones.)"""
    import build

    assert build.image_extras() == ["trainer", "evaluator", "server", "exporter", "dashboards"]
    assert build.venv_mismatches(build.image_extras()) == []
    missing = build.venv_mismatches(["skyrl-check"])  # .venv-skyrl's extra: not in this venv, and said so
    assert any(line.startswith("datasets==") for line in missing), missing


def test_the_torch_wheels_are_served_to_the_build_at_a_url_that_names_them(tmp_path):
    """docker/build.py serves the wheels to the build's install step (they are not in its context): a find-links
    page and the files, HEAD and GET as uv asks; the same URL for the same wheels (so a rebuild finds its cached
    layer), another once they change; nothing else served."""
    import httpx

    import build

    (tmp_path / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"torch" * 1000)
    (tmp_path / "README.md").write_text("not served")
    with build.served_wheels(tmp_path, "127.0.0.1") as url:
        page = httpx.get(url)
        assert page.status_code == 200 and 'href="torch-2.13.0+cpu-cp311' in page.text and "README" not in page.text
        wheel = url + "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
        assert httpx.head(wheel).headers["content-length"] == "5000"
        assert httpx.get(wheel).content == b"torch" * 1000
        assert httpx.get(wheel.replace("+", "%2B")).content == b"torch" * 1000  # a client that quotes the "+"
        assert httpx.get(url + "README.md").status_code == 404
        assert httpx.get(url.rsplit("/", 2)[0] + "/other/").status_code == 404
    with build.served_wheels(tmp_path, "127.0.0.1") as again:
        assert again == url
    (tmp_path / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"other")
    with build.served_wheels(tmp_path, "127.0.0.1") as changed:
        assert changed != url and changed.startswith("http://127.0.0.1:")
    with build.served_wheels(tmp_path / "none", "127.0.0.1") as nothing:
        assert nothing == ""


def test_the_wheels_are_served_on_the_bridge_even_when_the_engine_records_no_gateway():
    """A new engine that creates its bridge (a fresh machine: no docker0 before it) records the subnet without its
    gateway; the build then took the CPU index, which containers here cannot reach, and `make test` failed on a fresh
    machine. The gateway is then the bridge interface's own address (stand-ins below for docker-py's records; the
    interface is this host's real loopback)."""
    from types import SimpleNamespace

    import build

    def engine(config, interface="lo", url="http+docker://localhost"):
        options = {"com.docker.network.bridge.name": interface}
        network = SimpleNamespace(attrs={"IPAM": {"Config": config}, "Options": options})
        return SimpleNamespace(api=SimpleNamespace(base_url=url), networks=SimpleNamespace(get=lambda name: network))

    assert build.interface_ipv4("lo") == "127.0.0.1" and build.interface_ipv4("no-such-if0") == ""
    assert build.bridge_gateway(engine([{"Subnet": "172.17.0.0/16", "Gateway": "172.17.0.1"}])) == "172.17.0.1"
    assert build.bridge_gateway(engine([{"Subnet": "127.0.0.0/8"}])) == "127.0.0.1"  # no gateway: the interface's
    assert build.bridge_gateway(engine([{"Subnet": "172.17.0.0/16"}])) == ""  # an address outside the bridge's subnet
    assert build.bridge_gateway(engine([{"Subnet": "127.0.0.0/8"}], interface="no-such-if0")) == ""
    assert build.bridge_gateway(engine([{"Subnet": "127.0.0.0/8"}], url="http://10.0.0.5:2375")) == ""  # not ours


def test_a_rebuild_of_one_commit_labels_its_images_alike():
    """The `created` label is the commit's time, not the build's: the engine adds each label as a build step of its
    own, so a label that changed on every build re-ran those steps (and made new image IDs) each time `make images`
    or the container tests' fixture rebuilt the same commit."""
    import build

    committed = subprocess.run(["git", "log", "-1", "--format=%cI"], cwd=REPO, capture_output=True, text=True,
                               check=True).stdout.strip()
    expected = datetime.fromisoformat(committed).astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    first = build.labels("evaluator", "abc1234", "maze-grpo/base:bookworm")
    assert first["org.opencontainers.image.created"] == expected
    assert build.labels("evaluator", "abc1234", "maze-grpo/base:bookworm") == first


def test_make_images_without_an_engine_says_so():
    proc = subprocess.run([sys.executable, "docker/build.py", "--only", "evaluator"], cwd=REPO, capture_output=True,
                          text=True, env={"DOCKER_HOST": "unix:///nonexistent/docker.sock", "PATH": "/usr/bin:/bin"})
    assert proc.returncode != 0 and "no Docker engine reachable" in proc.stderr


@pytest.mark.slow
def test_the_gpu_image_jobs_build_step_runs_in_a_venv_holding_only_what_the_workflow_installs(tmp_path):
    """images.yml's gpu job, step by step: its own pip installs in a fresh venv, then its build command (a pull
    request's, no push) gets as far as looking for a Docker engine, so every import the script needs is there."""
    import yaml

    job = yaml.safe_load((REPO / ".github" / "workflows" / "images.yml").read_text())["jobs"]["gpu"]
    [step] = [s for s in job["steps"] if s.get("name", "").startswith("build (and push)")]
    lines = [line.strip() for line in step["run"].splitlines() if line.strip()]
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    installs = [line for line in lines if line.startswith("python -m pip install")]
    assert installs, lines
    for line in installs:
        proc = subprocess.run(line.replace("python", python, 1), shell=True, cwd=REPO, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
    [build] = [line for line in lines if "docker/build.py" in line]
    build = re.sub(r"\$\{\{ matrix.image \}\}", "trainer", build)
    build = re.sub(r"\$\{\{ env.PUSH == 'true' && .*? \}\}", "", build)  # a pull request builds without pushing
    assert "${{" not in build, build
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "DOCKER_HOST": f"unix://{tmp_path}/no-engine.sock"}
    proc = subprocess.run(build.replace("python", python, 1), shell=True, cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: no Docker engine reachable"), proc.stderr[-2000:]
