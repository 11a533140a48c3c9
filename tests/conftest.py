"""Shared fixtures: a tiny Qwen3-VL built once per test session on a temporary shared volume."""

import importlib.metadata
import ipaddress
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from shared.net import free_port

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# The Ray heads the tests start with a dashboard (job submission, metrics) wait 30 s for its nine module processes
# by default; on a 2-core machine running `make test`'s second stream beside them (an image build, SkyRL's checks)
# they can need longer, and the head then fails to start (seen twice). The wait only bounds a start-up.
os.environ.setdefault("RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT", "180")
REPO = Path(__file__).resolve().parent.parent
# tests/skyrl_checks runs SkyRL's own code: in .venv-skyrl (Python 3.12), as `make test`'s second pytest run.
try:
    importlib.metadata.version("skyrl")
    collect_ignore = []
except importlib.metadata.PackageNotFoundError:
    collect_ignore = ["skyrl_checks"]


# `make test` sets this where it could install every dependency (root with apt): a skipped test there is a missing
# install step, not a machine without the tool, and fails the run.
REQUIRE_ALL = "MAZE_GRPO_REQUIRE_ALL_TESTS"
_skipped: list[str] = []


# The modules that start services, engines or containers (make test-fast leaves them out: `-m "not slow"`); tests
# elsewhere that run a trainer or a server mark themselves slow.
SLOW_MODULES = {"test_containers_e2e", "test_rollout_vllm", "test_server_vllm", "test_submit", "test_run_lock",
                "test_gpu_image", "test_server", "test_server_hostile", "test_exporter", "test_dashboards",
                "test_evaluator", "test_bad_input", "test_skyrl_backend"}


# Modules that need an engine beside the main venv: `make test` runs them in a later phase (tests/suite.py), once
# .venv-vllm is installed and the images are built.
ENGINE_MODULES = {"test_rollout_vllm": "vllm", "test_server_vllm": "vllm", "test_containers_e2e": "docker"}


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        if module in SLOW_MODULES or "skyrl_checks" in str(item.fspath):
            item.add_marker(pytest.mark.slow)
        if module in ENGINE_MODULES:
            item.add_marker(getattr(pytest.mark, ENGINE_MODULES[module]))
        # Under two workers (`make test`), tests sharing a module-scoped fixture (a trained run, a started server)
        # stay on one worker, so it is built once; the rest spread freely.
        shared = sorted(name for name, defs in item._fixtureinfo.name2fixturedefs.items()
                        if defs and defs[-1].scope == "module")
        if shared:
            item.add_marker(pytest.mark.xdist_group(f"{module}:{','.join(shared)}"))


# Session services that keep processes running (an idle Ray Serve app takes about a sixth of a core on these
# machines): each is stopped right after the last test that uses it rather than at the session's end, so the tests
# after it get the whole machine. Their fixtures register a stop function here; stopping twice is harmless.
_EARLY_STOP = ("server",)
_stoppers: dict = {}
_last_users: dict[str, str] = {}


def pytest_runtest_teardown(item, nextitem):
    if not _last_users:
        for candidate in item.session.items:
            for name in _EARLY_STOP:
                if name in getattr(candidate, "fixturenames", ()):
                    _last_users[name] = candidate.nodeid
    for name, nodeid in _last_users.items():
        if item.nodeid == nodeid and name in _stoppers:
            _stoppers.pop(name)()


def pytest_runtest_logreport(report):
    if report.skipped:
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _skipped.append(f"{report.nodeid}: {reason}")


def pytest_sessionfinish(session, exitstatus):
    if _skipped and os.environ.get(REQUIRE_ALL) == "1":
        print(f"\n{len(_skipped)} tests skipped where `make test` installs what they need ({REQUIRE_ALL}=1): "
              "a missing install step, so the run fails:\n  " + "\n  ".join(_skipped))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("shared")


@pytest.fixture(scope="session")
def tiny_cfg(shared_dir):
    from shared.config import load_config

    return load_config(REPO / "configs" / "tiny-cpu.yaml", [f"storage.shared_dir={shared_dir}"], environ={})


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_cfg) -> Path:
    from shared.models.tiny import ensure_tiny_model

    return ensure_tiny_model(tiny_cfg, log=lambda *_: None)


@pytest.fixture(scope="session")
def tiny(tiny_model_dir):
    from shared.models.loading import load_model

    return load_model(tiny_model_dir)


# 7x7 mazes in 10 turns (753 distinct mazes in 3,000 seeds, so GRPO's fresh mazes and the 64 held out stay apart),
# and a short warm start: the solver's replies on 310 mazes (142 batches) teach the reply format and little of the
# walls, so it solves none of the 64, never says `stop` and walks into a wall in most (docs/experiments.md): what
# the transfer test starts from, and the GRPO run through vLLM and SkyRL's chain (a warm start that answers in
# format is all they need). These are the settings it was built with; the tests read it from
# tests/fixtures/models/sft-7x7 (see `warm_start_7x7`).
TRANSFER = ["env.id=maze_2d/7x7", "env.eval_env=maze_2d/7x7", "env.max_turns=10", "env.eval_seeds=0-63",
            "env.extended_eval_seeds=null", "env.reward=task_progress", "model.path=sft-7x7", "sft.num_mazes=310",
            "sft.batch_size=16", "rollout.max_new_tokens=7"]


@pytest.fixture(scope="session")
def warm_start_7x7() -> Path:
    """Returns the `models/` folder holding the transfer test's warm start, pinned in the repository rather than
    built per run: a warm start stopped where SFT starts to read the picture lands somewhere else on each CPU type
    (AVX2 and AVX-512 kernels round differently, and 142 batches amplify it: 0/64 here, 1/64 there, and GRPO then
    moves one and not the other), while GRPO from one fixed warm start does the same under both (docs/experiments.md,
    "The transfer test, pinned"). Rebuilt by `SHARED_DIR=DIR python -m services.trainer.sft <TRANSFER>`, then
    DIR/models/sft-7x7 copied here; the trainer verifies its manifest and refuses it if TRANSFER's SFT settings
    change."""
    return REPO / "tests" / "fixtures" / "models"


@pytest.fixture(scope="session")
def ray_head_address():
    """One Ray head on loopback for the session's trainer runs (`RAY_ADDRESS`: each joins it instead of starting a
    Ray of its own, about 10-20 s apiece here); the other modules' trainer runs start theirs, as `make train` does
    (tests/test_run_lock.py checks that start). Its ports are its own, so it never meets another Ray on the machine."""
    from shared.local_ray import stop_ray_started_in

    ray_cli = str(Path(sys.executable).parent / "ray")
    temp_dir = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    port = free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    subprocess.run([ray_cli, "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=2",
                    "--include-dashboard=false", f"--dashboard-agent-listen-port={free_port()}",
                    f"--temp-dir={temp_dir}", "--disable-usage-stats"], check=True, env=env, capture_output=True,
                   timeout=180)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        stop_ray_started_in(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3-compatible HTTP server (moto in server mode) on loopback, for the whole session."""
    from shared.storage.local_s3 import start_server

    proc, url = start_server()
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="session")
def exported_run(tiny_cfg, tiny_model_dir):
    """A run folder with two real LoRA exports (steps 2 and 4) of the tiny model, as the trainer writes them."""
    import torch

    from services.trainer.rollout import build_policy
    from shared.storage.files import atomic_write_json, staged_dir
    from shared.storage.volume import SharedVolume

    volume = SharedVolume(tiny_cfg.shared_path())
    run_id = "exp-run"
    lora = tiny_cfg.lora.model_copy(update={"rank": 4, "alpha": 8})
    model, _ = build_policy(tiny_model_dir, lora, tiny_cfg.model.base_model_id)
    for step, rate in ((2, 0.25), (4, 0.125)):
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.fill_(0.01 * step)
        with staged_dir(volume.export(run_id, step)) as tmp:
            model.save_pretrained(str(tmp), save_embedding_layers=False)
        # The trainer's eval of that step (fixture data: which step is "best" is what the exporter reads).
        atomic_write_json(volume.eval(run_id, f"global_step_{step}") / "summary.json",
                          {"solve_rate": rate, "solved": int(rate * 64), "total": 64, "step": step})
    return volume, run_id


SERVER_KEY = "test-key-123"
SERVER_BASE = "tiny-qwen3vl-sft"
# Small limits so the hostile-input tests reach them cheaply; adapters re-checked every second.
SERVER_OVERRIDES = ["server.max_image_bytes=200000", "server.max_images_per_request=3",
                    "server.max_num_adapters_per_replica=1", "server.max_prompt_tokens=1000",
                    "server.max_request_bytes=1500000", "server.adapter_revalidate_s=1"]


def assert_no_inductor_kernels(cache_dir: str | Path) -> None:
    """Fails if TorchInductor wrote kernels into cache_dir (a vLLM engine on CPU runs its sampler's helpers eagerly:
    shared.models.VLLM_CPU_ENV)."""
    compiled = [path for path in Path(cache_dir).rglob("*") if path.is_file()]
    assert not compiled, f"the CPU engine compiled its sampler's helpers with TorchInductor: {compiled[:3]}"


def stop_process_group(proc: subprocess.Popen, grace_s: float) -> None:
    """Ends a service started with start_new_session=True: SIGTERM to its group, SIGKILL after grace_s; a no-op once
    it has exited."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def server(exported_run, tiny_model_dir, s3_endpoint, tmp_path_factory):
    """The real server (python -m services.server) on loopback with a key, serving the exported run's adapters.

    Yields (url, cfg, run_id, env, pid): env is what the exporter CLI needs to reach the same S3 and shared volume.
    """
    from shared.config import load_config
    from shared.net import wait_for_http
    from shared.storage.s3 import s3_client

    volume, run_id = exported_run
    bucket = "served"
    s3_client(s3_endpoint).create_bucket(Bucket=bucket)
    env = {**os.environ, "SHARED_DIR": str(volume.root), "AWS_ENDPOINT_URL": s3_endpoint, "S3_URI": f"s3://{bucket}/p",
           "SERVER_API_KEY": SERVER_KEY, "RAY_USAGE_STATS_ENABLED": "0"}
    subprocess.run([sys.executable, "-m", "services.exporter", "--run", run_id], env=env, cwd=REPO, check=True,
                   capture_output=True, timeout=120)
    port = free_port()
    overrides = [f"model.path={tiny_model_dir}", f"model.base_model_id={SERVER_BASE}", f"server.port={port}",
                 *SERVER_OVERRIDES]
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "services.server", *overrides], env=env, cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def alive():
        assert proc.poll() is None, "server exited: " + Path(log.name).read_text()[-3000:]

    def stop():
        stop_process_group(proc, grace_s=30)

    _stoppers["server"] = stop
    wait_for_http(f"{url}/healthz", timeout_s=240, alive=alive)
    cfg = load_config(None, [f"storage.shared_dir={volume.root}", *overrides[:2]],
                      environ={"S3_URI": f"s3://{bucket}/p", "AWS_ENDPOINT_URL": s3_endpoint})
    yield url, cfg, run_id, env, proc.pid
    _stoppers.pop("server", None)
    stop()


def _is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]").split("%")[0]
    if host == "*":
        return False
    ip = ipaddress.ip_address(host)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return ip.is_loopback


@pytest.fixture
def loopback_only():
    """A check: every TCP socket that a process and its descendants listen on (`ss -ltnp`) is on loopback.

    Returns the (address, process name) pairs it checked.
    """
    import psutil

    def check(pid: int) -> list[tuple[str, str]]:
        family = {pid} | {p.pid for p in psutil.Process(pid).children(recursive=True)}
        out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
        listeners = []
        for line in out.splitlines():
            owner = next((p for p in family if f"pid={p}," in line), None)
            if owner is not None:
                name = line.split('(("', 1)[1].split('"', 1)[0] if '(("' in line else "?"
                listeners.append((line.split()[3], name))
        exposed = [entry for entry in listeners if not _is_loopback(entry[0])]
        assert listeners and not exposed, f"listening beyond loopback: {exposed}"
        return listeners

    return check
