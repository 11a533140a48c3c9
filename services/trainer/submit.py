"""Submitting a training run as a Ray job: to `http://head:8265`, or to HyperPod's protected endpoint,
`sagemaker_ray://<raycluster>/<namespace>`, built from `cluster.ray_cluster` and `cluster.ray_namespace`.

A HyperPod preflight checks the cluster against the profile first; the job runs on the cluster's own storage
(nothing of the submitting machine's is forwarded unless asked); the job id is recorded on the submitting
machine. See docs/hyperpod.md, section 4.
"""

from __future__ import annotations

import logging
import os
import shlex
import time
from pathlib import Path

from shared.config import REPO_ROOT, RunConfig
from shared.storage.files import atomic_write_json

logger = logging.getLogger(__name__)

# What goes with every job from the submitting shell: where AWS is and whether the hub is off. Storage (SHARED_DIR,
# S3_URI, AWS_ENDPOINT_URL) is the cluster's own, set on its pods; `--forward-env NAME` sends a variable on purpose.
FORWARDED_ENV = ("AWS_REGION", "AWS_DEFAULT_REGION", "HF_HUB_OFFLINE")
RECORD_DIR = Path.home() / ".local" / "state" / "maze-grpo" / "jobs"  # the submitting machine's own
# Variables SkyRL's `initialize_ray` forwards itself from the driver's environment into its own
# `ray.init(runtime_env=...)` (skyrl.train.utils.utils.prepare_runtime_environment). Ray refuses a key that
# the job's runtime env already sets, so for a skyrl job these ride on the entrypoint's command line
# (the driver's environment) instead; SkyRL then hands them to every worker.
SKYRL_FORWARDS = ("HF_HOME", "HF_TOKEN", "HF_HUB_OFFLINE", "HF_ENDPOINT", "PYTORCH_CUDA_ALLOC_CONF")


class PreflightError(RuntimeError):
    """The HyperPod cluster does not match the config's cluster section."""


# ---- HyperPod preflight ---------------------------------------------------------------------------


def describe_hyperpod(cluster_name: str, region: str | None = None, endpoint_url: str | None = None) -> dict:
    """Returns {instance_groups: [...], nodes: [...]} for a HyperPod cluster, via the SageMaker SDK."""
    import boto3

    session = boto3.session.Session(region_name=region or "us-east-1")
    client = session.client("sagemaker", endpoint_url=endpoint_url)
    try:
        from sagemaker.core.helper.session_helper import Session as SageMakerSession

        sm_session = SageMakerSession(boto_session=session, sagemaker_client=client)
        client = sm_session.sagemaker_client
    except Exception:
        pass  # the SDK layout differs across versions; its client is boto3's sagemaker client either way
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        cluster = client.describe_cluster(ClusterName=cluster_name)
        nodes, token = [], None
        while True:
            page = client.list_cluster_nodes(ClusterName=cluster_name, **({"NextToken": token} if token else {}))
            nodes.extend(page.get("ClusterNodeSummaries", []))
            token = page.get("NextToken")
            if not token:
                break
    except ClientError as exc:
        error = exc.response.get("Error", {})
        if error.get("Code") in ("ResourceNotFound", "ValidationException"):
            raise PreflightError(f"HyperPod preflight: no cluster {cluster_name!r} in region {session.region_name} "
                                 f"({error.get('Message', error.get('Code'))[:200]}); set cluster.hyperpod_cluster to "
                                 "the name `aws sagemaker list-clusters` shows, and cluster.region to its region") from None
        raise PreflightError(f"HyperPod preflight: the SageMaker API refused describe_cluster for {cluster_name!r}: "
                             f"{error.get('Code')}: {error.get('Message', '')[:200]}") from None
    except BotoCoreError as exc:
        raise PreflightError(f"HyperPod preflight: the SageMaker API did not answer ({exc}); check AWS credentials "
                             "and cluster.region") from None
    return {"status": cluster.get("ClusterStatus"), "instance_groups": cluster.get("InstanceGroups", []), "nodes": nodes}


GPUS_PER_INSTANCE = {"ml.g7e.12xlarge": 2, "ml.g7e.24xlarge": 4, "ml.g7e.48xlarge": 8, "ml.p5.48xlarge": 8,
                     "ml.g6e.12xlarge": 4, "ml.g5.12xlarge": 4}


def check_cluster(cfg: RunConfig, description: dict) -> list[str]:
    """Returns what differs between the described cluster and the config (empty when it fits)."""
    c = cfg.cluster
    counts: dict[str, int] = {}
    groups: dict[str, tuple[str, int]] = {}  # instance group name -> (type, nodes)
    for group in description["instance_groups"]:
        nodes = int(group.get("CurrentCount", group.get("TargetCount", 0)))
        counts[group["InstanceType"]] = counts.get(group["InstanceType"], 0) + nodes
        groups[group.get("InstanceGroupName", "")] = (group["InstanceType"], nodes)
    problems = []
    if counts.get(c.head_instance_type, 0) < 1:
        problems.append(f"no head node of type {c.head_instance_type} (cluster has {counts or 'no instances'})")
    workers = counts.get(c.worker_instance_type, 0)
    if c.worker_instance_group is not None:  # that group only: a serving group of the same type is not a worker
        kind, workers = groups.get(c.worker_instance_group, (c.worker_instance_type, 0))
        if c.worker_instance_group not in groups:
            problems.append(f"no instance group {c.worker_instance_group!r} (cluster.worker_instance_group); the cluster "
                            f"has {', '.join(sorted(groups)) or 'none'}")
        elif kind != c.worker_instance_type:
            problems.append(f"instance group {c.worker_instance_group!r} is {kind}, config expects {c.worker_instance_type}")
    if workers != c.num_workers:
        problems.append(f"{workers} worker nodes of type {c.worker_instance_type}, config expects {c.num_workers}")
    if c.serve_instance_group is not None:
        kind, nodes = groups.get(c.serve_instance_group, ("", 0))
        gpus = nodes * GPUS_PER_INSTANCE.get(kind, c.gpus_per_worker)
        if c.serve_instance_group not in groups:
            problems.append(f"no instance group {c.serve_instance_group!r} for serving (cluster.serve_instance_group); "
                            f"the cluster has {', '.join(sorted(groups)) or 'none'}")
        elif gpus < cfg.server.num_replicas:
            problems.append(f"serving group {c.serve_instance_group!r} has {gpus} GPUs ({nodes} x {kind}), "
                            f"server.num_replicas = {cfg.server.num_replicas} needs one each")
    gpus = workers * GPUS_PER_INSTANCE.get(c.worker_instance_type, c.gpus_per_worker)
    if gpus < c.num_engines:
        problems.append(f"{gpus} GPUs on {c.worker_instance_type} workers, but {c.num_engines} rollout engines need {c.num_engines}")
    if c.gpus_per_worker != GPUS_PER_INSTANCE.get(c.worker_instance_type, c.gpus_per_worker):
        problems.append(f"{c.worker_instance_type} has {GPUS_PER_INSTANCE[c.worker_instance_type]} GPUs, config says {c.gpus_per_worker}")
    if description.get("status") not in (None, "InService"):
        problems.append(f"cluster status is {description['status']}, not InService")
    return problems


# ---- submission -----------------------------------------------------------------------------------


def job_client(address: str):
    """Returns a JobSubmissionClient; sagemaker_ray:// needs toolkit-for-ray-on-sagemaker-ai."""
    from ray.job_submission import JobSubmissionClient

    if address.startswith("sagemaker_ray://"):
        try:
            import sagemaker_ray  # noqa: F401  (registers the sagemaker_ray:// address plugin)
        except ImportError:
            raise SystemExit("sagemaker_ray:// addresses need the package toolkit-for-ray-on-sagemaker-ai "
                             "(pip install '.[trainer]'), and AWS credentials for the cluster") from None
    try:
        return JobSubmissionClient(address)
    except Exception as exc:  # the address plugin and Ray's client raise types of their own (kubeconfig, auth, HTTP)
        reason = " ".join(str(exc).split())[:400] or type(exc).__name__
        hint = (" (docs/hyperpod.md, section 1: the Ray endpoint operator, the EKS access entry and "
                "`aws eks update-kubeconfig --name <EKS cluster>` on this machine)" if address.startswith("sagemaker_ray://")
                else "; check RAY_ADDRESS and that the head's dashboard (port 8265) answers")
        raise PreflightError(f"cannot reach the Ray cluster at {address}: {type(exc).__name__}: {reason}{hint}") from None


def submit_when_ready(client, entrypoint: str, runtime_env: dict, metadata: dict, log, wait_s: float = 120) -> str:
    """Submits the job; a head whose job agent is still starting ("No available agent") is asked again."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env, metadata=metadata)
        except RuntimeError as exc:
            if "No available agent" not in str(exc) or time.monotonic() > deadline:
                raise
            log("the Ray head's job agent is still starting; submitting again in 5 s")
            time.sleep(5)


def submission_address(cfg: RunConfig) -> str:
    """Returns the cluster address to submit to: RAY_ADDRESS, else sagemaker_ray://<ray_cluster>/<ray_namespace>.

    A sagemaker_ray:// RAY_ADDRESS that names another RayCluster than the profile's is refused (PreflightError):
    the plugin would ask the EKS API for a resource that is not there ("Resource not found")."""
    c = cfg.cluster
    address = c.ray_address
    if not address:
        if c.ray_cluster:
            return f"sagemaker_ray://{c.ray_cluster}/{c.ray_namespace}"
        raise SystemExit("no cluster address: set RAY_ADDRESS (http://head:8265 or sagemaker_ray://<raycluster>/<namespace>), "
                         "or cluster.ray_cluster in the profile")
    if address.startswith("sagemaker_ray://") and c.ray_cluster:
        from toolkit_for_ray_on_sagemaker_ai.job_submission._address import ClusterAddress, parse_address

        parsed = parse_address(address[len("sagemaker_ray://"):])  # how the plugin itself reads the address
        if isinstance(parsed, ClusterAddress) and (parsed.cluster_name, parsed.namespace) != (c.ray_cluster, c.ray_namespace):
            raise PreflightError(
                f"RAY_ADDRESS={address} names the RayCluster {parsed.cluster_name!r} in namespace {parsed.namespace!r}, "
                f"but this profile's RayCluster is {c.ray_cluster!r} in {c.ray_namespace!r} (cluster.ray_cluster, "
                f"cluster.ray_namespace); a sagemaker_ray:// address names the RayCluster resource, not the HyperPod "
                f"cluster: use sagemaker_ray://{c.ray_cluster}/{c.ray_namespace}, or unset RAY_ADDRESS")
    return address


def job_spec(cfg: RunConfig, config_path: str, overrides: list[str], preflight: bool = False,
             environ: dict | None = None, forward: tuple[str, ...] = ()) -> tuple[str, dict]:
    """Returns (entrypoint, runtime_env) of the Ray job that runs `python -m services.trainer` for a profile.

    The job gets FORWARDED_ENV and the `forward` variables from this shell; its storage is the cluster's own."""
    environ = os.environ if environ is None else environ
    env_vars = {k: environ[k] for k in (*FORWARDED_ENV, *forward) if environ.get(k)}
    driver_env = {}
    if cfg.backend == "skyrl":
        driver_env = {k: v for k, v in env_vars.items() if k in SKYRL_FORWARDS or k.startswith("SKYRL_")}
        env_vars = {k: v for k, v in env_vars.items() if k not in driver_env}
    command = ["python", "-m", "services.trainer", "--config", os.path.relpath(config_path, REPO_ROOT), *overrides]
    if preflight:
        command.append("--preflight")
    if driver_env:
        command = ["env", *(f"{k}={v}" for k, v in driver_env.items()), *command]
    runtime_env = {
        "working_dir": str(REPO_ROOT),
        "excludes": [".venv*", ".uv*", ".shared", ".git", ".cache", "**/__pycache__", ".pytest_cache", ".hypothesis",
                     "bench/results.md"],
        "env_vars": env_vars,
    }
    return shlex.join(command), runtime_env


def submit(cfg: RunConfig, config_path: str, overrides: list[str], force: bool = False, follow: bool = True,
           timeout_s: float | None = None, preflight: bool = False, log=logger.info, record_dir: Path = RECORD_DIR,
           forward: tuple[str, ...] = ()) -> dict:
    """Submits `python -m services.trainer` as a Ray job; records the job id in record_dir/<run_id>.json on this
    machine; streams logs; returns the record.

    `preflight=True` submits the skyrl backend's `--preflight`: the job sets up SkyRL and Ray on the cluster
    exactly as a run would, then stops before any GPU work.
    """
    address = submission_address(cfg)
    if address.startswith("sagemaker_ray://") and not force:
        cluster_name = cfg.cluster.hyperpod_cluster
        if cluster_name:
            problems = check_cluster(cfg, describe_hyperpod(cluster_name, cfg.cluster.region,
                                                            cfg.cluster.sagemaker_endpoint_url))
            if problems:
                raise PreflightError("HyperPod preflight failed: " + "; ".join(problems) + " (use --force to submit anyway)")
            log(f"preflight: HyperPod cluster {cluster_name} matches the config")
        else:
            log("preflight skipped: the profile names no cluster.hyperpod_cluster to describe")
    client = job_client(address)
    entrypoint, runtime_env = job_spec(cfg, config_path, overrides, preflight=preflight, forward=forward)
    job_id = submit_when_ready(client, entrypoint, runtime_env, {"run_id": cfg.run_id, "project": "maze-grpo"}, log)
    record = {"job_id": job_id, "address": address, "entrypoint": entrypoint, "run_id": cfg.run_id,
              "forwarded_env": sorted(runtime_env["env_vars"]),
              "submitted": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    record_path = Path(record_dir) / f"{cfg.run_id}.json"
    atomic_write_json(record_path, record)
    log(f"submitted job {job_id} to {address}: {entrypoint} (recorded in {record_path})")
    if follow:
        deadline = time.time() + timeout_s if timeout_s else None
        seen = 0
        while True:
            logs = client.get_job_logs(job_id)
            if len(logs) > seen:
                print(logs[seen:], end="", flush=True)
                seen = len(logs)
            status = str(client.get_job_status(job_id))
            if status.endswith(("SUCCEEDED", "FAILED", "STOPPED")):
                record["status"] = status.split(".")[-1]
                break
            if deadline and time.time() > deadline:
                record["status"] = "TIMEOUT"
                break
            time.sleep(2)
        atomic_write_json(record_path, record)
        log(f"job {job_id}: {record['status']}")
    return record
