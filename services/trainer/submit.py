"""Submitting a training run to a Ray cluster: `http://head:8265` or HyperPod's `sagemaker_ray://<cluster>/<ns>`.

    make submit CONFIG=configs/qwen3vl-8b-hyperpod.yaml RAY_ADDRESS=sagemaker_ray://my-cluster/default

Before a `sagemaker_ray://` submission, a preflight describes the HyperPod cluster with the SageMaker
Python SDK and checks its instance groups against the config's cluster section (`--force` skips it).
The job id is recorded in the run folder and the job's logs are streamed until it ends.
"""

from __future__ import annotations

import os
import time

from shared.config import REPO_ROOT, RunConfig
from shared.storage import SharedVolume, atomic_write_json

FORWARDED_ENV = ("SHARED_DIR", "S3_URI", "AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION", "HF_HUB_OFFLINE")


class PreflightError(RuntimeError):
    """The HyperPod cluster does not match the config's cluster section."""


# ---- HyperPod preflight ---------------------------------------------------------------------------


def describe_hyperpod(cluster_name: str, region: str | None = None, endpoint_url: str | None = None) -> dict:
    """Returns {instance_groups: [...], nodes: [...]} for a HyperPod cluster, via the SageMaker SDK."""
    import boto3

    session = boto3.session.Session(region_name=region or os.environ.get("AWS_REGION") or "us-east-1")
    client = session.client("sagemaker", endpoint_url=endpoint_url or os.environ.get("SAGEMAKER_ENDPOINT_URL"))
    try:
        from sagemaker.core.helper.session_helper import Session as SageMakerSession

        sm_session = SageMakerSession(boto_session=session, sagemaker_client=client)
        client = sm_session.sagemaker_client
    except Exception:
        pass  # the SDK layout differs across versions; its client is boto3's sagemaker client either way
    cluster = client.describe_cluster(ClusterName=cluster_name)
    nodes, token = [], None
    while True:
        page = client.list_cluster_nodes(ClusterName=cluster_name, **({"NextToken": token} if token else {}))
        nodes.extend(page.get("ClusterNodeSummaries", []))
        token = page.get("NextToken")
        if not token:
            break
    return {"status": cluster.get("ClusterStatus"), "instance_groups": cluster.get("InstanceGroups", []), "nodes": nodes}


GPUS_PER_INSTANCE = {"ml.g7e.12xlarge": 2, "ml.g7e.24xlarge": 4, "ml.g7e.48xlarge": 8, "ml.p5.48xlarge": 8,
                     "ml.g6e.12xlarge": 4, "ml.g5.12xlarge": 4}


def check_cluster(cfg: RunConfig, description: dict) -> list[str]:
    """Returns what differs between the described cluster and the config (empty when it fits)."""
    c = cfg.cluster
    counts: dict[str, int] = {}
    for group in description["instance_groups"]:
        counts[group["InstanceType"]] = counts.get(group["InstanceType"], 0) + int(group.get("CurrentCount", group.get("TargetCount", 0)))
    problems = []
    if counts.get(c.head_instance_type, 0) < 1:
        problems.append(f"no head node of type {c.head_instance_type} (cluster has {counts or 'no instances'})")
    workers = counts.get(c.worker_instance_type, 0)
    if workers != c.num_workers:
        problems.append(f"{workers} worker nodes of type {c.worker_instance_type}, config expects {c.num_workers}")
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
    return JobSubmissionClient(address)


def submit(cfg: RunConfig, config_path: str, overrides: list[str], force: bool = False, follow: bool = True,
           timeout_s: float | None = None, log=print) -> dict:
    """Submits `python -m services.trainer` as a Ray job; records the job id; streams logs; returns the record."""
    address = cfg.cluster.ray_address
    if not address:
        raise SystemExit("no cluster address: set RAY_ADDRESS (http://head:8265 or sagemaker_ray://<cluster>/<namespace>)")
    if address.startswith("sagemaker_ray://") and not force:
        cluster_name = cfg.cluster.hyperpod_cluster or address[len("sagemaker_ray://"):].split("/")[0]
        problems = check_cluster(cfg, describe_hyperpod(cluster_name, cfg.cluster.region))
        if problems:
            raise PreflightError("HyperPod preflight failed: " + "; ".join(problems) + " (use --force to submit anyway)")
        log(f"preflight: HyperPod cluster {cluster_name} matches the config")
    client = job_client(address)
    env_vars = {k: os.environ[k] for k in FORWARDED_ENV if os.environ.get(k)}
    env_vars.setdefault("SHARED_DIR", cfg.storage.shared_dir)
    if cfg.storage.s3_uri:
        env_vars.setdefault("S3_URI", cfg.storage.s3_uri)
    rel_config = os.path.relpath(config_path, REPO_ROOT)
    entrypoint = " ".join(["python", "-m", "services.trainer", "--config", rel_config, *overrides])
    runtime_env = {
        "working_dir": str(REPO_ROOT),
        "excludes": [".venv", ".shared", ".git", "**/__pycache__", ".pytest_cache", ".hypothesis", "bench/results.md"],
        "env_vars": env_vars,
    }
    job_id = client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env,
                               metadata={"run_id": cfg.run_id, "project": "maze-grpo"})
    record = {"job_id": job_id, "address": address, "entrypoint": entrypoint,
              "submitted": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    atomic_write_json(SharedVolume(cfg.shared_path()).run(cfg.run_id) / "job.json", record)
    log(f"submitted job {job_id} to {address}: {entrypoint}")
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
        atomic_write_json(SharedVolume(cfg.shared_path()).run(cfg.run_id) / "job.json", record)
        log(f"job {job_id}: {record['status']}")
    return record
