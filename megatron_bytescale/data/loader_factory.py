"""One entry point for both data loaders:
``make_loader("local" | "ray", data_path, planner_config, ...)``."""

from __future__ import annotations

from ..errors import ConfigError

MODES = ("local", "ray")


def make_loader(mode: str, data_path, planner_config=None, **kwargs):
    """A ``LocalDataLoader`` (default, no Ray) or a ``RayDataLoader``; both have the same API:
    ``batch(rank)``, ``advance()``, ``next_step(rank)``, iteration (for the loader's own
    ``rank``), ``state_dict()`` / ``load_state_dict()`` and ``close()``. Ray-only keyword
    arguments (``num_servers``, ``lookahead``, ``address``, ...) are refused in local mode."""
    if mode == "local":
        from .local_loader import LocalDataLoader

        return LocalDataLoader(data_path, planner_config, **kwargs)
    if mode == "ray":
        from .ray_loader import RayDataLoader

        return RayDataLoader(data_path, planner_config, **kwargs)
    raise ConfigError(f"unknown data loader mode {mode!r}; choose one of {', '.join(MODES)}")
