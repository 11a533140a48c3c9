"""deploy/render.py: the HyperPod path's RayCluster and RayService are files rendered from the profile, checked
against the project's KubeRay v1 schema (deploy/kuberay-v1.schema.json), and current."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "deploy"))

import render  # noqa: E402

from shared.config import load_config  # noqa: E402


@pytest.fixture(scope="module")
def cfg():
    return load_config(render.PROFILE, [], environ={"S3_URI": "s3://maze-grpo-adapters/prefix"})


@pytest.fixture(scope="module")
def manifests():
    return {name: yaml.safe_load((render.OUT / name).read_text()) for name in ("raycluster.yaml", "rayservice.yaml")}


def test_the_checked_in_manifests_are_what_the_profile_renders():
    proc = subprocess.run([sys.executable, "deploy/render.py", "--check"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_the_manifests_carry_the_profiles_cluster(cfg, manifests):
    c = cfg.cluster
    cluster = manifests["raycluster.yaml"]
    assert (cluster["metadata"]["name"], cluster["metadata"]["namespace"]) == (c.ray_cluster, c.ray_namespace)
    [workers] = cluster["spec"]["workerGroupSpecs"]
    assert workers["replicas"] == workers["minReplicas"] == workers["maxReplicas"] == c.num_workers
    pod = workers["template"]["spec"]
    assert pod["nodeSelector"]["sagemaker.amazonaws.com/instance-group-name"] == c.worker_instance_group
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == c.gpus_per_worker
    service = manifests["rayservice.yaml"]
    [serving] = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    serve_pod = serving["template"]["spec"]
    assert serve_pod["nodeSelector"]["sagemaker.amazonaws.com/instance-group-name"] == c.serve_instance_group
    assert serve_pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == cfg.server.num_replicas
    from services.server.llm import serve_config

    assert yaml.safe_load(service["spec"]["serveConfigV2"]) == serve_config(cfg)


@pytest.mark.parametrize("name", ["raycluster.yaml", "rayservice.yaml"])
def test_both_pass_the_schema(manifests, name):
    render.check(manifests[name])


def _broken(manifest, path, value):
    out = copy.deepcopy(manifest)
    node = out
    for key in path[:-1]:
        node = node[key]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return out


@pytest.mark.parametrize("path, value, words", [
    (("spec", "headGroupSpec", "rayStartParams", "num-cpus"), 0, "headGroupSpec.rayStartParams.num-cpus"),
    (("spec", "workerGroupSpec"), [], "'workerGroupSpec' was unexpected"),
    (("spec", "workerGroupSpecs", 0, "replicas"), "3", "workerGroupSpecs.0.replicas"),
    (("spec", "workerGroupSpecs", 0, "template", "spec", "containers", 0, "image"), KeyError, "'image' is a required"),
    (("spec", "headGroupSpec", "template", "spec", "containers", 0, "env", 0, "value"), 1, "env.0.value"),
    (("spec", "headGroupSpec", "template", "spec", "containers", 0, "resources", "limits", "memory"), "440 GiB",
     "limits.memory"),
    (("apiVersion",), "ray.io/v1alpha1", "apiVersion"),
])
def test_the_schema_refuses_what_the_operator_would(manifests, path, value, words):
    with pytest.raises(render.ManifestError) as refused:
        render.check(_broken(manifests["raycluster.yaml"], path, value))
    assert words in str(refused.value) or words in str(refused.value.args), str(refused.value)


def test_the_serving_cluster_is_checked_too(manifests):
    broken = _broken(manifests["rayservice.yaml"], ("spec", "serveConfig"), "applications: []")
    with pytest.raises(render.ManifestError, match="'serveConfig' was unexpected"):
        render.check(broken)


def test_an_instance_type_without_known_limits_is_one_line(tmp_path):
    profile = yaml.safe_load(render.PROFILE.read_text())
    profile["cluster"]["worker_instance_type"] = "ml.p5.48xlarge"
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(profile))
    proc = subprocess.run([sys.executable, "deploy/render.py", "--config", str(path), "--out", str(tmp_path / "out")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: no pod limits known for ml.p5.48xlarge: add them to POD_LIMITS in deploy/render.py"], proc.stderr
    assert not (tmp_path / "out").exists()
