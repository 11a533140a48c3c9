"""Bad requests and the answer each must get, from either server: the CPU one (services/server/app.py) and the vLLM
app's ingress (services/server/llm_ingress.py) apply one set of rules (services/server/request_rules.py), so both
test files run this one table. A case is (keyword arguments for `send`, status, a word of the message or the
param). Both servers run with server.max_images_per_request=3 and server.max_request_bytes=1500000."""

import httpx

from shared.maze import generate
from shared.maze.render import data_uri, render_rgb


def valid_body(base: str, seed: int = 0, model: str | None = None) -> dict:
    image = data_uri(render_rgb(generate("maze_2d/easy", seed), 16))
    return {"model": model or base, "max_tokens": 6, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "9x9 maze"}, {"type": "image_url", "image_url": {"url": image}}]}]}


def send(url: str, key: str, json=None, content: bytes | None = None, headers: dict | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if headers is None else headers
    if content is not None:
        return httpx.post(f"{url}/v1/chat/completions", content=content,
                          headers={**headers, "Content-Type": "application/json"}, timeout=180)
    return httpx.post(f"{url}/v1/chat/completions", json=json, headers=headers, timeout=180)


def shared_cases(base: str) -> dict[str, tuple[dict, int, str]]:
    ok = valid_body(base)
    image = ok["messages"][0]["content"][1]
    deep = b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "x": ' % base.encode()
    return {
        "not json": ({"content": b"{not json"}, 400, "JSON"),
        "not utf-8": ({"content": b'{"model": "\xff\xfe"}'}, 400, "JSON"),
        "a list": ({"json": [1, 2]}, 400, "object"),
        "a string": ({"json": "hello"}, 400, "object"),
        "no messages": ({"json": {"model": base}}, 400, "messages"),
        "empty messages": ({"json": {"model": base, "messages": []}}, 400, "messages"),
        "NaN temperature": ({"content": b'{"model": "%s", "temperature": NaN, "messages": [{"role": "user", '
                                        b'"content": "hi"}]}' % base.encode()}, 400, "temperature"),
        "temperature 2.5": ({"json": {**ok, "temperature": 2.5}}, 400, "temperature"),
        "temperature next to 0": ({"json": {**ok, "temperature": 1e-300}}, 400, "too small to sample with"),
        "top_p 3.0": ({"json": {**ok, "top_p": 3.0}}, 400, "top_p"),
        "huge max_tokens": ({"json": {**ok, "max_tokens": 10**30}}, 400, "max_tokens"),
        "negative max_tokens": ({"json": {**ok, "max_tokens": -1}}, 400, "max_tokens"),
        "n=2": ({"json": {**ok, "n": 2}}, 400, "n"),
        "seed 2**64": ({"json": {**ok, "seed": 2**64}}, 400, "seed"),
        "messages not objects": ({"json": {"model": base, "messages": ["hi"]}}, 400, "messages"),
        "a tool role": ({"json": {"model": base, "messages": [{"role": "tool", "content": "hi"}]}}, 400, "role"),
        "part not an object": ({"json": {"model": base, "messages": [{"role": "user", "content": [7]}]}}, 400,
                               "content part"),
        "image url not a string": ({"json": {"model": base, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": 5}}]}]}}, 400, "data URI"),
        "image by URL": ({"json": {"model": base, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}]}]}}, 400, "data URI"),
        "too many images": ({"json": {"model": base, "messages": [{"role": "user", "content": [image] * 4}]}}, 400,
                            "too many images"),
        "model not a string": ({"json": {**ok, "model": ["x"]}}, 400, "model"),
        "adapter id with a newline": ({"json": {**ok, "model": f"{base}:x\n"}}, 400, "invalid"),
        "adapter id with a slash": ({"json": {**ok, "model": f"{base}:a/b"}}, 400, "invalid"),
        "unknown model": ({"json": {**ok, "model": "gpt-4"}}, 404, "gpt-4"),
        "nested 20,000 deep": ({"content": deep + b"[" * 20_000 + b"]" * 20_000 + b"}"}, 400, "nests"),
        "nested 100 deep": ({"content": deep + b"[" * 100 + b"]" * 100 + b"}"}, 400, "nests"),
        "body too large": ({"content": b" " * 1_600_000}, 413, "max_request_bytes"),
        "no token": ({"json": ok, "headers": {}}, 401, "token"),
    }


def check(url: str, key: str, cases: dict[str, tuple[dict, int, str]]) -> None:
    """Sends every case; each gets its status and an OpenAI-shaped error naming what was wrong, in one line."""
    for name, (request, status, word) in cases.items():
        response = send(url, key, **request)
        assert response.status_code == status, (name, response.status_code, response.text[:300])
        error = response.json()["error"]
        assert set(error) >= {"message", "type", "param", "code"}, (name, error)
        assert word in error["message"] or word == error.get("param"), (name, error)
        assert "\n" not in error["message"] and len(error["message"]) < 700, (name, error)
