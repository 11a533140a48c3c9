"""The GPU server: a Ray Serve LLM app (vLLM), the base model with LoRA adapters loaded from S3.

The exporter writes `<S3_URI>/adapters/<adapter_id>/`, exactly the layout `dynamic_lora_loading_path`
reads, so clients ask for `model="<base_id>:<adapter_id>"` with no conversion step.
"""

from __future__ import annotations

from shared.config import RunConfig
from shared.storage import SharedVolume

IMPORT_PATH = "ray.serve.llm:build_openai_app"


def llm_config(cfg: RunConfig) -> dict:
    """Returns the LLMConfig (as a dict) for the run config's base model and adapters."""
    if not cfg.storage.s3_uri:
        raise ValueError("the GPU server loads adapters from S3: set S3_URI (storage.s3_uri)")
    server = cfg.server
    return {
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
            "max_model_len": 32768,
        },
        "deployment_config": {
            "autoscaling_config": {"min_replicas": server.num_replicas, "max_replicas": server.num_replicas},
        },
        "runtime_env": {"env_vars": {"AWS_REGION": cfg.cluster.region or "us-east-1"}},
    }


def serve_config(cfg: RunConfig) -> dict:
    """Returns the Serve config file (`serve run`/`serve deploy`) for the GPU app."""
    return {
        "http_options": {"host": "0.0.0.0", "port": cfg.server.port},
        "applications": [
            {
                "name": "maze-llm",
                "route_prefix": "/",
                "import_path": IMPORT_PATH,
                "args": {"llm_configs": [llm_config(cfg)]},
            }
        ],
    }


def validate(config: dict) -> None:
    """Validates against Ray's own schemas: ServeDeploySchema, and LLMConfig from Ray's source."""
    from ray.llm._internal.serve.core.configs.llm_config import LLMConfig
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(config) if hasattr(ServeDeploySchema, "model_validate") else ServeDeploySchema.parse_obj(config)
    for app in config["applications"]:
        for entry in app["args"]["llm_configs"]:
            LLMConfig(**entry)


def run(cfg: RunConfig) -> None:
    """Starts the GPU app (needs vLLM, i.e. `ray[llm]`, and GPUs)."""
    from ray import serve
    from ray.serve.llm import LLMConfig, build_openai_app

    app = build_openai_app({"llm_configs": [LLMConfig(**llm_config(cfg))]})
    serve.start(http_options={"host": "0.0.0.0", "port": cfg.server.port})
    serve.run(app, name="maze-llm", route_prefix="/", blocking=True)
