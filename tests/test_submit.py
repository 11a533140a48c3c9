"""make submit: a real job on a local Ray head (loopback), and the HyperPod preflight against moto's
SageMaker API in server mode (a real HTTP endpoint, no patching)."""

import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import boto3
import pytest
import yaml

from services.trainer.submit import check_cluster, describe_hyperpod
from shared.config import load_config
from shared.local_ray import alive, ray_processes_started_in, stop_ray_started_in
from shared.net import free_port
from shared.storage.manifest import verify_manifest

REPO = Path(__file__).resolve().parent.parent
MINIMAL = ["sft.num_mazes=8", "rollout.train_batch_size=2", "rollout.n_samples_per_prompt=2", "env.max_turns=3",
           "env.reward=task_progress",
           "env.eval_seeds=0-1", "env.extended_eval_seeds=null", "rollout.max_new_tokens=7", "rollout.eval_samples=0", "schedule.total_steps=2", "schedule.eval_interval=2",
           "schedule.ckpt_interval=2", "schedule.hf_save_interval=2", "lora.rank=4", "lora.alpha=8"]


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """One local Ray head (loopback) for the submissions below, as a cluster node is set up: its `python` is the one
    with the project's dependencies, and its environment's SHARED_DIR is the cluster's storage."""
    ray_cli = str(Path(sys.executable).parent / "ray")
    temp_dir = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    dashboard = free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    cluster_storage = tmp_path_factory.mktemp("cluster") / "shared"  # the cluster's /shared
    cluster_storage.mkdir(mode=0o755)
    subprocess.run([ray_cli, "start", "--head", "--port=0", "--node-ip-address=127.0.0.1", "--num-cpus=2",
                    "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}", f"--temp-dir={temp_dir}",
                    # its own agent port: the default (52365) may be held by another Ray on this machine
                    f"--dashboard-agent-listen-port={free_port()}", "--disable-usage-stats"], check=True,
                   env={**env, "SHARED_DIR": str(cluster_storage)}, capture_output=True, timeout=180)
    # Every process of the node, the retitled agents (whose command lines do not name temp_dir) included: each must
    # end with the node, or it spins on a core for a minute or more.
    node = ray_processes_started_in(temp_dir)
    titles = [" ".join(process.cmdline()).strip() for process in node]
    try:
        assert {"ray::DashboardAgent", "ray::RuntimeEnvAgent"} <= {title.split()[0] for title in titles}, titles
        yield f"http://127.0.0.1:{dashboard}", env, cluster_storage
    finally:
        stop_ray_started_in(temp_dir)
        left = [" ".join(process.cmdline()) for process in [*node, *ray_processes_started_in(temp_dir)] if alive(process)]
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert not left, f"left running after stop_ray_started_in: {left}"


def test_submit_a_two_step_job_to_a_local_ray_head(ray_head, tmp_path):
    address, env, cluster_storage = ray_head
    shared, records = tmp_path / "shared", tmp_path / "records"
    # The job's storage is asked for on purpose (an override); the submitter's own SHARED_DIR stays here.
    submit_env = {**env, "RAY_ADDRESS": address, "SHARED_DIR": str(tmp_path / "mine")}
    proc = subprocess.run([sys.executable, "-m", "services.trainer", "submit", "--timeout", "900", *MINIMAL,
                           "run_id=submitted", f"storage.shared_dir={shared}", "--record-dir", str(records)],
                          cwd=REPO, env=submit_env, capture_output=True, text=True, timeout=1000)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = shared / "runs" / "submitted"
    job = json.loads((records / "submitted.json").read_text())
    assert job["status"] == "SUCCEEDED" and job["job_id"] and "SHARED_DIR" not in job["forwarded_env"]
    assert not (tmp_path / "mine").exists(), "the submitting shell's SHARED_DIR went into the job"
    assert not (cluster_storage / "runs" / "submitted").exists(), "the override did not reach the job"
    verify_manifest(run / "exports" / "global_step_2" / "policy")
    assert (run / "evals" / "global_step_2" / "summary.json").exists()
    assert "== submitted: 2 GRPO steps" in proc.stdout  # the job's own log, streamed: its end-of-run summary


# moto's SageMaker knows only older instance types (no ml.r5d/ml.g7e), so the clusters below use types it
# accepts and the config's cluster section is set to match; the check itself is type-agnostic.
HEAD, WORKER = "ml.m5.16xlarge", "ml.g5.12xlarge"  # ml.g5.12xlarge has 4 GPUs


def _hyperpod(endpoint, name, workers, worker_type=WORKER, serving=1):
    """Creates a HyperPod cluster as the runbook's table has it: a head, the training workers, and a serving group
    of the same GPU type (left out with serving=0)."""
    client = boto3.client("sagemaker", endpoint_url=endpoint, region_name="us-west-2",
                          aws_access_key_id="local", aws_secret_access_key="local")
    groups = [("head", HEAD, 1), ("workers", worker_type, workers)] + [("serving", worker_type, serving)] * (serving > 0)
    client.create_cluster(ClusterName=name, InstanceGroups=[
        {"InstanceGroupName": g, "InstanceType": t, "InstanceCount": n,
         "LifeCycleConfig": {"SourceS3Uri": "s3://sagemaker-lifecycle/scripts/", "OnCreate": "on_create.sh"},
         "ExecutionRole": "arn:aws:iam::123456789012:role/hyperpod", "ThreadsPerCore": 1} for g, t, n in groups])


def test_hyperpod_preflight_against_the_sagemaker_api(s3_endpoint, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "local")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "local")
    cfg = load_config(REPO / "configs/qwen3vl-8b-hyperpod.yaml",
                      [f"cluster.head_instance_type={HEAD}", f"cluster.worker_instance_type={WORKER}",
                       "cluster.num_workers=2", "cluster.gpus_per_worker=4"], environ={})
    good_name, small_name = f"good-{uuid.uuid4().hex[:8]}", f"small-{uuid.uuid4().hex[:8]}"
    _hyperpod(s3_endpoint, good_name, 2)
    _hyperpod(s3_endpoint, small_name, 1)
    good = describe_hyperpod(good_name, "us-west-2", endpoint_url=s3_endpoint)
    assert len(good["nodes"]) == 4 and check_cluster(cfg, good) == [], good
    # The serving group has the workers' type: counted by type alone, the training workers would be 3.
    by_type = cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"worker_instance_group": None})})
    assert any(f"3 worker nodes of type {WORKER}, config expects 2" in p for p in check_cluster(by_type, good))
    no_serving_name = f"noserve-{uuid.uuid4().hex[:8]}"
    _hyperpod(s3_endpoint, no_serving_name, 2, serving=0)
    no_serving = check_cluster(cfg, describe_hyperpod(no_serving_name, "us-west-2", endpoint_url=s3_endpoint))
    assert no_serving == ["no instance group 'serving' for serving (cluster.serve_instance_group); the cluster has "
                          "head, workers"], no_serving
    small = check_cluster(cfg, describe_hyperpod(small_name, "us-west-2", endpoint_url=s3_endpoint))
    assert any(f"1 worker nodes of type {WORKER}, config expects 2" in p for p in small)
    assert any("4 GPUs" in p and "6 rollout engines" in p for p in small)


def test_submit_stops_on_a_mismatched_cluster(s3_endpoint, tmp_path):
    name = f"wrong-{uuid.uuid4().hex[:8]}"
    _hyperpod(s3_endpoint, name, 3)  # the reference profile wants ml.r5d.16xlarge + 3 x ml.g7e.12xlarge
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # the address comes from cluster.ray_cluster
    env.update({"SAGEMAKER_ENDPOINT_URL": s3_endpoint, "AWS_ACCESS_KEY_ID": "local",
                "AWS_SECRET_ACCESS_KEY": "local", "AWS_REGION": "us-west-2", "SHARED_DIR": str(tmp_path)})
    proc = subprocess.run([sys.executable, "-m", "services.trainer", "submit", "--config", "configs/qwen3vl-8b-hyperpod.yaml",
                           f"cluster.hyperpod_cluster={name}", f"storage.shared_dir={tmp_path}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "HyperPod preflight failed" in proc.stderr and "ml.g7e.12xlarge" in proc.stderr and "--force" in proc.stderr


def test_submit_needs_an_address(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-m", "services.trainer", "submit", f"storage.shared_dir={tmp_path}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "RAY_ADDRESS" in proc.stderr


def test_a_cluster_the_plugin_cannot_reach_is_one_line_naming_the_set_up(tmp_path):
    """No HyperPod cluster named (the preflight is skipped) and no kubeconfig on this machine: the address plugin's
    own error, in one line, with the section of the runbook that sets it up; never a traceback."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "KUBECONFIG")}
    env.update(HOME=str(tmp_path), SHARED_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "services.trainer", "submit", "--config", "configs/qwen3vl-8b-hyperpod.yaml",
                           "cluster.hyperpod_cluster=", "--no-follow"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("error: cannot reach the Ray cluster at sagemaker_ray://maze-grpo/default: KubeconfigError")
    assert "docs/hyperpod.md, section 1" in line and "aws eks update-kubeconfig" in line
    assert not (tmp_path / ".local").exists(), "nothing recorded: no job was submitted"


def test_sagemaker_ray_address_plugin_is_installed():
    """Ray resolves `sagemaker_ray://...` by importing the module the scheme names and calling its
    `get_job_submission_client_cluster_info` (ray.dashboard.modules.dashboard_sdk): both must be there."""
    import inspect

    from ray.dashboard.modules.dashboard_sdk import split_address

    module_name, inner = split_address("sagemaker_ray://my-cluster/default")
    module = importlib.import_module(module_name)  # the trainer extra carries it
    hook = module.get_job_submission_client_cluster_info
    assert inner == "my-cluster/default" and callable(hook)
    # Ray calls it with the inner address and create_cluster_if_needed/cookies/metadata/headers keywords.
    inspect.signature(hook).bind("my-cluster/default", create_cluster_if_needed=False, cookies=None, metadata=None,
                                 headers=None)


class _EksApi(BaseHTTPRequestHandler):
    """A stand-in for what the sagemaker_ray plugin calls: the EKS API server's RayDashboardConnection resource (it
    exists only for the RayCluster `maze-grpo` in `default`) and the dashboard's /bearer-auth token exchange."""

    clusters = {("default", "maze-grpo")}
    seen: list = []

    def log_message(self, *args):
        pass

    def _reply(self, status: int, body: dict, cookie: str | None = None):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if cookie:
            self.send_header("Set-Cookie", f"ray_session={cookie}; Path=/")
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        parts = self.path.strip("/").split("/")  # apis/<group>/<version>/namespaces/<ns>/raydashboardconnections
        namespace, name = parts[4], body["spec"].get("clusterName")
        self.seen.append((self.headers.get("Authorization"), parts[1], namespace, name))
        if parts[1] != "connection.access.sagemaker.amazonaws.com" or (namespace, name) not in self.clusters:
            return self._reply(404, {"kind": "Status", "reason": "NotFound"})
        port = self.server.server_port
        self._reply(201, {"status": {"connectionUrl": f"http://127.0.0.1:{port}/?token=jwt-{name}"}})

    def do_GET(self):
        if self.path.startswith("/bearer-auth?token=jwt-"):
            return self._reply(200, {}, cookie="session-" + self.path.rsplit("jwt-", 1)[1])
        self._reply(404, {})


def test_the_submission_address_reaches_the_raycluster_through_the_plugins_own_calls(tmp_path, monkeypatch):
    """The address names the RayCluster resource: built from cluster.ray_cluster/ray_namespace, it gets a token from
    the EKS API (through the plugin Ray loads for sagemaker_ray://, against a stand-in API server); the runbook's old
    address, which named the HyperPod cluster, gets "Resource not found" there, and our submit refuses it first."""
    from ray.dashboard.modules.dashboard_sdk import parse_cluster_info
    from toolkit_for_ray_on_sagemaker_ai.job_submission._token_provider import TokenAcquisitionError

    from services.trainer.submit import PreflightError, submission_address

    api = ThreadingHTTPServer(("127.0.0.1", 0), _EksApi)
    threading.Thread(target=api.serve_forever, daemon=True).start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "current-context": "hyperpod", "contexts": [{"name": "hyperpod", "context": {"cluster": "eks", "user": "me"}}],
        "clusters": [{"name": "eks", "cluster": {"server": f"http://127.0.0.1:{api.server_port}"}}],
        "users": [{"name": "me", "user": {"token": "eks-token"}}]}))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    try:
        cfg = load_config(REPO / "configs/qwen3vl-8b-hyperpod.yaml", environ={})
        address = submission_address(cfg)
        assert address == "sagemaker_ray://maze-grpo/default"
        info = parse_cluster_info(address, create_cluster_if_needed=False, cookies=None, metadata=None, headers=None)
        assert info.address == f"https://127.0.0.1:{api.server_port}" and info.cookies == {"ray_session": "session-maze-grpo"}
        assert _EksApi.seen[-1] == ("Bearer eks-token", "connection.access.sagemaker.amazonaws.com", "default", "maze-grpo")

        old = "sagemaker_ray://maze-grpo-hyperpod/default"  # the HyperPod cluster's name, as the runbook had it
        with pytest.raises(TokenAcquisitionError, match="Resource not found"):
            parse_cluster_info(old, create_cluster_if_needed=False, cookies=None, metadata=None, headers=None)
        with pytest.raises(PreflightError, match="names the RayCluster 'maze-grpo-hyperpod'.*sagemaker_ray://maze-grpo/default"):
            submission_address(load_config(REPO / "configs/qwen3vl-8b-hyperpod.yaml", environ={"RAY_ADDRESS": old}))
    finally:
        api.shutdown()


def test_submit_works_from_a_machine_without_the_profiles_shared_folder(ray_head, tmp_path):
    """From a laptop (a non-root user, no /shared): the job id is recorded on the submitting machine, and nothing of
    its storage goes with the job; the job still runs on the cluster's storage."""
    address, env, cluster_storage = ray_head
    # Not under tmp_path: pytest's base folder is private to the user running the tests (mode 0700), and the
    # submitting user below is another user, who must reach its own home.
    home = Path(tempfile.mkdtemp(prefix="laptop-home-", dir="/tmp"))
    try:
        laptop = {k: v for k, v in env.items() if k not in ("SHARED_DIR",)}
        laptop.update({"HOME": str(home), "RAY_ADDRESS": address,
                       "SHARED_DIR": "/shared-on-the-cluster-only"})  # the obvious work-around, which must stay local
        command = [sys.executable, "-m", "services.trainer", "submit", "--timeout", "900", *MINIMAL, "run_id=laptop"]
        if os.getuid() == 0:  # as root, run the submission as an ordinary user, as from a laptop
            os.chown(home, 65534, 65534)
            command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *command]
        proc = subprocess.run(command, cwd=REPO, env=laptop, capture_output=True, text=True, timeout=1000)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        record = json.loads((home / ".local" / "state" / "maze-grpo" / "jobs" / "laptop.json").read_text())
        assert record["status"] == "SUCCEEDED" and "SHARED_DIR" not in record["forwarded_env"]
        assert not Path("/shared-on-the-cluster-only").exists()
        verify_manifest(cluster_storage / "runs" / "laptop" / "exports" / "global_step_2" / "policy")
    finally:
        shutil.rmtree(home, ignore_errors=True)
