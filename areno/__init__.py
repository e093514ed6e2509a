"""areno: a self-contained LLM post-training toolkit (kernels, models, rollout engine, RL loop, server)."""

__version__ = "0.1.0"

__all__ = ["Trainer", "__version__"]


def __getattr__(name):
    # The SDK pulls in torch and the models; import it only when asked for.
    if name == "Trainer":
        from areno.api import Trainer

        return Trainer
    raise AttributeError(f"module 'areno' has no attribute {name!r}")
