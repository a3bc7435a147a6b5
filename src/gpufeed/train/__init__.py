"""``gpufeed train``: AMP + DDP ResNet training that measures whether the GPUs are fed (docs/design.md §1, §4, §5).

Read in this order: :mod:`~gpufeed.train.launch` (the run folder, torchrun, rank failures; ``python -m
gpufeed.train CONFIG`` is each rank's entry, :mod:`~gpufeed.train.__main__`), :mod:`~gpufeed.train.preflight`
(the checks before a run), :mod:`~gpufeed.train.job` (:func:`train` inside one rank, :func:`measure`),
:mod:`~gpufeed.train.trainer` (the :class:`Trainer` as a table of contents, and the ``build_*`` functions of its
parts), :mod:`~gpufeed.train.modes` (the measured modes, timed on the trainer's parts, and each mode's record),
:mod:`~gpufeed.train.steps` (each mode's step, the timing window), :mod:`~gpufeed.train.validate`,
:mod:`~gpufeed.train.logger` (log.jsonl and the progress bar), :mod:`~gpufeed.train.checkpoint`,
:mod:`~gpufeed.train.stop` (SIGTERM), :mod:`~gpufeed.train.records`, :mod:`~gpufeed.train.verdict_inputs` and
:mod:`~gpufeed.train.report`. The model, optimizer, AMP and LR schedule are :mod:`gpufeed.model`, shared with
``gpufeed plan``.
"""

from gpufeed.model import default_warmup, lr_at, resolve_amp
from gpufeed.train.job import given_storage_rate, measure, probe_storage, start_health, train
from gpufeed.train.modes import MODES_MEASURE
from gpufeed.train.preflight import check_classes, check_data, run_loader_config, steps_per_epoch
from gpufeed.train.steps import timing_window
from gpufeed.train.stop import StopRequest
from gpufeed.train.trainer import Trainer
from gpufeed.train.verdict_inputs import verdict_inputs

__all__ = ["MODES_MEASURE", "StopRequest", "Trainer", "check_classes", "check_data", "default_warmup",
           "given_storage_rate", "lr_at", "measure", "probe_storage", "resolve_amp", "run_loader_config",
           "start_health", "steps_per_epoch", "timing_window", "train", "verdict_inputs"]
