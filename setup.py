"""The one compiled part of gpufeed: ``gpufeed.loader._jpegroi``, a small C module that decodes a JPEG's crop region
through the libjpeg-turbo Pillow already ships (``decode = "roi"``). Everything else is in pyproject.toml.

The extension is optional: where it does not build (no C compiler, no Python headers, Windows), pip installs gpufeed
without it and ``decode = "roi"`` uses nvImageCodec when installed, or is reported unavailable."""

import sys

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "gpufeed.loader._jpegroi",
    sources=["src/gpufeed/loader/_jpegroi.c"],
    depends=["src/gpufeed/loader/_jpeg/jpeglib.h", "src/gpufeed/loader/_jpeg/jmorecfg.h",
             "src/gpufeed/loader/_jpeg/jconfig.h"],
    libraries=["dl"] if sys.platform.startswith("linux") else [],
    extra_compile_args=["-O2"] if sys.platform != "win32" else [],
    optional=True,
)])
