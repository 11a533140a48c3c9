"""The policy model: building the tiny Qwen3-VL, loading models and adapters, generating replies."""


class ModelLoadError(RuntimeError):
    """A model or adapter folder that cannot be used, with what to do about it."""
