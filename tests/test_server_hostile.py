"""Hostile input against the real server over HTTP: each bad request gets its own clear 4xx in the OpenAI
error shape, the requests sent beside it get their answers, and the server is alive afterwards."""

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from request_cases import check, shared_cases

from shared.maze import generate
from shared.maze.render import data_uri, render_rgb
from shared.net import free_port

REPO = Path(__file__).resolve().parent.parent
KEY = "test-key-123"  # the server fixture's SERVER_API_KEY (conftest.py)
BASE = "tiny-qwen3vl-sft"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _valid(seed: int, model: str = BASE) -> dict:
    image = data_uri(render_rgb(generate("maze_2d/easy", seed), 16))
    return {"model": model, "max_tokens": 6, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "9x9 maze"}, {"type": "image_url", "image_url": {"url": image}}]}]}


def _post(url: str, body=None, content: bytes | None = None, headers=None, timeout=180):
    headers = AUTH if headers is None else headers
    if content is not None:
        return httpx.post(f"{url}/v1/chat/completions", content=content,
                          headers={**headers, "Content-Type": "application/json"}, timeout=timeout)
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=timeout)


def _assert_error(response, status: int, word: str):
    assert response.status_code == status, (response.status_code, response.text[:500])
    error = response.json()["error"]  # OpenAI's shape: {"error": {"message", "type", "param", "code"}}
    assert set(error) >= {"message", "type", "param", "code"}, error
    assert word in error["message"], error


def test_one_bad_request_does_not_fail_its_batch(server):
    url, *_ = server
    bad = {"temperature 1e-300": {**_valid(0), "temperature": 1e-300},
           "seed 2**64": {**_valid(0), "seed": 2**64},
           "image placeholder in text": {**_valid(0), "messages": [{"role": "user", "content": "a <|image_pad|> b"}]}}
    bodies = [_valid(i) for i in range(16)] + list(bad.values())
    with ThreadPoolExecutor(len(bodies)) as pool:
        responses = list(pool.map(lambda b: _post(url, b), bodies))
    assert [r.status_code for r in responses[:16]] == [200] * 16, [r.text[:200] for r in responses[:16]]
    for name, response in zip(bad, responses[16:]):
        assert response.status_code == 400, (name, response.status_code, response.text[:300])
        assert "error" in response.json(), name
    assert "temperature" in responses[16].json()["error"]["message"]
    assert responses[17].json()["error"]["param"] == "seed"


def test_prompt_size_limit_in_tokens(server):
    url, *_ = server
    # Below the cheap character bound, above 1,000 tokens: counted by the tokenizer.
    counted = _post(url, {**_valid(0), "messages": [{"role": "user", "content": "maze " * 1500}]})
    _assert_error(counted, 413, "max_prompt_tokens")
    assert counted.json()["error"]["code"] == "context_length_exceeded"
    # A 40,000-character prompt is refused at once, and a normal request sent beside it is not held up.
    with ThreadPoolExecutor(2) as pool:
        started = time.perf_counter()
        long_one = pool.submit(_post, url, {**_valid(0), "messages": [{"role": "user", "content": "x" * 40_000}]})
        time.sleep(0.2)
        normal = pool.submit(_post, url, _valid(3))
        _assert_error(long_one.result(), 413, "max_prompt_tokens")
        assert normal.result().status_code == 200
        assert time.perf_counter() - started < 20


def test_bad_bodies_get_a_clear_400_never_a_500(server):
    """The table both servers answer alike (tests/request_cases.py), and what only this server refuses."""
    url, *_ = server
    check(url, KEY, {**shared_cases(BASE),
                     "stream (this server does not)": ({"json": {**_valid(0), "stream": True}}, 400, "stream"),
                     "a penalty (not applied here)": ({"json": {**_valid(0), "frequency_penalty": 1}}, 400,
                                                      "frequency_penalty")})
    unknown = httpx.get(f"{url}/v1/nothing", headers=AUTH)
    assert unknown.status_code == 404 and "error" in unknown.json()
    wrong_method = httpx.get(f"{url}/v1/chat/completions", headers=AUTH)
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()
    assert httpx.get(f"{url}/healthz").status_code == 200
    assert _post(url, _valid(5)).status_code == 200, "the server still answers after all of that"


def test_schema_and_docs_need_the_token(server):
    url, *_ = server
    for path in ("/openapi.json", "/docs"):
        assert httpx.get(f"{url}{path}").status_code == 401, path
        assert httpx.get(f"{url}{path}", headers=AUTH).status_code == 200, path
    schema = httpx.get(f"{url}/openapi.json", headers=AUTH).json()
    assert "requestBody" in schema["paths"]["/v1/chat/completions"]["post"]


def _fingerprint(url: str, model: str) -> str:
    response = _post(url, _valid(0, model))
    assert response.status_code == 200, response.text[:300]
    return response.json()["system_fingerprint"]


def test_a_re_pointed_alias_is_served_within_the_revalidation_time(server):
    url, cfg, run_id, env, _ = server
    from shared.storage.adapters import AdapterStore, adapter_version

    store = AdapterStore.from_config(cfg)
    version = {step: adapter_version(store.manifest(f"{run_id}-step{step}")) for step in (2, 4)}
    assert version[2] != version[4]

    def point(pick: str):
        subprocess.run([sys.executable, "-m", "services.exporter", "--run", run_id, "--alias", "live", "--pick", pick],
                       env=env, cwd=REPO, check=True, capture_output=True, timeout=120)

    point("latest")  # step 4
    assert _fingerprint(url, f"{BASE}:live") == f"live@{version[4]}"
    point("best")  # step 2 holds the better eval in the fixture
    moved = time.monotonic()
    while _fingerprint(url, f"{BASE}:live") != f"live@{version[2]}":
        assert time.monotonic() - moved < 15, "the server kept serving the alias's old adapter"
        time.sleep(0.3)
    # The step's own id and the alias now name the same files.
    assert _fingerprint(url, f"{BASE}:{run_id}-step2") == f"{run_id}-step2@{version[2]}"


def test_schemathesis_finds_no_server_error(server):
    """Requests generated by schemathesis from the server's own OpenAPI schema, valid and invalid, a fixed number per
    route and mode: none may get a 5xx, and the server answers afterwards.

    Cases are sent with httpx: schemathesis's own requests transport breaks on the urllib3 that another package
    (niquests, via grafana-client) installs in the same venv.
    """
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis.generation.modes import GenerationMode

    url, *_ = server
    schema = schemathesis.openapi.from_dict(httpx.get(f"{url}/openapi.json", headers=AUTH).json())
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/models", "/healthz"}
    server_errors = []
    for operation in operations:
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if operation.method.upper() == "POST" else [])
        for mode in modes:
            @settings(max_examples=20, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def send(case):
                request = case.as_transport_kwargs(base_url=url, headers=AUTH)
                body = {"json": request["json"]} if "json" in request else {"content": request.get("data")}
                response = httpx.request(request["method"], request["url"], params=request.get("params"),
                                         headers=request.get("headers"), timeout=180, **body)
                if response.status_code >= 500:
                    server_errors.append((request["method"], request["url"], str(body)[:300], response.text[:300]))

            send()
    assert not server_errors, server_errors[:3]
    assert httpx.get(f"{url}/healthz").status_code == 200
    assert _post(url, _valid(7)).status_code == 200



def test_ray_behind_the_server_listens_on_loopback_only(server, loopback_only):
    *_, pid = server
    listeners = loopback_only(pid)
    assert any(name.startswith(("raylet", "gcs_server")) for _, name in listeners), listeners


def test_no_ray_process_outlives_a_sigkilled_server(tiny_model_dir, s3_endpoint, tmp_path):
    import signal

    import psutil

    from shared.net import wait_for_http
    from shared.storage.s3 import s3_client

    s3_client(s3_endpoint).create_bucket(Bucket="killed")
    port = free_port()
    env = {**os.environ, "SHARED_DIR": str(tmp_path), "AWS_ENDPOINT_URL": s3_endpoint, "S3_URI": "s3://killed/p",
           "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("SERVER_API_KEY", None)
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "services.server", f"model.path={tiny_model_dir}",
                             f"model.base_model_id={BASE}", f"server.port={port}"], env=env, cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    family = []
    try:
        def alive():
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]

        wait_for_http(f"http://127.0.0.1:{port}/healthz", timeout_s=240, alive=alive)
        family = psutil.Process(proc.pid).children(recursive=True)
        assert {"raylet", "gcs_server"} <= {p.name() for p in family}
        os.kill(proc.pid, signal.SIGKILL)  # the server alone, as `kill -9 <pid>` would
        proc.wait(timeout=30)
        deadline = time.time() + 60
        while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in family):
            left = [p.name() for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            assert time.time() < deadline, f"Ray processes outlived the server: {left}"
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for process in family:  # whatever a failed run left behind
            try:
                process.kill()
            except psutil.Error:
                pass


def test_a_seeded_sample_does_not_depend_on_its_batch_neighbours(server):
    url, *_ = server
    body = {**_valid(1), "temperature": 1.0, "seed": 11, "max_tokens": 8}
    alone = _post(url, body).json()["choices"][0]["message"]["content"]
    others = [{**_valid(i), "temperature": 1.0, "seed": 100 + i, "max_tokens": 8} for i in range(6)]
    with ThreadPoolExecutor(10) as pool:  # four copies of the request share a batch with six others
        replies = list(pool.map(lambda b: _post(url, b), [body] * 4 + others))
    assert [r.status_code for r in replies] == [200] * 10
    assert [r.json()["choices"][0]["message"]["content"] for r in replies[:4]] == [alone] * 4


def test_any_clients_history_is_cut_to_the_served_profiles_context(server):
    """The policy was trained on the task prompt, the last 2 exchanges and 1 picture (the profile's
    max_turns_in_context, max_images_in_context): the server gives the model that context whatever history a
    client sends, so a client that sends everything gets the answer a client that trims gets."""
    from PIL import Image

    from shared.models.chat import assistant_turn, limit_context, user_turn
    from shared.models.endpoint import to_openai_messages

    url, cfg, *_ = server
    picture = lambda seed: Image.fromarray(render_rgb(generate("maze_2d/easy", seed), 16))  # noqa: E731
    history = [user_turn("9x9 maze: reach the red square.", picture(0))]
    for turn in range(4):  # the last two observations carry pictures: 3 images, this server's per-request cap
        history += [assistant_turn(f"('move', {turn % 4})"),
                    user_turn("Action executed successfully.", picture(turn + 1) if turn >= 2 else None)]
    trimmed = limit_context(history, cfg.model.max_images_in_context, cfg.model.max_turns_in_context)
    assert len(trimmed) < len(history)
    replies = [_post(url, {"model": BASE, "max_tokens": 6, "messages": to_openai_messages(m)}) for m in (history, trimmed)]
    assert [r.status_code for r in replies] == [200, 200], [r.text[:500] for r in replies]
    answers = [r.json() for r in replies]
    assert answers[0]["usage"]["prompt_tokens"] == answers[1]["usage"]["prompt_tokens"]
    assert answers[0]["choices"][0]["message"]["content"] == answers[1]["choices"][0]["message"]["content"]


def test_a_planted_manifest_cannot_make_the_server_write_outside_its_cache(server):
    """Anyone who can write to the bucket could list `../` or absolute names in an adapter's manifest: refused (one
    line) before any download, and nothing lands outside the adapter cache."""
    import json

    from shared.storage.s3 import s3_client

    url, cfg, *_ = server
    client = s3_client(cfg.storage.aws_endpoint_url)
    bucket, prefix = cfg.storage.s3_uri[5:].split("/", 1)
    absolute = Path(cfg.shared_path()).parent / f"planted-by-manifest-{os.getpid()}"  # unique to this test run
    names = ["adapter_config.json", str(absolute), "../../../planted-by-manifest"]
    for name in names:
        client.put_object(Bucket=bucket, Key=f"{prefix}/adapters/planted/{name.lstrip('/')}", Body=b"{}")
    manifest = {"files": {name: {"sha256": "0" * 64, "size": 2} for name in names}}
    client.put_object(Bucket=bucket, Key=f"{prefix}/adapters/planted/manifest.json", Body=json.dumps(manifest))
    response = _post(url, _valid(0, f"{BASE}:planted"))
    _assert_error(response, 502, "not a plain file name")
    assert "\n" not in response.json()["error"]["message"]
    written = [*Path(cfg.shared_path()).rglob("planted-by-manifest"), *([absolute] if absolute.exists() else [])]
    assert not written, f"the server wrote outside its adapter cache: {written}"
    assert _post(url, _valid(1)).status_code == 200


def test_a_top_p_too_small_to_sample_is_sampled_safely_and_fails_no_neighbour(server):
    url, *_ = server
    tiny_p = {**_valid(2), "temperature": 1.0, "top_p": 1e-300, "seed": 3, "max_tokens": 6}
    greedy = _post(url, {**_valid(2), "max_tokens": 6})
    neighbours = [{**_valid(i), "temperature": 1.0, "top_p": 1e-300, "seed": i, "max_tokens": 6} for i in range(3)]
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda b: _post(url, b), [tiny_p, *neighbours]))
    assert [r.status_code for r in replies] == [200] * 4, [r.text[:300] for r in replies]
    # A nucleus of one token is the most likely token: what greedy decoding says.
    assert replies[0].json()["choices"][0]["message"]["content"] == greedy.json()["choices"][0]["message"]["content"]


def _large_picture_uri(seed: int) -> str:
    """A 4096 x 4096 PNG (16.7 Mpx, the largest picture accepted) of a few KB: costly to decode, cheap to send."""
    import base64
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (4096, 4096), (seed % 256, 40, 90)).save(buffer, format="PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_the_largest_accepted_requests_do_not_hold_a_small_neighbour(server):
    """Bound: while four clients each send the largest request this server accepts (3 pictures, the per-request cap,
    two of them 16.7 Mpx, the largest accepted), the health check answers within 2 s and a small chat request within
    20 s (alone: about 1 s). Only the newest picture is decoded (the model is shown one), off the event loop."""
    url, *_ = server
    newest = _valid(5)["messages"][0]["content"][1]
    large = {"model": BASE, "max_tokens": 6, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "9x9 maze"}, *[{"type": "image_url", "image_url": {"url": _large_picture_uri(i)}}
                                               for i in range(2)], newest]}]}
    small = _valid(4)
    assert _post(url, small).status_code == 200  # warm

    def timed(call):
        started = time.perf_counter()
        response = call()
        return response.status_code, time.perf_counter() - started

    with ThreadPoolExecutor(6) as pool:
        bigs = [pool.submit(lambda: _post(url, large)) for _ in range(4)]
        time.sleep(0.3)
        health = pool.submit(timed, lambda: httpx.get(f"{url}/healthz", timeout=60))
        chat = pool.submit(timed, lambda: _post(url, small))
        health, chat = health.result(), chat.result()
        statuses = [b.result().status_code for b in bigs]
    assert statuses == [200] * 4, statuses
    assert health[0] == 200 and health[1] < 2.0, f"health check held {health[1]:.1f} s"
    assert chat[0] == 200 and chat[1] < 20.0, f"small request held {chat[1]:.1f} s"


def test_a_request_with_more_parts_than_any_conversation_is_refused_unread(server):
    url, *_ = server
    many = {"model": BASE, "messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 40_000}]}
    started = time.perf_counter()
    response = _post(url, many)
    _assert_error(response, 400, "content parts")
    assert time.perf_counter() - started < 5.0


def test_only_the_pictures_the_model_is_shown_are_decoded(server):
    """The served profile shows the model one picture (the newest): older ones are checked as data URIs and dropped
    unread, so an undecodable older picture costs nothing and fails nothing, while an undecodable newest one is a
    400."""
    url, *_ = server
    broken = "data:image/png;base64," + "A" * 4000  # valid base64, not a picture
    body = _valid(6)
    newest = body["messages"][0]["content"][1]
    older = {"type": "image_url", "image_url": {"url": broken}}
    shown_last = {**body, "messages": [{"role": "user", "content": [{"type": "text", "text": "9x9"}, older, newest]}]}
    assert _post(url, shown_last).status_code == 200
    broken_last = {**body, "messages": [{"role": "user", "content": [{"type": "text", "text": "9x9"}, newest, older]}]}
    _assert_error(_post(url, broken_last), 400, "image 2")
