"""The four Ray dashboards, built from Ray's own definitions, and the training curve, provisioned into Grafana.

Ray generates its dashboards without a cluster (`ray.dashboard.modules.metrics.grafana_dashboard_factory`);
we retitle them, keep their stable uids, bind every panel to one Prometheus data source, and put them in
a folder "Ray" through grafana-client (`GrafanaApi`, token auth as Amazon Managed Grafana uses). Beside them,
"maze-grpo training": the trainer's step metrics, which it exports as Ray metrics (services/trainer/tracking.py).
"""

from __future__ import annotations

import copy
import json
import logging

logger = logging.getLogger(__name__)

FOLDER_UID = "ray"
FOLDER_TITLE = "Ray"
DATASOURCE_UID = "ray-prometheus"
DATASOURCE_NAME = "Ray Prometheus"

# title -> Ray's generator (its uid is stable per Ray version)
DASHBOARDS = {
    "Ray Core": "generate_default_grafana_dashboard",
    "Ray Data": "generate_data_grafana_dashboard",
    "Ray Train": "generate_train_grafana_dashboard",
    "Ray Serve": "generate_serve_grafana_dashboard",
}


TRAINING_TITLE, TRAINING_UID = "maze-grpo training", "maze-grpo-training"
# panel title -> PromQL over the trainer's gauge (one series per run; $run_id is the dashboard's run picker)
TRAINING_PANELS = {
    "Reward (mean of the step's episodes)": 'ray_maze_grpo_metric{metric="reward/mean", run_id=~"$run_id"}',
    "Solve rate of the sampled training episodes": 'ray_maze_grpo_metric{metric="train/solve_rate", run_id=~"$run_id"}',
    "Held-out solve rate (64 mazes, greedy)": 'ray_maze_grpo_metric{metric="eval/solve_rate", run_id=~"$run_id"}',
    "KL(old || new) of the update": 'ray_maze_grpo_metric{metric="policy/kl", run_id=~"$run_id"}',
    "Step time (rollout + train + sync, s)": 'sum by (run_id) (ray_maze_grpo_metric{metric=~"timing/(rollout|train|sync)_s", '
                                              'run_id=~"$run_id"})',
    "Rollout tokens/s": 'ray_maze_grpo_metric{metric="throughput/rollout_tokens_per_s", run_id=~"$run_id"}',
    "GRPO step": 'ray_maze_grpo_step{run_id=~"$run_id"}',
}


def training_dashboard(reference: dict) -> dict:
    """Returns the training curve's dashboard: one time-series panel per TRAINING_PANELS entry, a run picker."""
    panels = [{"id": index + 1, "type": "timeseries", "title": title, "datasource": dict(reference),
               "gridPos": {"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)},
               "targets": [{"refId": "A", "expr": expr, "legendFormat": "{{run_id}}", "datasource": dict(reference)}]}
              for index, (title, expr) in enumerate(TRAINING_PANELS.items())]
    run_picker = {"name": "run_id", "label": "run", "type": "query", "datasource": dict(reference), "refresh": 2,
                  "query": "label_values(ray_maze_grpo_step, run_id)", "includeAll": True, "multi": True,
                  "current": {"selected": True, "text": "All", "value": "$__all"}}
    return {"id": None, "uid": TRAINING_UID, "title": TRAINING_TITLE, "tags": ["maze-grpo"], "timezone": "utc",
            "schemaVersion": 39, "refresh": "30s", "time": {"from": "now-6h", "to": "now"},
            "templating": {"list": [run_picker]}, "panels": panels}


class ProvisionError(RuntimeError):
    """Grafana refused or could not be reached; the message says which step and why."""


def _bind(node, datasource: dict):
    """Points every panel/target datasource reference at our data source, recursively."""
    if isinstance(node, dict):
        for key, value in list(node.items()):
            if key == "datasource" and (value in ("${datasource}", "$datasource", None) or isinstance(value, dict | str)):
                node[key] = dict(datasource)
            else:
                _bind(value, datasource)
    elif isinstance(node, list):
        for item in node:
            _bind(item, datasource)


def build_dashboards(datasource_uid: str = DATASOURCE_UID, datasource_name: str = DATASOURCE_NAME) -> list[dict]:
    """Returns Ray's four dashboards and the training curve (Grafana JSON), titled, with stable uids, bound to the
    data source."""
    from ray.dashboard.modules.metrics import grafana_dashboard_factory as factory

    reference = {"type": "prometheus", "uid": datasource_uid}
    dashboards = []
    for title, generator in DASHBOARDS.items():
        content, uid = getattr(factory, generator)()
        dashboard = json.loads(content)
        dashboard["title"] = title
        dashboard["uid"] = uid
        dashboard["id"] = None
        templating = dashboard.get("templating", {}).get("list", [])
        for variable in templating:
            if variable.get("type") == "datasource":
                variable["current"] = {"selected": True, "text": datasource_name, "value": datasource_uid}
        _bind(dashboard.get("panels", []), reference)
        for variable in templating:
            if variable.get("type") == "query":
                variable["datasource"] = dict(reference)
        dashboards.append(dashboard)
    dashboards.append(training_dashboard(reference))
    return dashboards


# How Grafana signs its requests to Amazon Managed Prometheus (the data source's `sigV4AuthType`): in Amazon Managed
# Grafana the workspace's own IAM role ("Workspace IAM Role" in its editor, `ec2_iam_role` in the API); a Grafana you
# run yourself uses the AWS SDK's default chain or a credentials file.
SIGV4_AUTH_TYPES = ("ec2_iam_role", "default", "credentials")


def datasource_body(prometheus_url: str, sigv4_region: str | None = None, sigv4_auth_type: str = "ec2_iam_role") -> dict:
    """Returns the Grafana data source: a plain Prometheus URL, or Amazon Managed Prometheus with SigV4."""
    body = {
        "uid": DATASOURCE_UID,
        "name": DATASOURCE_NAME,
        "type": "prometheus",
        "access": "proxy",
        "url": prometheus_url,
        "isDefault": False,
        "jsonData": {"httpMethod": "POST", "timeInterval": "10s"},
    }
    if sigv4_region:
        if sigv4_auth_type not in SIGV4_AUTH_TYPES:
            raise ProvisionError(f"unknown SigV4 auth type {sigv4_auth_type!r}: use one of {', '.join(SIGV4_AUTH_TYPES)}")
        body["jsonData"].update({"sigV4Auth": True, "sigV4AuthType": sigv4_auth_type, "sigV4Region": sigv4_region})
    return body


def provision(api, prometheus_url: str, sigv4_region: str | None = None, log=logger.info,
              sigv4_auth_type: str = "ec2_iam_role") -> dict:
    """Creates or updates folder, data source and the four dashboards; returns what was done per item."""
    from grafana_client.client import GrafanaClientError

    done: dict[str, str] = {}

    def step(name, fn):
        try:
            return fn()
        except GrafanaClientError as exc:
            status = getattr(exc, "status_code", None)
            hint = " (the token was rejected: check GRAFANA_TOKEN)" if status in (401, 403) else ""
            raise ProvisionError(f"Grafana refused {name}: HTTP {status} {getattr(exc, 'message', exc)}{hint}; "
                                 f"completed before the failure: {done or 'nothing'}") from None

    def folder():
        try:
            api.folder.get_folder(FOLDER_UID)
            return "exists"
        except GrafanaClientError as exc:
            if getattr(exc, "status_code", None) != 404:
                raise
        api.folder.create_folder(FOLDER_TITLE, uid=FOLDER_UID)
        return "created"

    done["folder"] = step("the folder", folder)

    body = datasource_body(prometheus_url, sigv4_region, sigv4_auth_type)

    def datasource():
        try:
            api.datasource.get_datasource_by_uid(DATASOURCE_UID)
        except GrafanaClientError as exc:
            if getattr(exc, "status_code", None) != 404:
                raise
            api.datasource.create_datasource(body)
            return "created"
        api.datasource.update_datasource_by_uid(DATASOURCE_UID, body)
        return "updated"

    done["datasource"] = step("the data source", datasource)
    for dashboard in build_dashboards():
        payload = {"dashboard": dashboard, "folderUid": FOLDER_UID, "overwrite": True,
                   "message": "provisioned by maze-grpo"}
        step(f"dashboard {dashboard['title']}", lambda p=payload: api.dashboard.update_dashboard(p))
        done[dashboard["title"]] = "provisioned"
        log(f"dashboard {dashboard['title']} ({dashboard['uid']}) provisioned in folder {FOLDER_TITLE}")
    return done


def write_files(out_dir, datasource_uid: str = DATASOURCE_UID) -> list:
    """Writes the five dashboards as JSON files (for file-based provisioning); returns their paths."""
    from pathlib import Path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for dashboard in build_dashboards(datasource_uid):
        path = out / f"{dashboard['title'].lower().replace(' ', '-')}.json"
        path.write_text(json.dumps(copy.deepcopy(dashboard), indent=2))
        paths.append(path)
    return paths
