"""Dashboards: Ray's four dashboards into Grafana (a recording stand-in that speaks its HTTP API), and
every PromQL expression of Ray Core and Ray Serve evaluated by a real Prometheus scraping a real Ray."""

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from services.dashboards.provision import DATASOURCE_UID, FOLDER_UID, TRAINING_PANELS, build_dashboards
from shared.local_ray import stop_ray_started_in
from shared.net import free_port

REPO = Path(__file__).resolve().parent.parent
TOKEN = "glsa_test_token"


class FakeGrafana(BaseHTTPRequestHandler):
    """Speaks the Grafana endpoints grafana-client uses; keeps state and records every request."""

    state = {"folders": {}, "datasources": {}, "dashboards": {}}
    requests: list = []

    def log_message(self, *args):
        pass

    def _reply(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self, method):
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self.requests.append((method, self.path, body))
        if self.path in ("/api/health", "/api/frontend/settings"):  # the client's health check reads buildInfo
            return self._reply(200, {"database": "ok", "version": "11.0.0", "buildInfo": {"version": "11.0.0"}})
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self._reply(401, {"message": "invalid API key"})
        s = self.state
        if m := re.fullmatch(r"/api/folders/([\w-]+)", self.path):
            folder = s["folders"].get(m.group(1))
            return self._reply(200, folder) if folder else self._reply(404, {"message": "folder not found"})
        if self.path == "/api/folders" and method == "POST":
            s["folders"][body["uid"]] = {"uid": body["uid"], "title": body["title"], "id": len(s["folders"]) + 1}
            return self._reply(200, s["folders"][body["uid"]])
        if m := re.fullmatch(r"/api/datasources/uid/([\w-]+)", self.path):
            if method == "GET":
                ds = s["datasources"].get(m.group(1))
                return self._reply(200, ds) if ds else self._reply(404, {"message": "data source not found"})
            s["datasources"][m.group(1)] = body
            return self._reply(200, {"message": "Datasource updated"})
        if self.path == "/api/datasources" and method == "POST":
            s["datasources"][body["uid"]] = body
            return self._reply(200, {"message": "Datasource added", "id": 1})
        if self.path == "/api/dashboards/db" and method == "POST":
            if body["folderUid"] not in s["folders"]:
                return self._reply(400, {"message": "folder not found"})
            s["dashboards"][body["dashboard"]["uid"]] = body
            return self._reply(200, {"status": "success", "uid": body["dashboard"]["uid"]})
        return self._reply(404, {"message": f"no route {method} {self.path}"})

    def do_GET(self):
        self._handle("GET")

    def do_POST(self):
        self._handle("POST")

    def do_PUT(self):
        self._handle("PUT")


@pytest.fixture()
def grafana():
    FakeGrafana.state = {"folders": {}, "datasources": {}, "dashboards": {}}
    FakeGrafana.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeGrafana)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _provision(url, token=TOKEN, *extra):
    return subprocess.run([sys.executable, "-m", "services.dashboards", "--grafana-url", url, "--token", token,
                           "--prometheus-url", "http://127.0.0.1:9090", *extra],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def test_ray_dashboards_and_the_training_curve_with_stable_uids():
    dashboards = build_dashboards()
    assert [d["title"] for d in dashboards] == ["Ray Core", "Ray Data", "Ray Train", "Ray Serve", "maze-grpo training"]
    assert [d["uid"] for d in dashboards] == [d["uid"] for d in build_dashboards()]
    for d in dashboards:
        refs = re.findall(r'"datasource": (\{[^}]*\}|"[^"]*")', json.dumps(d["panels"]))
        assert refs and all(DATASOURCE_UID in r for r in refs), d["title"]


def test_provisioning_and_idempotence(grafana):
    first = _provision(grafana)
    assert first.returncode == 0, first.stderr
    assert "5 dashboards provisioned" in first.stdout
    state = FakeGrafana.state
    assert state["folders"][FOLDER_UID]["title"] == "Ray"
    ds = state["datasources"][DATASOURCE_UID]
    assert ds["type"] == "prometheus" and ds["url"] == "http://127.0.0.1:9090"
    assert sorted(b["dashboard"]["title"] for b in state["dashboards"].values()) == [
        "Ray Core", "Ray Data", "Ray Serve", "Ray Train", "maze-grpo training"]
    assert all(b["overwrite"] and b["folderUid"] == FOLDER_UID for b in state["dashboards"].values())
    creates = [r for r in FakeGrafana.requests if r[0] == "POST" and r[1] in ("/api/folders", "/api/datasources")]
    assert len(creates) == 2

    FakeGrafana.requests.clear()
    second = _provision(grafana)
    assert second.returncode == 0 and "folder exists, data source updated" in second.stdout
    methods = [(m, p) for m, p, _ in FakeGrafana.requests]
    assert ("POST", "/api/folders") not in methods and ("POST", "/api/datasources") not in methods
    assert ("PUT", f"/api/datasources/uid/{DATASOURCE_UID}") in methods
    assert len(state["dashboards"]) == 5 and len(state["folders"]) == 1 and len(state["datasources"]) == 1


def test_amp_sigv4_datasource(grafana):
    proc = _provision(grafana, TOKEN, "--amp-workspace-url", "https://aps-workspaces.us-west-2.amazonaws.com/workspaces/ws-1",
                      "--region", "us-west-2")
    assert proc.returncode == 0, proc.stderr
    data = FakeGrafana.state["datasources"][DATASOURCE_UID]["jsonData"]
    assert data["sigV4Auth"] is True and data["sigV4Region"] == "us-west-2"
    assert data["sigV4AuthType"] == "ec2_iam_role", "Amazon Managed Grafana signs with its workspace IAM role"
    proc = _provision(grafana, TOKEN, "--amp-workspace-url", "https://aps-workspaces.us-west-2.amazonaws.com/workspaces/ws-1",
                      "--region", "us-west-2", "--sigv4-auth", "default")
    assert proc.returncode == 0, proc.stderr
    assert FakeGrafana.state["datasources"][DATASOURCE_UID]["jsonData"]["sigV4AuthType"] == "default"


def test_rejected_token_and_unreachable_grafana(grafana):
    proc = _provision(grafana, "wrong-token")
    assert proc.returncode != 0 and "token was rejected" in proc.stderr and "done:" not in proc.stdout
    assert not FakeGrafana.state["dashboards"]
    proc = _provision("http://127.0.0.1:9")
    assert proc.returncode != 0 and "not reachable" in proc.stderr


def test_out_writes_json_files(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "services.dashboards", "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["maze-grpo-training.json", "ray-core.json", "ray-data.json", "ray-serve.json", "ray-train.json"]
    assert json.loads((tmp_path / "ray-core.json").read_text())["title"] == "Ray Core"


def _exprs(dashboard: dict) -> list[tuple[str, str]]:
    found = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            if target.get("expr"):
                found.append((panel.get("title", "?"), target["expr"]))
    return found


def _substitute(expr: str) -> str:
    # Grafana fills these in at query time; use what an "All" selection and a 5m range give.
    expr = re.sub(r'\{\{[^}]*\}\}', "", expr)
    for name in ("SessionName", "Instance", "Deployment", "Replica", "Route", "Application", "DatasetId",
                 "TrainRunName", "TrainWorldRank", "TrainWorkerActorId", "Operator", "ray_io_cluster", "Node"):
        expr = expr.replace(f"${name}", ".*").replace(f"${{{name}}}", ".*")
    expr = expr.replace("$__rate_interval", "1m").replace("$__range", "5m").replace("$__interval", "30s")
    return re.sub(r"\$\{?\w+\}?", ".*", expr)


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="Debian's prometheus package is not installed")
def test_dashboard_queries_run_against_real_prometheus_and_ray(tmp_path):
    from services.dashboards.monitor import start_prometheus

    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    import tempfile

    temp_dir = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # Ray's socket paths must stay under 107 bytes
    ray_cli = str(Path(sys.executable).parent / "ray")
    # The dashboard head writes the service-discovery file; everything stays on loopback.
    subprocess.run([ray_cli, "start", "--head", "--port=0", "--num-cpus=1", "--include-dashboard=true",
                    "--dashboard-host=127.0.0.1", f"--dashboard-port={free_port()}", "--node-ip-address=127.0.0.1",
                    f"--metrics-export-port={free_port()}", f"--temp-dir={temp_dir}", "--disable-usage-stats"],
                   check=True, env=env, capture_output=True, cwd=REPO, timeout=120)
    try:
        sd_file = temp_dir / "prom_metrics_service_discovery.json"
        deadline = time.time() + 60
        while not sd_file.exists() and time.time() < deadline:
            time.sleep(0.5)
        assert sd_file.exists(), "Ray wrote no service-discovery file"
        url = start_prometheus(tmp_path / "prom", port=free_port(), sd_file=str(sd_file), interval_s=1)
        # A tiny workload: tasks and an actor, so core metrics move.
        workload = (
            "import ray, time\n"
            f"ray.init(address=open('{temp_dir}/ray_current_cluster').read().strip())\n"
            "@ray.remote\ndef f(x): time.sleep(0.05); return x\n"
            "@ray.remote\nclass A:\n    def g(self): return 1\n"
            "ray.get([f.remote(i) for i in range(40)]); a = A.remote(); ray.get([a.g.remote() for _ in range(20)])\n"
            # A run's step lines through the trainer's own exporter, as services.trainer.grpo logs them.
            "from services.trainer.tracking import RayMetrics, scalars\n"
            "run = RayMetrics('prom-run')\n"
            "for step in (1, 2):\n"
            "    run.log(scalars({'step': step, 'reward/mean': 0.25 * step, 'train/solve_rate': 0.125 * step,\n"
            "        'eval/solve_rate': 0.375, 'policy/kl': 0.01, 'timing/rollout_s': 1.5, 'timing/train_s': 2.0,\n"
            "        'timing/sync_s': 0.5, 'throughput/rollout_tokens_per_s': 120.0}), step)\n"
            "print('logged', flush=True)\n"
            "time.sleep(120)\n"  # alive while Prometheus is asked: a run's gauges are exported while it runs
        )
        driver = subprocess.Popen([sys.executable, "-c", workload], env=env, cwd=REPO, stdout=subprocess.PIPE, text=True)
        assert driver.stdout.readline().strip() == "logged", "the workload did not run"
        deadline = time.time() + 60
        while time.time() < deadline and not httpx.get(f"{url}/api/v1/query", params={"query": "ray_maze_grpo_step"},
                                                       timeout=30).json()["data"]["result"]:
            time.sleep(1)
        results = {}
        for dashboard in build_dashboards():
            if dashboard["title"] not in ("Ray Core", "Ray Serve", "maze-grpo training"):
                continue
            for title, expr in _exprs(dashboard):
                response = httpx.get(f"{url}/api/v1/query", params={"query": _substitute(expr)}, timeout=30).json()
                assert response["status"] == "success", (dashboard["title"], title, expr, response)
                results.setdefault(dashboard["title"], []).append((title, bool(response["data"]["result"])))
        for name, rows in results.items():
            with_data = sorted({t for t, has in rows if has})
            print(f"{name}: {len(rows)} queries parse; panels with data ({len(with_data)}): {with_data}")
        assert any(has for _, has in results["Ray Core"]), "no Ray Core panel returned data"
        # Every panel of the training curve returns the run's series, with the last values it logged.
        assert all(has for _, has in results["maze-grpo training"]), results["maze-grpo training"]
        def value(expr):
            result = httpx.get(f"{url}/api/v1/query", params={"query": _substitute(expr)}, timeout=30).json()["data"]["result"]
            return {r["metric"]["run_id"]: float(r["value"][1]) for r in result}
        assert value('ray_maze_grpo_metric{metric="reward/mean"}') == {"prom-run": 0.5}
        assert value('ray_maze_grpo_step') == {"prom-run": 2.0}
        assert value(TRAINING_PANELS["Step time (rollout + train + sync, s)"]) == {"prom-run": 4.0}
        driver.kill()
    finally:
        stop_ray_started_in(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
        pid_file = tmp_path / "prom" / "prometheus.pid"
        if pid_file.exists():
            os.kill(int(pid_file.read_text()), 15)

