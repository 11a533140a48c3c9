"""Server: the real Ray Serve app on loopback, adapters the exporter wrote to a real S3 endpoint."""

import base64
import io
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

from shared.episodes import EpisodeSettings, run_episodes
from shared.maze import generate
from shared.maze.render import data_uri, render_rgb
from shared.models.endpoint import OpenAIEngine
from shared.models.inference import LocalEngine

KEY = "test-key-123"  # the server fixture's SERVER_API_KEY (conftest.py)
BASE = "tiny-qwen3vl-sft"


def _auth():
    return {"Authorization": f"Bearer {KEY}"}


def _chat(url, model, content, headers=None, **extra):
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 8, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=_auth() if headers is None else headers, timeout=120)


def _maze_content(seed=1):
    return [{"type": "text", "text": "9x9 maze"},
            {"type": "image_url", "image_url": {"url": data_uri(render_rgb(generate("maze_2d/easy", seed), 16))}}]


def test_routes_and_auth(server):
    url, _, run_id, *_ = server
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
    url, _, run_id, *_ = server
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
    url, _, run_id, *_ = server
    models = [BASE, f"{BASE}:{run_id}-step2", f"{BASE}:{run_id}-step4"]
    with ThreadPoolExecutor(64) as pool:
        responses = list(pool.map(lambda i: _chat(url, models[i % 3], _maze_content(i)), range(64)))
    assert [r.status_code for r in responses] == [200] * 64, [r.text for r in responses if r.status_code != 200][:2]


def test_greedy_parity_with_the_in_process_engine(server):
    url, cfg, run_id, *_ = server
    from shared.storage.adapters import AdapterStore

    adapter_id = f"{run_id}-step4"
    local_adapter = AdapterStore.from_config(cfg).fetch(adapter_id)
    mazes = [generate("maze_2d/easy", s) for s in range(4)]
    settings = EpisodeSettings(max_turns=4, cell_px=16, temperature=0.0, max_new_tokens=8)
    local = run_episodes(LocalEngine.from_config(cfg, Path(cfg.model.path), local_adapter), mazes, settings)
    remote_engine = OpenAIEngine(url, f"{BASE}:{adapter_id}", api_key=KEY, max_images_in_context=cfg.model.max_images_in_context,
                                 max_turns_in_context=cfg.model.max_turns_in_context)
    remote = run_episodes(remote_engine, mazes, settings)
    assert all(e.error is None for e in remote), [e.error for e in remote]
    assert [[t.text for t in e.turns] for e in local] == [[t.text for t in e.turns] for e in remote]
