"""plait: train Llama-family language models across many accelerators.

The Python API (plait.api), imported on first use so that `import plait` stays light:
`plait.Config`, `plait.load_config`, `plait.Trainer`, `plait.Callback`, `plait.default_callbacks`,
`plait.load_model` (a trained model, as its run trained it).
"""

__version__ = "0.1.0"

_API = ("Callback", "Config", "Trainer", "default_callbacks", "load_config", "load_model")


def __getattr__(name: str):
    if name in _API:
        from plait import api

        return getattr(api, name)
    raise AttributeError(f"module 'plait' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_API])
