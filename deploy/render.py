"""The Kubernetes objects of the HyperPod path, rendered from a run profile and checked against the KubeRay schema.

    python deploy/render.py --config configs/qwen3vl-8b-hyperpod.yaml --registry ACCOUNT.dkr.ecr.REGION.amazonaws.com/
    python deploy/render.py --check     # the files in deploy/hyperpod/ are what the profile renders, and valid

Writes deploy/hyperpod/raycluster.yaml (the training RayCluster: a CPU head, `cluster.num_workers` GPU workers with
`cluster.gpus_per_worker` GPUs each on `cluster.worker_instance_group`) and deploy/hyperpod/rayservice.yaml (the
serving RayService on `cluster.serve_instance_group`, its serveConfigV2 the vLLM app's Serve config), each checked
against deploy/kuberay-v1.schema.json before it is written. `kubectl apply -f deploy/hyperpod/` applies both
(docs/hyperpod.md).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from shared.config import RunConfig, load_config  # noqa: E402

SCHEMA = REPO / "deploy" / "kuberay-v1.schema.json"
OUT = REPO / "deploy" / "hyperpod"
PROFILE = REPO / "configs" / "qwen3vl-8b-hyperpod.yaml"
EXAMPLE_REGISTRY = "123456789012.dkr.ecr.us-west-2.amazonaws.com/"
EXAMPLE_S3_URI = "s3://maze-grpo-adapters/prefix"
HEAD_GROUP = "head"  # the HyperPod instance group of the CPU head (cluster.head_instance_type)
FSX_CLAIM = "fsx-claim"
SERVE_ACCOUNT = "maze-grpo-serve"  # the serving pods' service account: its IAM role reads the adapters in S3
# What a pod may ask of each instance type: its vCPUs, memory and GPUs less what the node's own agents keep.
POD_LIMITS = {
    "ml.r5d.16xlarge": {"cpu": "56", "memory": "440Gi"},
    "ml.g7e.12xlarge": {"nvidia.com/gpu": 2, "cpu": "44", "memory": "400Gi"},
}


class ManifestError(ValueError):
    pass


def limits(instance_type: str, gpus: int | None = None) -> dict:
    if instance_type not in POD_LIMITS:
        raise ManifestError(f"no pod limits known for {instance_type}: add them to POD_LIMITS in deploy/render.py")
    out = dict(POD_LIMITS[instance_type])
    if gpus is not None:
        if gpus > out.get("nvidia.com/gpu", 0):
            raise ManifestError(f"cluster.gpus_per_worker={gpus}, but {instance_type} has {out.get('nvidia.com/gpu', 0)}")
        out["nvidia.com/gpu"] = gpus
    return out


def pod(group: str, image: str, env: dict, resources: dict, shm: bool = False, account: str | None = None) -> dict:
    """A Ray pod's template: on one HyperPod instance group, the FSx claim at /shared (and /dev/shm in memory)."""
    mounts = [{"name": "fsx", "mountPath": "/shared"}] + ([{"name": "dshm", "mountPath": "/dev/shm"}] if shm else [])
    volumes = [{"name": "fsx", "persistentVolumeClaim": {"claimName": FSX_CLAIM}}]
    if shm:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}})
    container = {"name": "ray-worker" if shm else "ray-head", "image": image,
                 "command": [],  # the image's entrypoint is the service; the operator runs `ray start`
                 "env": [{"name": k, **({"value": v} if isinstance(v, str) else {"valueFrom": v})} for k, v in env.items()],
                 "resources": {"limits": resources}, "volumeMounts": mounts}
    spec = {"nodeSelector": {"sagemaker.amazonaws.com/instance-group-name": group}, "containers": [container],
            "volumes": volumes}
    if account:
        spec = {"serviceAccountName": account, **spec}
    return {"spec": spec}


def cluster_spec(cfg: RunConfig, image: str, worker_group: tuple[str, str], workers: int, gpus: int, head_env: dict,
                 worker_env: dict, head_resources: dict, account: str | None = None) -> dict:
    """A RayCluster spec: the CPU head on the head group, one worker group (its name, its HyperPod instance group)."""
    name, instance_group = worker_group
    # rayStartParams are strings in KubeRay's schema (a bare 0 is refused at apply time).
    return {
        "rayVersion": ray_version(),
        "headGroupSpec": {"rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0", "metrics-export-port": "8080"},
                          "template": pod(HEAD_GROUP, image, head_env, head_resources, account=account)},
        "workerGroupSpecs": [{
            "groupName": name, "replicas": workers, "minReplicas": workers, "maxReplicas": workers,
            "rayStartParams": {"metrics-export-port": "8080"},
            "template": pod(instance_group, image, worker_env,
                            limits(cfg.cluster.worker_instance_type, gpus), shm=True, account=account)}],
    }


def ray_version() -> str:
    from importlib.metadata import version

    return version("ray")


def raycluster(cfg: RunConfig, registry: str) -> dict:
    """The training RayCluster (docs/hyperpod.md, section 2)."""
    c = cfg.cluster
    if not c.worker_instance_group or not c.ray_cluster:
        raise ManifestError("the profile names no cluster.ray_cluster or cluster.worker_instance_group")
    image = f"{registry}maze-grpo/trainer:latest"
    env = {"SHARED_DIR": "/shared"}
    head_env = {**env, "S3_URI": cfg.storage.s3_uri} if cfg.storage.s3_uri else env
    return {"apiVersion": "ray.io/v1", "kind": "RayCluster",
            "metadata": {"name": c.ray_cluster, "namespace": c.ray_namespace},
            "spec": cluster_spec(cfg, image, ("gpu", c.worker_instance_group), c.num_workers, c.gpus_per_worker, head_env, env,
                                 limits(c.head_instance_type))}


def rayservice(cfg: RunConfig, registry: str) -> dict:
    """The serving RayService (docs/hyperpod.md, section 6): the vLLM app on the serving instance group's GPU."""
    from services.server.llm import serve_config, validate

    c = cfg.cluster
    if not c.serve_instance_group:
        raise ManifestError("the profile names no cluster.serve_instance_group for the serving RayService")
    config = serve_config(cfg)
    validate(config)
    image = f"{registry}maze-grpo/server:latest"
    env = {"SHARED_DIR": "/shared", "S3_URI": cfg.storage.s3_uri}
    head_env = {**env, "SERVER_API_KEY": {"secretKeyRef": {"name": SERVE_ACCOUNT, "key": "SERVER_API_KEY"}}}
    gpus = cfg.server.num_replicas  # one GPU per replica
    spec = cluster_spec(cfg, image, ("serve-gpu", c.serve_instance_group), 1, gpus, head_env, env, {"cpu": "4", "memory": "32Gi"},
                        account=SERVE_ACCOUNT)
    return {"apiVersion": "ray.io/v1", "kind": "RayService",
            "metadata": {"name": f"{c.ray_cluster}-serve", "namespace": c.ray_namespace},
            "spec": {"serveConfigV2": yaml.safe_dump(config, sort_keys=False),
                     "rayClusterConfig": spec}}


@functools.cache
def validator(kind: str):
    """The KubeRay v1 schema's validator for one kind (the schema file is read once)."""
    import jsonschema

    definitions = json.loads(SCHEMA.read_text())["$defs"]
    return jsonschema.Draft202012Validator({"$defs": definitions, "$ref": f"#/$defs/{kind}"})


def check(manifest: dict) -> None:
    """Raises ManifestError naming the first place the manifest breaks the KubeRay v1 schema."""
    import jsonschema

    kind = manifest.get("kind") if isinstance(manifest, dict) else None
    if kind not in ("RayCluster", "RayService"):
        raise ManifestError(f"kind {kind!r}: this schema holds RayCluster and RayService")
    error = jsonschema.exceptions.best_match(validator(kind).iter_errors(manifest))
    if error is not None:
        where = ".".join(str(p) for p in error.absolute_path) or "(top)"
        raise ManifestError(f"{kind} {where}: {error.message}")


def render(cfg: RunConfig, registry: str, profile: Path = PROFILE) -> dict[str, str]:
    """Returns {file name: YAML text} of the profile's manifests, each checked."""
    out = {}
    for name, build in (("raycluster.yaml", raycluster), ("rayservice.yaml", rayservice)):
        manifest = build(cfg, registry)
        check(manifest)
        resolved = profile.resolve()
        source = resolved.relative_to(REPO) if resolved.is_relative_to(REPO) else profile
        out[name] = f"# Rendered by `python deploy/render.py` from {source}: do not edit by hand.\n" + \
            yaml.safe_dump(manifest, sort_keys=False, width=120)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python deploy/render.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(PROFILE), help="run profile (default: the HyperPod profile)")
    parser.add_argument("--registry", default=EXAMPLE_REGISTRY, help=f"image registry prefix (default {EXAMPLE_REGISTRY})")
    parser.add_argument("--s3-uri", default=EXAMPLE_S3_URI,
                        help=f"where the adapters are staged (storage.s3_uri; default the runbook's {EXAMPLE_S3_URI})")
    parser.add_argument("--out", default=str(OUT), help="folder for the YAML files (default deploy/hyperpod/)")
    parser.add_argument("--check", action="store_true", help="write nothing: exit 1 unless the files are current")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(Path(args.config), [], environ={"S3_URI": args.s3_uri})
        files = render(cfg, args.registry if args.registry.endswith("/") else args.registry + "/", Path(args.config))
    except (ManifestError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    stale = [name for name, text in files.items() if not (out / name).is_file() or (out / name).read_text() != text]
    if args.check:
        for name in stale:
            print(f"error: {out / name} is not what {args.config} renders: run `python deploy/render.py`", file=sys.stderr)
        return 1 if stale else 0
    out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (out / name).write_text(text)
        print(f"wrote {out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
