"""Starts and stops the stack that docker/compose.yaml describes (what `make up` / `make down` run).

    python docker/stack.py up [SERVICE ...] [--project maze-grpo] [--sdk]
    python docker/stack.py down [--volumes] [--project maze-grpo]

Before starting anything it checks the engine, the images and the host ports, so bad input gets one line and
nothing half-started. Then docker-compose (or `docker compose`) starts the services where one is installed; where
none is, this module reads the same compose file (image, entrypoint, command, environment with ${VAR:-default},
ports, named volumes, shm_size, restart, healthcheck, depends_on with service_healthy, profiles) and starts it through
the Docker SDK, naming and labelling what it creates as compose does, so either can take the stack down. A service
that fails its health check takes everything this call started down with it. The end-to-end test drives it too.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

from shared.config import command_line

COMPOSE_FILE = Path(__file__).resolve().parent / "compose.yaml"
PROJECT = "maze-grpo"
PROJECT_LABEL = "com.docker.compose.project"
SERVICE_LABEL = "com.docker.compose.service"
_VARIABLE = re.compile(r"\$\$|\$\{(\w+)(?::?-([^}]*))?\}|\$(\w+)")


class StackError(RuntimeError):
    """The stack cannot start (or did not); the message is one line saying what to do."""


# ---- reading the compose file ---------------------------------------------------------------------


def interpolate(value, environ: dict):
    """Returns value with ${VAR}, ${VAR:-default} and $VAR filled from environ, recursively ($$ is a literal $)."""
    if isinstance(value, str):
        def fill(match):
            if match.group(0) == "$$":
                return "$"
            name = match.group(1) or match.group(3)
            return environ.get(name) or (match.group(2) or "")
        return _VARIABLE.sub(fill, value)
    if isinstance(value, list):
        return [interpolate(v, environ) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, environ) for k, v in value.items()}
    return value


def load_services(compose_file: Path = COMPOSE_FILE, environ: dict | None = None) -> dict[str, dict]:
    """Returns {service: its settings} from the compose file, variables filled from environ."""
    environ = dict(os.environ if environ is None else environ)
    raw = yaml.safe_load(compose_file.read_text())
    return interpolate(raw["services"], environ)


def active(services: dict, names: list[str] | None, environ: dict) -> list[str]:
    """Returns the services to start, dependencies first: the named ones (or all in active profiles)."""
    profiles = {p for p in environ.get("COMPOSE_PROFILES", "").split(",") if p}
    wanted = names or [n for n, s in services.items() if not s.get("profiles") or profiles & set(s["profiles"])]
    unknown = [n for n in wanted if n not in services]
    if unknown:
        raise StackError(f"no service {unknown[0]!r} in {COMPOSE_FILE.name}: choose from {', '.join(services)}")
    ordered: list[str] = []

    def visit(name: str, path: tuple = ()):
        if name in path:
            raise StackError(f"services depend on each other in a loop: {' -> '.join(path + (name,))}")
        if name not in ordered:
            for dependency in depends_on(services[name]):
                visit(dependency, path + (name,))
            ordered.append(name)

    for name in wanted:
        visit(name)
    return ordered


def depends_on(service: dict) -> dict[str, str]:
    """Returns {dependency: condition} (service_started when the file gives a plain list)."""
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):
        return {d: "service_started" for d in deps}
    return {d: (c or {}).get("condition", "service_started") for d, c in deps.items()}


def seconds(text) -> float:
    """Returns seconds from a compose duration such as 2s, 1m30s, 500ms."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"([\d.]+)(ms|us|h|m|s)", str(text))
    return sum(float(n) * units[u] for n, u in parts) if parts else float(text)


def size_bytes(text) -> int:
    match = re.fullmatch(r"(\d+)\s*([kmg]?)b?", str(text).lower())
    if not match:
        raise StackError(f"shm_size {text!r} is not a size such as 1gb or 512m")
    return int(match.group(1)) * {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}[match.group(2)]


def published_ports(service: dict) -> list[tuple[str, int, str]]:
    """Returns [(host ip, host port, container port/tcp)] for `ports: ["[IP:]HOST:CONTAINER"]`."""
    ports = []
    for entry in service.get("ports", []):
        parts = str(entry).split(":")
        ip, host, container = (["0.0.0.0"] + parts)[-3:]
        ports.append((ip, int(host), container if "/" in container else f"{container}/tcp"))
    return ports


def named_volumes(service: dict) -> list[tuple[str, str]]:
    """Returns [(volume name, mount point)]; bind mounts are refused (the services see only the volume and S3)."""
    mounts = []
    for entry in service.get("volumes", []):
        source, target = str(entry).split(":")[:2]
        if source.startswith((".", "/", "~")):
            raise StackError(f"bind mount {entry!r}: the stack uses named volumes only")
        mounts.append((source, target))
    return mounts


# ---- the engine -----------------------------------------------------------------------------------


def connect():
    """Returns a Docker client whose engine answers, or raises StackError saying how to get one (docker/build.py's check)."""
    from build import BuildError  # docker/build.py, beside this file
    from build import connect as engine_client

    try:
        return engine_client()
    except BuildError as exc:
        raise StackError(str(exc)) from exc


def port_in_use(ip: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((ip, port))
            return False
        except OSError:
            return True


def port_variable(compose_file: Path, service: str, index: int) -> str:
    """Returns the variable that moves a service's published port (e.g. S3_PORT), for the error message."""
    raw = yaml.safe_load(compose_file.read_text())["services"][service]["ports"][index]
    match = re.search(r"\$\{?(\w+)", str(raw).rsplit(":", 1)[0])
    return match.group(1) if match else f"the ports of {service} in {compose_file.name}"


def containers(client, project: str, service: str | None = None, every: bool = True) -> list:
    filters = {"label": [f"{PROJECT_LABEL}={project}"] + ([f"{SERVICE_LABEL}={service}"] if service else [])}
    return client.containers.list(all=every, filters=filters)


def health(container) -> str:
    """Returns healthy, unhealthy, starting, running (no health check) or exited."""
    container.reload()
    state = container.attrs["State"]
    if state["Status"] in ("exited", "dead"):
        return "exited"
    return state.get("Health", {}).get("Status", "running")


def wait_healthy(container, service: str, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        status = health(container)
        if status in ("healthy", "running"):
            return
        if status in ("unhealthy", "exited"):
            break
        time.sleep(1)
    tail = container.logs(tail=5).decode(errors="replace").strip().splitlines()
    raise StackError(f"service {service} did not become healthy ({health(container)}; its last log line: "
                     f"{tail[-1][:200] if tail else 'none'}): fix that and start the stack again")


# ---- up, run, down --------------------------------------------------------------------------------


def _create(client, project: str, name: str, service: dict, container_name: str, command=None, oneoff=False):
    network = f"{project}_default"
    return client.containers.create(
        service["image"], name=container_name, command=command if command is not None else service.get("command"),
        entrypoint=service.get("entrypoint"), environment=service.get("environment") or {},
        ports={container: (ip, port) for ip, port, container in published_ports(service)},
        volumes={f"{project}_{vol}": {"bind": target, "mode": "rw"} for vol, target in named_volumes(service)},
        shm_size=size_bytes(service["shm_size"]) if service.get("shm_size") else None,
        restart_policy={"Name": service["restart"]} if service.get("restart") and not oneoff else None,
        healthcheck=_healthcheck(service.get("healthcheck")),
        labels={PROJECT_LABEL: project, SERVICE_LABEL: name, "com.docker.compose.oneoff": str(oneoff)},
        network=network, networking_config={network: client.api.create_endpoint_config(aliases=[name])},
    )


def _healthcheck(spec: dict | None) -> dict | None:
    if not spec:
        return None
    ns = 1_000_000_000
    return {"test": spec["test"], "interval": int(seconds(spec.get("interval", "30s")) * ns),
            "timeout": int(seconds(spec.get("timeout", "30s")) * ns), "retries": int(spec.get("retries", 3)),
            "start_period": int(seconds(spec.get("start_period", "0s")) * ns)}


def up(names: list[str] | None = None, project: str = PROJECT, environ: dict | None = None,
       compose_file: Path = COMPOSE_FILE, health_timeout_s: float = 180, log=print, tool: list[str] | None = None) -> list[str]:
    """Starts the services (and what they depend on) that are not running yet; returns the started ones.

    tool: a compose command (e.g. ["docker-compose"]) to start them with after the checks; None: the SDK.
    On any failure everything this call created is removed again, and StackError says what to do."""
    import docker

    environ = dict(os.environ if environ is None else environ)
    services = load_services(compose_file, environ)
    order = active(services, names, environ)
    client = connect()
    running = {c.labels.get(SERVICE_LABEL) for c in containers(client, project, every=False)}
    todo = [n for n in order if n not in running]
    for name in todo:
        image = services[name]["image"]
        try:
            client.images.get(image)
        except docker.errors.ImageNotFound:
            raise StackError(f"image {image} (service {name}) is not here: run `make images` first"
                             + ("" if image.startswith("maze-grpo/") else " or pull it") ) from None
        for index, (ip, port, _) in enumerate(published_ports(services[name])):
            if port_in_use(ip, port):
                raise StackError(f"port {ip}:{port} (service {name}) is in use: stop what uses it, or set "
                                 f"{port_variable(compose_file, name, index)} to a free port")
    if tool and todo:
        return _up_with_compose(tool, client, project, todo, services, compose_file, environ, health_timeout_s, log)
    created: list = []
    new_network = new_volumes = None
    try:
        if not client.networks.list(names=[f"{project}_default"]):
            new_network = client.networks.create(f"{project}_default", labels={PROJECT_LABEL: project})
        volumes = {v for n in todo for v, _ in named_volumes(services[n])}
        existing = {v.name for v in client.volumes.list(filters={"label": f"{PROJECT_LABEL}={project}"})}
        new_volumes = [client.volumes.create(f"{project}_{v}", labels={PROJECT_LABEL: project})
                       for v in sorted(volumes) if f"{project}_{v}" not in existing]
        for name in todo:
            for dependency, condition in depends_on(services[name]).items():
                if condition == "service_healthy":
                    wait_healthy(containers(client, project, dependency)[0], dependency, health_timeout_s)
            for stale in containers(client, project, name):
                stale.remove(force=True, v=True)
            container = _create(client, project, name, services[name], f"{project}_{name}_1")
            created.append(container)
            container.start()
            log(f"started {container.name}")
        for container in created:
            if container.attrs["Config"].get("Healthcheck"):
                wait_healthy(container, container.labels[SERVICE_LABEL], health_timeout_s)
    except BaseException:
        for container in created:
            container.remove(force=True, v=True)
        if new_network:
            new_network.remove()
        for volume in new_volumes or []:
            volume.remove(force=True)
        raise
    return todo


def compose_tool() -> list[str] | None:
    """Returns the installed compose command: `docker compose` (v2), `docker-compose` (v1), or None."""
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


def _up_with_compose(tool, client, project, todo, services, compose_file, environ, health_timeout_s, log) -> list[str]:
    """Starts the services with the compose tool, then waits for their health; takes them down on failure."""
    base = [*tool, "-p", project, "-f", str(compose_file)]
    label = {"label": f"{PROJECT_LABEL}={project}"}
    had_network = bool(client.networks.list(filters=label))
    had_volumes = {v.name for v in client.volumes.list(filters=label)}
    proc = subprocess.run([*base, "up", "-d", "--no-build", *todo], env=environ, capture_output=True, text=True)
    try:
        if proc.returncode != 0:
            last = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
            raise StackError(f"{' '.join(tool)} up failed ({last[:200]}): fix that and run `make up` again")
        for name in todo:
            for container in containers(client, project, name, every=False):
                if container.attrs["Config"].get("Healthcheck"):
                    wait_healthy(container, name, health_timeout_s)
    except BaseException:
        # Killed, not stopped, as the SDK path removes them: `stop` gives each container 10 s to end, one after the
        # other, and what just failed to start has nothing to end cleanly (a failed 2-service up: 25 s, killed 5 s).
        subprocess.run([*base, "kill", *todo], env=environ, capture_output=True)
        subprocess.run([*base, "rm", "-f", "-v", *todo], env=environ, capture_output=True)
        if not containers(client, project):  # nothing of the project is left: what this call made goes too
            for network in [] if had_network else client.networks.list(filters=label):
                network.remove()
            for volume in client.volumes.list(filters=label):
                if volume.name not in had_volumes:
                    volume.remove(force=True)
        raise
    log(f"started {', '.join(todo)} with {' '.join(tool)}")
    return todo


def run(name: str, command: list[str], project: str = PROJECT, environ: dict | None = None,
        compose_file: Path = COMPOSE_FILE, timeout_s: float = 900, entrypoint: list[str] | None = None) -> tuple[int, str]:
    """Runs one service's container once with another command (like `compose run --rm`); returns (exit code, log)."""
    environ = dict(os.environ if environ is None else environ)
    service = dict(load_services(compose_file, environ)[name])
    service.pop("ports", None)
    service.pop("healthcheck", None)
    if entrypoint is not None:
        service["entrypoint"] = entrypoint
    client = connect()
    container = _create(client, project, name, service, f"{project}_{name}_run_{int(time.time() * 1000) % 10**8}",
                        command=command, oneoff=True)
    try:
        container.start()
        try:
            code = container.wait(timeout=timeout_s)["StatusCode"]
        except Exception:
            container.kill()
            code = 124
        return code, container.logs().decode(errors="replace")
    finally:
        container.remove(force=True, v=True)


def down(project: str = PROJECT, volumes: bool = False, log=print) -> None:
    """Removes the project's containers and network (and its volumes with volumes=True)."""
    client = connect()
    for container in containers(client, project):
        container.remove(force=True, v=True)  # v: the anonymous volumes an image's VOLUME made
        log(f"removed {container.name}")
    for network in client.networks.list(filters={"label": f"{PROJECT_LABEL}={project}"}):
        network.remove()
    if volumes:
        for volume in client.volumes.list(filters={"label": f"{PROJECT_LABEL}={project}"}):
            volume.remove(force=True)
            log(f"removed volume {volume.name}")


def main(argv=None) -> None:
    parser = command_line("python docker/stack.py", __doc__, config=False)
    parser.add_argument("command", choices=["up", "down"])
    parser.add_argument("services", nargs="*", help="up: only these services (and what they depend on)")
    parser.add_argument("--project", default=os.environ.get("COMPOSE_PROJECT_NAME", PROJECT))
    parser.add_argument("--volumes", action="store_true", help="down: also remove the shared volume")
    parser.add_argument("--sdk", action="store_true", help="up: start with the Docker SDK even where a compose tool exists")
    parser.add_argument("--file", type=Path, default=COMPOSE_FILE, help="compose file (default: docker/compose.yaml)")
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            tool = None if args.sdk else compose_tool()
            started = up(args.services or None, args.project, compose_file=args.file, tool=tool)
            print(f"stack {args.project} is up ({', '.join(started) or 'already running'}); `make down` stops it")
        else:
            down(args.project, args.volumes)
    except StackError as exc:
        sys.exit(f"error: {exc}")


if __name__ == "__main__":
    main()
