"""The common library: maze, config, storage contract, model loading, episodes and evaluation."""

import os

# Nothing is downloaded at run time: models load from the shared volume, never from a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
