"""gpufeed: keep GPUs fed, from an image folder to a measured training run."""

from __future__ import annotations

__all__ = ["__version__"]


def __getattr__(name: str) -> str:
    """``__version__``, looked up in the installed package's metadata the first time it is read: importing
    ``importlib.metadata`` costs ~35 ms, which every command would otherwise pay at start-up."""
    if name != "__version__":
        raise AttributeError(f"module 'gpufeed' has no attribute {name!r}")
    from importlib.metadata import PackageNotFoundError, version

    try:
        value = version("gpufeed")
    except PackageNotFoundError:  # running from a source tree without install
        value = "0.0.0+unknown"
    globals()["__version__"] = value
    return value
