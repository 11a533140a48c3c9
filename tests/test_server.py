"""Server: the real Ray Serve app on loopback, adapters the exporter wrote to a real S3 endpoint."""

import base64
import io
import os
import signal
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from shared.config import load_config
from shared.episodes import EpisodeSettings, run_episodes
from shared.maze import generate
from shared.maze.render import data_uri, render_rgb
from shared.models.endpoint import OpenAIEngine
from shared.models.engine import LocalEngine
from shared.net import wait_for_http

REPO = Path(__file__).resolve().parent.parent
KEY = "test-key-123"
BASE = "tiny-qwen3vl-sft"


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(exported_run, tiny_model_dir, s3_endpoint, tmp_path_factory):
    volume, run_id = exported_run
    bucket = "served"
    from shared.storage import s3_client

    s3_client(s3_endpoint).create_bucket(Bucket=bucket)
    env = {**os.environ, "SHARED_DIR": str(volume.root), "AWS_ENDPOINT_URL": s3_endpoint, "S3_URI": f"s3://{bucket}/p",
           "SERVER_API_KEY": KEY, "RAY_USAGE_STATS_ENABLED": "0"}
    subprocess.run([sys.executable, "-m", "services.exporter", "--run", run_id], env=env, cwd=REPO, check=True,
                   capture_output=True, timeout=120)
    port = _port()
    overrides = [f"model.path={tiny_model_dir}", f"model.base_model_id={BASE}", f"server.port={port}",
                 "server.max_image_bytes=200000", "server.max_images_per_request=3", "server.max_num_adapters_per_replica=1"]
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "services.server", *overrides], env=env, cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def alive():
        assert proc.poll() is None, "server exited: " + Path(log.name).read_text()[-3000:]

    wait_for_http(f"{url}/healthz", timeout_s=240, alive=alive)
    cfg = load_config(None, [f"storage.shared_dir={volume.root}", *overrides[:2]],
                      environ={"S3_URI": f"s3://{bucket}/p", "AWS_ENDPOINT_URL": s3_endpoint})
    yield url, cfg, run_id
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def _auth():
    return {"Authorization": f"Bearer {KEY}"}


def _chat(url, model, content, headers=None, **extra):
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 8, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=_auth() if headers is None else headers, timeout=120)


def _maze_content(seed=1):
    return [{"type": "text", "text": "9x9 maze"},
            {"type": "image_url", "image_url": {"url": data_uri(render_rgb(generate("maze_2d/easy", seed), 16))}}]


def test_routes_and_auth(server):
    url, _, run_id = server
    assert httpx.get(f"{url}/healthz").json()["status"] == "ok"
    assert httpx.get(f"{url}/v1/models").status_code == 401
    ids = [m["id"] for m in httpx.get(f"{url}/v1/models", headers=_auth()).json()["data"]]
    assert ids[0] == BASE and f"{BASE}:{run_id}-step2" in ids and f"{BASE}:{run_id}-step4" in ids
    assert _chat(url, BASE, "hi", headers={}).status_code == 401
    assert _chat(url, BASE, "hi", headers={"Authorization": "Bearer wrong"}).status_code == 401
    ok = _chat(url, BASE, _maze_content())
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["message"]["role"] == "assistant"
    adapted = _chat(url, f"{BASE}:{run_id}-step2", _maze_content())
    assert adapted.status_code == 200, adapted.text


def test_bad_input_gets_clear_errors(server):
    url, _, run_id = server
    cases = {
        "unknown model": (_chat(url, "other-model", "hi"), 404, "other-model"),
        "unknown adapter": (_chat(url, f"{BASE}:nope", "hi"), 404, "nope"),
        "traversal": (_chat(url, f"{BASE}:../x", "hi"), 400, "../x"),
        "bad image": (_chat(url, BASE, [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]), 400, "image"),
        "not a data uri": (_chat(url, BASE, [{"type": "image_url", "image_url": {"url": "http://example.com/x.png"}}]), 400, "data URI"),
        "too many images": (_chat(url, BASE, _maze_content() + _maze_content()[1:] * 3), 400, "too many images"),
        "bad role": (httpx.post(f"{url}/v1/chat/completions", headers=_auth(), timeout=30,
                                json={"model": BASE, "messages": [{"role": "robot", "content": "x"}]}), 400, "robot"),
    }
    big = io.BytesIO()
    Image.fromarray(np.random.randint(0, 255, (600, 600, 3), dtype=np.uint8)).save(big, format="PNG")
    big_uri = "data:image/png;base64," + base64.b64encode(big.getvalue()).decode()
    cases["oversized image"] = (_chat(url, BASE, [{"type": "image_url", "image_url": {"url": big_uri}}]), 400, "limit")
    for name, (response, status, word) in cases.items():
        assert response.status_code == status, (name, response.status_code, response.text)
        assert word in response.text, (name, response.text)
    malformed = httpx.post(f"{url}/v1/chat/completions", headers={**_auth(), "Content-Type": "application/json"},
                           content=b"{not json", timeout=30)
    assert malformed.status_code in (400, 422)
    missing = httpx.post(f"{url}/v1/chat/completions", headers=_auth(), json={"messages": []}, timeout=30)
    assert missing.status_code in (400, 422)
    assert httpx.get(f"{url}/healthz").status_code == 200, "the replica survived"


def test_64_concurrent_requests_all_succeed(server):
    url, _, run_id = server
    models = [BASE, f"{BASE}:{run_id}-step2", f"{BASE}:{run_id}-step4"]
    with ThreadPoolExecutor(64) as pool:
        responses = list(pool.map(lambda i: _chat(url, models[i % 3], _maze_content(i)), range(64)))
    assert [r.status_code for r in responses] == [200] * 64, [r.text for r in responses if r.status_code != 200][:2]


def test_greedy_parity_with_the_in_process_engine(server):
    url, cfg, run_id = server
    from shared.adapters import AdapterStore

    adapter_id = f"{run_id}-step4"
    local_adapter = AdapterStore.from_config(cfg).fetch(adapter_id)
    mazes = [generate("maze_2d/easy", s) for s in range(4)]
    settings = EpisodeSettings(max_turns=4, cell_px=16, temperature=0.0, max_new_tokens=8)
    local = run_episodes(LocalEngine.from_config(cfg, Path(cfg.model.path), local_adapter), mazes, settings)
    remote_engine = OpenAIEngine(url, f"{BASE}:{adapter_id}", api_key=KEY, max_images_in_context=cfg.model.max_images_in_context,
                                 max_turns_in_context=cfg.model.max_turns_in_context)
    remote = run_episodes(remote_engine, mazes, settings)
    assert all(e.error is None for e in remote), [e.error for e in remote]
    assert [[t["text"] for t in e.turns] for e in local] == [[t["text"] for t in e.turns] for e in remote]
