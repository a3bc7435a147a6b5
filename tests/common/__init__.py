"""Helpers shared by the test modules (conftest.py holds only fixtures): :mod:`tests.common.cli` runs the gpufeed CLI
in-process or as a subprocess, :mod:`tests.common.shards` writes gpufeed-format shard sets, tars and images with one
writer (:func:`~tests.common.shards.write_shard_set`) and its presets, and :mod:`tests.common.netserver` has the
loopback servers (a faulty static server, a handler-per-request server, a scripted raw-socket server). The names a
test usually needs are also importable from ``tests.common`` itself."""

from tests.common.cli import invoke, invoke_json
from tests.common.shards import (WDS_SAMPLE, cfg, encode, make_shards, sizes_as_found, smooth_image, write_image,
                                 write_set, write_shard_set, write_tar, write_tiny_shards)

__all__ = ["WDS_SAMPLE", "cfg", "encode", "invoke", "invoke_json", "make_shards", "sizes_as_found", "smooth_image",
           "write_image", "write_set", "write_shard_set", "write_tar", "write_tiny_shards"]
