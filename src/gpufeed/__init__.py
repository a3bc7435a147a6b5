"""gpufeed: keep GPUs fed, from an image folder to a measured training run."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("gpufeed")
except PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
