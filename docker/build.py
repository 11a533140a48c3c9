"""Builds every service image through the Docker SDK for Python (what `make images` and CI's workflow run).

    python docker/build.py [--only evaluator,exporter] [--base-image IMAGE] [--registry REG/] [--push] [--gpu]

The base image is a build argument: the official Python image by default, or the one `make base-image` builds
from Debian's packages (used on its own when the official one cannot be pulled). Each image is tagged with the
project version, the git commit and `latest`, carries OCI labels, and its size is printed at the end. The pinned
CPU torch wheels, where this host's pip has them, reach the build over HTTP (WHEELS_URL), not in its context.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import http.server
import ipaddress
import re
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
import tomllib
import urllib.parse
from pathlib import Path

from shared.config import command_line

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "docker" / "Dockerfile"
# image name -> (Dockerfile, target); GPU images build only with --gpu (they pull multi-GB CUDA bases).
IMAGES = {
    "trainer-cpu": ("docker/Dockerfile", "trainer-cpu"),
    "evaluator": ("docker/Dockerfile", "evaluator"),
    "exporter": ("docker/Dockerfile", "exporter"),
    "server-cpu": ("docker/Dockerfile", "server-cpu"),
    "dashboards": ("docker/Dockerfile", "dashboards"),
    "prometheus": ("docker/Dockerfile", "prometheus"),
    "trainer": ("docker/Dockerfile.gpu", "trainer"),
    "server": ("docker/Dockerfile.gpu", "server"),
}
GPU_IMAGES = {"trainer", "server"}
LOCAL_BASE = "maze-grpo/base:bookworm"  # what docker/base-image.sh (make base-image) builds
HOST_CA_CERTS = Path("/usr/local/share/ca-certificates")  # Debian's place for locally added CAs


class BuildError(RuntimeError):
    """A build step failed; the message is one line saying what to do."""


def version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return "unknown"


@functools.cache
def commit_time() -> str:
    """The HEAD commit's time (UTC) for the `created` label: a rebuild of the same commit then changes no step, so
    it keeps every layer and the image IDs. Now, where there is no git history. Read once per build."""
    try:
        seconds = int(subprocess.run(["git", "log", "-1", "--format=%ct"], cwd=ROOT, capture_output=True, text=True,
                                     check=True).stdout.strip())
    except (subprocess.CalledProcessError, FileNotFoundError, ValueError):
        seconds = int(time.time())
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def dockerfile_arg(name: str) -> str:
    """Returns the default of `ARG name=...` in docker/Dockerfile (the one place each pin lives)."""
    match = re.search(rf'^ARG {name}="?([^"\n]+)"?$', DOCKERFILE.read_text(), re.MULTILINE)
    if not match:
        raise BuildError(f"docker/Dockerfile has no `ARG {name}=...` default")
    return match.group(1)


def labels(name: str, rev: str, base_image: str) -> dict:
    return {
        "org.opencontainers.image.title": f"maze-grpo-{name}",
        "org.opencontainers.image.version": version(),
        "org.opencontainers.image.revision": rev,
        "org.opencontainers.image.created": commit_time(),
        "org.opencontainers.image.source": "https://github.com/maze-grpo/maze-grpo",
        "org.opencontainers.image.description": f"maze-grpo {name} service",
        "org.opencontainers.image.base.name": base_image,
    }


def connect():
    """Returns a Docker client whose engine answers, or raises BuildError saying how to get one."""
    try:
        import docker

        client = docker.from_env(timeout=600)
        client.ping()
        return client
    except ImportError as exc:
        raise BuildError("the Docker SDK for Python is missing: pip install 'docker>=7' (make setup installs it)") from exc
    except Exception as exc:
        raise BuildError(f"no Docker engine reachable ({type(exc).__name__}): start Docker (or set DOCKER_HOST) and try "
                         "again; `bash docker/with-engine.sh COMMAND` installs and starts one where it is root with apt") from exc


def resolve_base(client, base_image: str, explicit: bool) -> str:
    """Returns the base image to build on: the one asked for when present or pullable, else the local base."""
    import docker

    try:
        client.images.get(base_image)
        return base_image
    except docker.errors.ImageNotFound:
        pass
    try:
        print(f"pulling {base_image}", flush=True)
        client.images.pull(base_image)
        return base_image
    except docker.errors.APIError as exc:
        reason = str(exc.explanation or exc).splitlines()[0][:160]
    if not explicit:
        try:
            client.images.get(LOCAL_BASE)
            print(f"{base_image} cannot be pulled ({reason}); building on the local base {LOCAL_BASE}", flush=True)
            return LOCAL_BASE
        except docker.errors.ImageNotFound:
            pass
    hint = ("run `make base-image` (builds it from Debian's packages)" if base_image == LOCAL_BASE else
            f"run `make base-image` to build {LOCAL_BASE} from Debian's packages, then `make images` again")
    raise BuildError(f"base image {base_image} is not here and cannot be pulled ({reason}): {hint}")


def fill_wheelhouse(torch_pins: list[str]) -> None:
    """Copies the pinned torch wheels into docker/wheels/ when this host's pip has them (a local index or cache)."""
    wheels = ROOT / "docker" / "wheels"
    wheels.mkdir(exist_ok=True)
    pinned = [pin.replace("==", "-") + "-" for pin in torch_pins]  # torch==2.13.0+cpu: torch-2.13.0+cpu-*.whl
    for stale in wheels.glob("*.whl"):  # another pin's: served beside the pinned ones, they would only mislead
        if not stale.name.startswith(tuple(pinned)):
            stale.unlink()
    if all(list(wheels.glob(f"{prefix}*.whl")) for prefix in pinned):
        return
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--dest", str(wheels),
                           *torch_pins], capture_output=True, text=True)
    if proc.returncode != 0:
        for stale in wheels.glob("*.whl"):
            stale.unlink()
        print(f"{' '.join(torch_pins)}: not in this host's pip sources; the images take them from the CPU index")


def interface_ipv4(name: str) -> str:
    """Returns the IPv4 address of this host's network interface `name`, or "" when it has none (Linux only)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            request = struct.pack("256s", name[:15].encode())
            return socket.inet_ntoa(fcntl.ioctl(sock.fileno(), 0x8915, request)[20:24])  # SIOCGIFADDR
    except OSError:
        return ""


def bridge_gateway(client) -> str:
    """Returns the IPv4 gateway of the default Docker bridge (where a build step reaches the host), or "" when the
    engine is not this machine's (a remote DOCKER_HOST: its bridge is another host's) or has no such bridge.

    An engine that creates its bridge interface itself (a fresh machine: no docker0 before dockerd's first start)
    records the bridge's subnet without its gateway: the gateway is then the interface's own address, inside that
    subnet."""
    if client.api.base_url != "http+docker://localhost":  # docker-py's name for a local unix socket
        return ""
    try:
        attrs = client.networks.get("bridge").attrs
    except Exception as exc:  # noqa: BLE001 - no default bridge (another network driver): the caller takes the index
        print(f"note: the engine's default bridge is not readable ({type(exc).__name__}: {exc})", flush=True)
        return ""
    configs = (attrs.get("IPAM") or {}).get("Config") or []
    gateway = next((c["Gateway"] for c in configs if c.get("Gateway") and ":" not in c["Gateway"]), "")
    if gateway:
        return gateway
    interface = (attrs.get("Options") or {}).get("com.docker.network.bridge.name", "docker0")
    address = interface_ipv4(interface)
    subnets = [ipaddress.ip_network(c["Subnet"]) for c in configs if ":" not in c.get("Subnet", ":")]
    if address and any(ipaddress.ip_address(address) in subnet for subnet in subnets):
        return address
    print(f"note: the engine's default bridge has no IPv4 gateway (IPAM config {configs}; {interface}: "
          f"{address or 'no IPv4 address'})", flush=True)
    return ""


@contextlib.contextmanager
def served_wheels(folder: Path, host: str):
    """Serves folder/*.whl over HTTP on host while the block runs; yields the find-links URL (WHEELS_URL), or ""
    when there are no wheels or no host to serve them on (the build then takes the CPU index).

    The path holds the wheels' digest, so the torch layer is built again exactly when the wheels change, and the
    port is derived from it so that a rebuild finds its cached layer (another port, taken only when that one is
    busy, builds the layer again)."""
    wheels = sorted(folder.glob("*.whl"))
    if not wheels or not host:
        print(f"note: {'no wheels in ' + str(folder) if not wheels else 'no address to serve them on'}: the images "
              "take torch from the CPU index", flush=True)
        yield ""
        return
    digest = hashlib.sha256()
    for wheel in wheels:
        digest.update(wheel.name.encode())
        with open(wheel, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    key = digest.hexdigest()[:16]
    files = {wheel.name: wheel for wheel in wheels}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):  # noqa: N802 - http.server's names; uv asks HEAD first, then GET
            self._answer(body=False)

        def do_GET(self):  # noqa: N802
            self._answer(body=True)

        def _answer(self, body: bool) -> None:
            wheel = files.get(urllib.parse.unquote(self.path.removeprefix(f"/{key}/")))
            if wheel is None and self.path != f"/{key}/":
                self.send_error(404)
                return
            page = b"" if wheel else "".join(f'<a href="{n}">{n}</a>\n' for n in files).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream" if wheel else "text/html")
            self.send_header("Content-Length", str(wheel.stat().st_size if wheel else len(page)))
            self.end_headers()
            if body and wheel:
                with open(wheel, "rb") as handle, contextlib.suppress(ConnectionError):  # a client gone mid-file
                    shutil.copyfileobj(handle, self.wfile)
            elif body:
                self.wfile.write(page)

        def log_message(self, *args) -> None:
            pass

    preferred = 20000 + int(key, 16) % 30000
    try:
        server = http.server.ThreadingHTTPServer((host, preferred), Handler)
    except OSError:
        try:
            server = http.server.ThreadingHTTPServer((host, 0), Handler)
        except OSError as exc:
            print(f"note: cannot serve {folder.name}/*.whl on {host} ({exc.strerror}); the images take torch from "
                  "the CPU index", flush=True)
            yield ""
            return
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://{host}:{server.server_address[1]}/{key}/"
    finally:
        server.shutdown()
        server.server_close()


def image_extras() -> list[str]:
    """Returns the extras docker/Dockerfile installs (its `".[trainer,evaluator,server]"`-style arguments), in order."""
    found = re.findall(r'"\.\[([\w,-]+)\]"', DOCKERFILE.read_text())
    if not found:
        raise BuildError("docker/Dockerfile installs no `.[extras]` of the project: nothing to pin")
    return list(dict.fromkeys(extra for group in found for extra in group.split(",")))


def venv_mismatches(extras: list[str]) -> list[str]:
    """Returns the requirements of the project with `extras` this venv does not satisfy (empty when `make setup` made
    it). A self-reference (maze-grpo[models]) brings that extra's requirements in."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted, todo, seen = list(project["dependencies"]), list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for line in project["optional-dependencies"][extra]:
            requirement = Requirement(line)
            if requirement.name == project["name"]:
                todo.extend(requirement.extras)
            else:
                wanted.append(line)
    problems = []
    for line in wanted:
        requirement = Requirement(line)
        try:
            have = installed(requirement.name)
        except PackageNotFoundError:
            have = None
        if have is None or not requirement.specifier.contains(have, prereleases=True):
            problems.append(f"{requirement} (venv: {have or 'missing'})")
    return problems


def write_constraints() -> str:
    """Writes docker/wheels/constraints.txt from this venv's versions, so the images get what the tests ran with.

    Returns a line saying what was pinned; the file stays empty when the venv does not hold the requirements of the
    extras docker/Dockerfile installs."""
    target = ROOT / "docker" / "wheels" / "constraints.txt"
    target.write_text("")
    mismatches = venv_mismatches(image_extras())
    if mismatches:
        return (f"no versions pinned: this venv does not match pyproject.toml ({mismatches[0]}; `make setup` "
                "rebuilds it); uv resolves pyproject.toml's ranges in the images")
    proc = subprocess.run([sys.executable, "-m", "pip", "freeze", "--exclude-editable"], capture_output=True, text=True)
    # torch is the Dockerfile's own pin (a CPU build); pip's own tools stay as the base image has them.
    skip = re.compile(r"^(torch|torchvision|torchaudio|triton|nvidia-[\w-]+|pip|setuptools|wheel)==", re.IGNORECASE)
    pins = [line for line in proc.stdout.splitlines() if "==" in line and not skip.match(line)]
    target.write_text("".join(f"{pin}\n" for pin in pins))
    return f"pinned {len(pins)} packages to this venv's versions (docker/wheels/constraints.txt)"


def copy_ca_certs(source: Path | None) -> int:
    """Copies extra CA certificates (*.crt) into the build context; returns how many the images will trust."""
    target = ROOT / "docker" / "ca-certificates"
    target.mkdir(exist_ok=True)
    for old in target.glob("*.crt"):
        old.unlink()
    found = sorted(source.glob("*.crt")) if source and source.is_dir() else []
    for cert in found:
        shutil.copyfile(cert, target / cert.name)
    return len(found)


# A build step's CPU weight under --yield-cpu: a quarter of a process's (the engine's default is 1024).
YIELDING_CPU_SHARES = 256


def build_one(client, name: str, repo: str, build_args: dict, rev: str, yield_cpu: bool = False) -> tuple:
    """Builds one image, streaming its log; returns the image. Raises BuildError with the failing step. With
    `yield_cpu`, the build's steps run at a quarter of a process's CPU weight: work beside it keeps the cores."""
    dockerfile, target = IMAGES[name]
    tail: list[str] = []
    image_id = None
    stream = client.api.build(path=str(ROOT), dockerfile=dockerfile, target=target, tag=f"{repo}:{version()}",
                              buildargs=build_args, labels=labels(name, rev, build_args.get("BASE_IMAGE", "")),
                              rm=True, forcerm=True, decode=True,
                              container_limits={"cpushares": YIELDING_CPU_SHARES} if yield_cpu else None)
    for chunk in stream:
        if "stream" in chunk:
            sys.stdout.write(chunk["stream"])
            tail = (tail + chunk["stream"].splitlines())[-15:]
        if "aux" in chunk and "ID" in chunk["aux"]:
            image_id = chunk["aux"]["ID"]
        if "error" in chunk:
            raise BuildError(f"{name}: the build failed: {chunk['error'].strip()[:300]} (log above)")
    sys.stdout.flush()
    if not image_id:
        raise BuildError(f"{name}: the engine returned no image ({' '.join(tail)[-200:]})")
    image = client.images.get(image_id)
    for tag in (rev, "latest"):
        image.tag(repo, tag)
    return image


def prune_superseded(client, repo: str, keep) -> int:
    """Removes this repo's images that `keep` (the build just made) replaced; returns how many went.

    Each build tags the commit it came from, so without this every commit tested leaves a full set of images
    behind. Images with no tag left (superseded `latest`) go too; containers still using one keep it."""
    import docker

    removed = 0
    for image in client.images.list(name=repo) + client.images.list(filters={"dangling": True}):
        title = (image.labels or {}).get("org.opencontainers.image.title")
        if image.id == keep.id or title != keep.labels.get("org.opencontainers.image.title"):
            continue
        try:
            for tag in image.tags or [image.id]:  # untagging the last name removes the image
                client.images.remove(tag)
            removed += 1
        except docker.errors.APIError:
            pass  # in use by a container: left alone
    return removed


def main(argv=None) -> None:
    parser = command_line("python docker/build.py", __doc__, config=False)
    parser.add_argument("--only", default="", help="comma-separated image names (default: all CPU images)")
    parser.add_argument("--gpu", action="store_true", help="also build the GPU images (trainer, server)")
    parser.add_argument("--base-image", default="", help="base of the CPU images (default: the official python image "
                        f"from docker/Dockerfile, or {LOCAL_BASE} when that cannot be pulled)")
    parser.add_argument("--ca-certs", default=str(HOST_CA_CERTS), help="folder of extra CA certificates (*.crt) the "
                        "images trust, e.g. a proxy's (default: this host's locally added ones; '' for none)")
    parser.add_argument("--registry", default="", help="prefix for the image names, e.g. 123.dkr.ecr.us-west-2.amazonaws.com/")
    parser.add_argument("--push", action="store_true", help="push every tag after building (needs --registry)")
    parser.add_argument("--yield-cpu", action="store_true", help="run the build steps at a quarter of a process's CPU "
                        "weight, so that work beside the build keeps the cores (make test builds beside its tests)")
    parser.add_argument("--keep-old", action="store_true", help="keep the images earlier commits built (default: "
                        "each build removes the ones it replaces)")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or [n for n in IMAGES if args.gpu or n not in GPU_IMAGES]
    unknown = [n for n in names if n not in IMAGES]
    if unknown:
        sys.exit(f"error: unknown image {unknown[0]!r}: choose from {', '.join(IMAGES)}")
    if args.push and not args.registry:
        sys.exit("error: --push needs --registry (e.g. --registry 123.dkr.ecr.us-west-2.amazonaws.com/)")
    try:
        client = connect()
        cpu = [n for n in names if n not in GPU_IMAGES]
        build_args = {}
        if cpu:
            build_args["BASE_IMAGE"] = resolve_base(client, args.base_image or dockerfile_arg("BASE_IMAGE"),
                                                    explicit=bool(args.base_image))
            fill_wheelhouse(dockerfile_arg("TORCH").split())
            print(write_constraints())
            trusted = copy_ca_certs(Path(args.ca_certs) if args.ca_certs else None)
            if trusted:
                print(f"the images trust {trusted} extra CA certificate(s) from {args.ca_certs}")
        rev = commit()
        built = []
        with served_wheels(ROOT / "docker" / "wheels", bridge_gateway(client) if cpu else "") as wheels_url:
            if wheels_url:
                build_args["WHEELS_URL"] = wheels_url
                print(f"torch wheels served to the build at {wheels_url}", flush=True)
            for name in names:
                repo = f"{args.registry}maze-grpo/{name}"
                print(f"==> {repo}:{version()} ({IMAGES[name][0]}, target {IMAGES[name][1]})", flush=True)
                started = time.time()
                image = build_one(client, name, repo, build_args if name in cpu else {}, rev, args.yield_cpu)
                built.append((repo, image, time.time() - started))
                if not args.keep_old:
                    removed = prune_superseded(client, repo, image)
                    if removed:
                        print(f"removed {removed} superseded {repo} image(s) (--keep-old keeps them)", flush=True)
                if args.push:
                    for tag in (version(), rev, "latest"):
                        for line in client.api.push(repo, tag=tag, stream=True, decode=True):
                            if "error" in line:
                                raise BuildError(f"push of {repo}:{tag} failed: {line['error']}: log in to the registry first")
    except BuildError as exc:
        sys.exit(f"error: {exc}")
    print(f"\n{'image':<44} {'tags':<28} {'size':>9} {'build':>7}")
    for repo, image, seconds in built:
        print(f"{repo:<44} {version() + ', ' + rev + ', latest':<28} {image.attrs['Size'] / 1e6:>6.0f} MB {seconds:>6.0f}s")


if __name__ == "__main__":
    main()
