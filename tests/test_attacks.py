"""The threat model, as tests: what a downloaded shard set, checkpoint or config must never be able to do.

gpufeed trusts the command line and the user's own config file. It never trusts file names, manifests,
tar headers, image headers or checkpoints (see docs/threat-model.md). Each section below is one attack
that used to work; each test fails without its fix.
"""

from __future__ import annotations

# --------------------------------------------------------------------------- 1. a shard file name runs a shell command


# --------------------------------------------------------------------------- 2. a checkpoint runs code on --resume


# --------------------------------------------------------------------------- 3. a tar header hangs the reader


# --------------------------------------------------------------------------- 9. a tiny image asks for gigabytes
