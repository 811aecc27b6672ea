"""The trainer's algorithms, one module each (its advantage estimator, its loss and its settings),
found by name: ``trainer.algorithm`` names one, ``trainer.algorithm_args`` holds its settings.

Adding an algorithm is adding a module here with one `Algorithm` subclass (and its test): every
module of this package is searched (`get_algorithm`); `serve_rft.trainer.algorithms.losses`,
`serve_rft.trainer.algorithms.off_policy` and `serve_rft.trainer.algorithms.advantages` hold the
pieces several of them share.
"""

from __future__ import annotations

import importlib
import pkgutil

from serve_rft.trainer.algorithms.base import Algorithm, LossInputs

__all__ = ["Algorithm", "LossInputs", "algorithm_names", "get_algorithm"]

_SHARED = {"base", "losses", "advantages", "off_policy"}


def _registry() -> dict[str, type[Algorithm]]:
    """``name -> class`` of every `Algorithm` subclass defined in a module of this package."""
    found: dict[str, type[Algorithm]] = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name in _SHARED:
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        for value in vars(module).values():
            if (isinstance(value, type) and issubclass(value, Algorithm) and value is not Algorithm
                    and value.__module__ == module.__name__):
                if value.name in found:
                    raise RuntimeError(f"two algorithms named {value.name!r}: {found[value.name]} and {value}")
                found[value.name] = value
    return found


def algorithm_names() -> list[str]:
    """The names ``trainer.algorithm`` accepts, sorted."""
    return sorted(_registry())


def get_algorithm(cfg) -> Algorithm:
    """The algorithm ``cfg.algorithm`` names (a `serve_rft.config.TrainerConfig`), with its settings.

    Raises:
        ValueError: no algorithm has that name (the message lists the names).
        pydantic.ValidationError: ``cfg.algorithm_args`` is not that algorithm's settings.
    """
    registry = _registry()
    if cfg.algorithm not in registry:
        raise ValueError(f"trainer.algorithm={cfg.algorithm!r} is not an algorithm; choose one of "
                         f"{', '.join(sorted(registry))}")
    return registry[cfg.algorithm](cfg)
