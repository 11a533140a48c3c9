"""Ray Serve LLM's node initialization, skipped for a model that is already a folder on the replica's machine.

Before its engine starts, each LLMServer replica runs Ray Serve LLM's download task: a Ray worker of its own (it
imports Ray Serve LLM and torch: about 9 CPU-seconds) that, for a `model_source` with no cloud mirror, only makes
torch's kernels folder and returns the path it was given. This project's model is always a folder on the shared
volume (`/shared/models/...`, on every node of the cluster), so `LocalModel` makes that folder in the replica and
skips the task. A model the replica cannot see, or one with a mirror, goes through Ray's task as before.
"""

from __future__ import annotations

import logging
import os

from ray.llm._internal.common.callbacks.base import CallbackBase

# Ray Serve writes this logger's lines to the replica's log (logs/serve/replica_*.log in the Ray session).
log = logging.getLogger("ray.serve")


class LocalModel(CallbackBase):
    async def on_before_node_init(self) -> None:
        source = self.llm_config.model_loading_config.model_source  # a path, a bucket URI, or a mirror's config
        if isinstance(source, str) and os.path.isdir(source):
            import torch

            os.makedirs(os.path.join(torch.hub._get_torch_home(), "kernels"), exist_ok=True)
            self.ctx.run_init_node = False
            log.info("model folder %s is on this machine: Ray's model-download task skipped", source)
