"""The GPU server: a Ray Serve LLM app (vLLM), the base model with LoRA adapters loaded from S3.

The exporter writes `<S3_URI>/adapters/<adapter_id>/`, exactly the layout `dynamic_lora_loading_path`
reads, so clients ask for `model="<base_id>:<adapter_id>"` with no conversion step.
"""

from __future__ import annotations

import re
from pathlib import Path

from shared.config import RunConfig
from shared.models import VLLM_CPU_ENV
from shared.storage.s3 import endpoint_credentials
from shared.storage.volume import SharedVolume

IMPORT_PATH = "ray.serve.llm:build_openai_app"
INGRESS = "services.server.llm_ingress:MazeIngress"
APP_NAME = "maze-llm"
# Skips Ray's model-download task for the model folder the replica already sees (services/server/llm_callback.py).
NODE_INIT = "services.server.llm_callback:LocalModel"


def llm_config(cfg: RunConfig) -> dict:
    """Returns the LLMConfig (as a dict) for the run config's base model and adapters.

    GPU and CPU differ only in the accelerator settings (`server.accelerator`, `accelerator_type`,
    `kv_cache_bytes`); the model, adapters and engine options are the same code.
    """
    if not cfg.storage.s3_uri:
        raise ValueError("the vLLM server loads adapters from S3: set S3_URI (storage.s3_uri)")
    server = cfg.server
    env_vars = {"AWS_REGION": cfg.cluster.region or "us-east-1"}
    if cfg.storage.aws_endpoint_url:
        env_vars["AWS_ENDPOINT_URL"] = cfg.storage.aws_endpoint_url  # Ray's LoRA loader reads S3 through it
        env_vars.update(endpoint_credentials(cfg.storage.aws_endpoint_url))  # an S3-compatible server's, if none set
    config = {
        "model_loading_config": {
            "model_id": cfg.model.base_model_id,
            "model_source": str(SharedVolume(cfg.shared_path()).model(cfg.model.path)),
        },
        "lora_config": {
            "dynamic_lora_loading_path": f"{cfg.storage.s3_uri.rstrip('/')}/adapters",
            "max_num_adapters_per_replica": server.max_num_adapters_per_replica,
        },
        "engine_kwargs": {
            "enable_lora": True,
            "max_lora_rank": server.max_lora_rank,
            "max_loras": server.max_loras,
            "dtype": cfg.model.dtype,
            "limit_mm_per_prompt": {"image": server.max_images_per_request},
            "max_model_len": server.max_model_len,
        },
        "deployment_config": {
            "autoscaling_config": {"min_replicas": server.num_replicas, "max_replicas": server.num_replicas},
            "max_constructor_retry_count": server.engine_start_tries,
        },
        "runtime_env": {"env_vars": env_vars},
        "callback_config": {"callback_class": NODE_INIT},
    }
    if server.kv_cache_bytes:
        config["engine_kwargs"]["kv_cache_memory_bytes"] = server.kv_cache_bytes
    if server.accelerator == "cpu":
        if not server.kv_cache_bytes:
            raise ValueError("server.accelerator=cpu needs server.kv_cache_bytes (vLLM's CPU engine otherwise "
                             "reserves 92% of RAM): e.g. server.kv_cache_bytes=268435456")
        if server.accelerator_type:
            raise ValueError("server.accelerator_type names a GPU: leave it unset with server.accelerator=cpu")
        config["accelerator_config"] = {"kind": "cpu"}
        env_vars.update(VLLM_CPU_ENV)
    elif server.accelerator_type:
        config["accelerator_type"] = server.accelerator_type
    return config


def ingress_config(cfg: RunConfig, api_key: str | None) -> dict:
    """Returns the ingress settings: this project's auth and request limits in front of Ray's OpenAI routes."""
    server = cfg.server
    return {
        "ingress_cls": INGRESS,
        "ingress_extra_kwargs": {
            "api_key": api_key,
            "limits": {"max_images_per_request": server.max_images_per_request, "max_image_bytes": server.max_image_bytes,
                       "max_new_tokens": server.max_new_tokens, "max_lora_rank": server.max_lora_rank,
                       "max_request_bytes": server.max_request_bytes, "max_prompt_tokens": server.max_prompt_tokens},
            "s3_uri": cfg.storage.s3_uri,
            "endpoint_url": cfg.storage.aws_endpoint_url,
            "region": cfg.cluster.region,
        },
    }


def app_args(cfg: RunConfig, api_key: str | None = None) -> dict:
    """Returns `build_openai_app`'s arguments: the one LLMConfig and the ingress."""
    return {
        "llm_configs": [llm_config(cfg)],
        "ingress_cls_config": ingress_config(cfg, api_key),
        # The ingress only forwards requests: it reserves no CPU, so an engine that takes every core of
        # a small machine (vLLM's CPU bundle) can still be placed beside it.
        "ingress_deployment_config": {"ray_actor_options": {"num_cpus": 0}},
    }


def serve_config(cfg: RunConfig) -> dict:
    """Returns the Serve config file (`serve run`/`serve deploy`) for the GPU app."""
    return {
        "http_options": {"host": "0.0.0.0", "port": cfg.server.port},
        "applications": [
            {
                "name": APP_NAME,
                "route_prefix": "/",
                "import_path": IMPORT_PATH,
                # No API key in a config file: the ingress reads SERVER_API_KEY from its environment.
                "args": app_args(cfg),
            }
        ],
    }


def validate(config: dict) -> None:
    """Validates against Ray's own schemas: ServeDeploySchema, and LLMConfig from Ray's source (the public
    `ray.serve.llm.LLMConfig` imports vLLM, and a dry run validates in the main venv, which has none)."""
    from ray.llm._internal.serve.core.configs.llm_config import LLMConfig
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(config) if hasattr(ServeDeploySchema, "model_validate") else ServeDeploySchema.parse_obj(config)
    for app in config["applications"]:
        for entry in app["args"]["llm_configs"]:
            LLMConfig(**entry)


def run(cfg: RunConfig, host: str = "0.0.0.0", api_key: str | None = None) -> str:
    """Starts Ray (if needed) and the vLLM app; returns its base URL once every replica is up.

    An engine that cannot start (a model it cannot load, a KV cache that does not fit) raises
    EngineStartError with the one line of Ray's report that names the cause.
    """
    import ray
    from ray import serve
    from ray.serve.llm import build_openai_app

    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False, _node_ip_address="127.0.0.1")
    app = build_openai_app(app_args(cfg, api_key))
    serve.start(http_options={"host": host, "port": cfg.server.port})
    try:
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
    except RuntimeError as exc:
        # Ray's exception only says that the deployment failed; the replica's traceback is in its status.
        report = [str(exc)]
        application = serve.status().applications.get(APP_NAME)
        if application is not None:
            report += [application.message] + [d.message for d in application.deployments.values()]
        report.append(engine_log_errors())
        raise EngineStartError(engine_start_cause("\n".join(m for m in report if m))) from None
    return f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{cfg.server.port}"


class EngineStartError(RuntimeError):
    """The vLLM engine did not start; the message is the cause, on one line."""


# Lines of Ray's report that only say "it failed", never why.
GENERIC_FAILURES = ("See root cause above", "Failed to update the deployments", "Engine core initialization failed")


def cause_line(report: str, limit: int = 500) -> str:
    """Returns the line of an error report that says why: its last `SomethingError: message` that is not
    just "it failed" (else its last line), without pointers to logs the user does not have."""
    causes = [c.strip() for c in re.findall(r"\b(\w*(?:Error|Exception): [^\n]+)", report)
              if not any(g in c for g in GENERIC_FAILURES)]
    lines = [line.strip() for line in report.splitlines() if line.strip()]
    line = (causes or lines or ["no reason given (see Ray's logs)"])[-1]
    line = re.sub(r" See https://\S+.*$", "", line).replace(", please check the stack trace above for the root cause", "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def engine_start_cause(report: str) -> str:
    """Returns why the engine did not start, on one line, from Ray's status and the engine's own log lines."""
    line = cause_line(report)
    if "KV cache" in line:
        line += " (here: raise server.kv_cache_bytes or lower server.max_model_len)"
    return "the vLLM engine did not start: " + line


def engine_log_errors(max_lines: int = 200) -> str:
    """Returns the error lines the engine wrote to this Ray session's worker logs (where vLLM says why)."""
    import ray

    try:
        logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    except Exception:
        return ""
    lines = []
    for path in sorted(logs.glob("worker-*")):
        try:
            lines += [line for line in path.read_text(errors="replace").splitlines() if "ERROR" in line and "Error" in line]
        except OSError:
            continue
    return "\n".join(lines[-max_lines:])
