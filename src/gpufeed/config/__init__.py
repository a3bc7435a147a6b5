"""Typed configuration: one frozen dataclass per job, one TOML section per dataclass. See docs/design.md section 7.

Precedence is CLI > file > defaults; unknown sections and keys are errors; every value is type-checked against its
field's annotation, and every numeric field declares its range. The package: ``schema`` (the sections and their
field docs), ``limits`` (ranges and sizes), ``toml_io`` (files in and out), ``help`` (help text from the field
docs). Every name is importable from here. It must stay free of torch imports: ``gpufeed --help`` loads it.
"""

from __future__ import annotations

from gpufeed.config.help import field_help
from gpufeed.config.limits import (MAX_CONFIG_BYTES, MAX_SEED, MAX_WORKERS, MAX_BATCH_SIZE, MAX_PREFETCH_FACTOR,
                                   MAX_REMOTE_STREAMS, MAX_SHUFFLE_BUFFER, MAX_IMAGE_SIZE, MAX_IMAGE_SIDE,
                                   MAX_PIXELS_LIMIT, MAX_SHARD_SAMPLES, MAX_SHARD_BYTES, MAX_MULTIPLE_OF,
                                   MAX_RAM_BYTES, MAX_DURATION_S, MAX_WINDOW_S, MAX_RATE, MAX_REPEATS,
                                   MAX_WARMUP_BATCHES, MAX_MIN_GAIN, MAX_TARGET_MARGIN, MAX_CLASSES, MAX_EPOCHS,
                                   MAX_STEPS, MAX_ACCUM_STEPS, MAX_LR, MAX_MEASURE_STEPS, MAX_STORAGE_BYTES_PER_S,
                                   MAX_NPROC_PER_NODE, MAX_NODES, MAX_SYNTH_IMAGES, MAX_IO_READERS, MAX_IO_FILES,
                                   bounded, check_bounds, check_device, parse_size, show_value)
from gpufeed.config.schema import (DEFAULT_STEPS, SECTIONS, STEPS, Config, IoConfig, LayoutConfig, LoaderConfig,
                                   PlanConfig, RunConfig, ShardConfig, StageConfig, SynthConfig, TrainConfig,
                                   TuneConfig)
from gpufeed.config.toml_io import (CONFIG_HEADER, build_section, load_config, read_toml, render_config, to_toml,
                                    tomllib)
