"""The config sections: one frozen, keyword-only dataclass per job (``SECTIONS``), and ``Config``, all of them.
See docs/design.md section 7.

The docstring under each field is also that option's ``gpufeed CMD --help`` text and its comment in
``configs/default.toml`` (``config.help`` reads it from this file's source); an optional field's docstring ends
with "None = ..." saying what None means. No torch here: ``gpufeed --help`` loads it.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Literal

from gpufeed.core.errors import ConfigError
from gpufeed.config.limits import (MAX_ACCUM_STEPS, MAX_BATCH_SIZE, MAX_CLASSES, MAX_DURATION_S, MAX_EPOCHS,
                                   MAX_IMAGE_SIDE, MAX_IMAGE_SIZE, MAX_IO_FILES, MAX_IO_READERS, MAX_LR,
                                   MAX_MEASURE_STEPS, MAX_MIN_GAIN, MAX_MULTIPLE_OF, MAX_NODES, MAX_NPROC_PER_NODE,
                                   MAX_PIXELS_LIMIT, MAX_PREFETCH_FACTOR, MAX_DECODE_THREADS, MAX_RAM_BYTES, MAX_RATE,
                                   MAX_REMOTE_STREAMS, MAX_REPEATS, MAX_SEED, MAX_SHARD_BYTES, MAX_SHARD_SAMPLES,
                                   MAX_SHUFFLE_BUFFER, MAX_STEPS, MAX_STORAGE_BYTES_PER_S, MAX_SYNTH_IMAGES,
                                   MAX_TARGET_MARGIN, MAX_WARMUP_BATCHES, MAX_WINDOW_S, MAX_WORKERS, bounded,
                                   check_bounds, check_device, show_value)


@dataclass(frozen=True, kw_only=True)
class ShardConfig:
    """``gpufeed shard SRC DEST``: image folder -> WebDataset shards + manifest."""

    src: str | None = None
    """Input image folder in ImageFolder layout (one sub-folder per class)."""
    dest: str | None = None
    """Output folder for the shard set (NVMe or a RAM disk)."""
    workers: int | None = bounded(None, 1, MAX_WORKERS)
    """Worker processes; None = the CPUs this process may use (affinity and cgroup aware)."""
    seed: int = bounded(0, 0, MAX_SEED)
    """Seed of the sample shuffle that spreads classes over shards."""
    shard_samples: int = bounded(10_000, 1, MAX_SHARD_SAMPLES)
    """Target samples per shard (the plan takes whichever of samples/bytes gives more shards)."""
    shard_bytes: int = bounded(1_000_000_000, 1, MAX_SHARD_BYTES, size=True)
    """Target bytes per shard (bytes or a size such as 1GB, 512MiB)."""
    multiple_of: int = bounded(1, 1, MAX_MULTIPLE_OF)
    """Round the shard count up to a multiple of this (set it to ranks x workers)."""
    prefix: str = "train"
    """Shard file prefix: train, val, ..."""
    max_size: int | None = bounded(None, 8, MAX_IMAGE_SIDE)
    """Re-encode: resize the long side down to this many pixels (never up)."""
    quality: int | None = bounded(None, 1, 95)
    """Re-encode every image as JPEG of this quality."""
    check: Literal["full", "header"] = "full"
    """full = decode every image; header = read headers only (faster, catches less)."""
    strict: bool = False
    """Exit 1 if any input was rejected."""
    overwrite: bool = False
    """Replace an existing shard set at DEST whose plan differs."""
    allow_empty_classes: bool = False
    """Keep empty class folders as classes (with a warning) instead of refusing the input."""
    max_pixels: int = bounded(89_478_485, 1, MAX_PIXELS_LIMIT)
    """Decompression-bomb limit in pixels (Pillow's default); larger images are rejected."""
    classes_like: Literal["gpufeed", "imagefolder"] = "gpufeed"
    """Class folders: gpufeed = skip hidden folders (.ipynb_checkpoints) and hidden files; imagefolder = exactly
    torchvision's ImageFolder (every folder in SRC, hidden included, and hidden files in class folders)."""
    classes_file: str | None = None
    """Class names in label order, one per line, each a folder of SRC (others are ignored); default: the folders'
    sorted names."""
    engine: Literal["local", "ray"] = "local"
    """Where validation and writing run: local = this machine's worker processes; ray = Ray tasks (the gpufeed[ray]
    extra) on the cluster at ray_address, else a local Ray instance. The output bytes are the same."""
    ray_address: str | None = None
    """The Ray cluster to join with engine = ray (HOST:6379, ray://HOST:10001); None = RAY_ADDRESS, else a local one."""
    num_nodes: int | None = bounded(None, 1, MAX_NODES)
    """Static split over this many nodes sharing DEST: this node writes shards i with i % num_nodes == node_rank; the
    last to finish writes the index and manifest. None = no split."""
    node_rank: int | None = bounded(None, 0, MAX_NODES - 1)
    """This node's rank in the static split; None = SLURM_ARRAY_TASK_ID, JOB_COMPLETION_INDEX, GROUP_RANK or
    SLURM_NODEID."""
    finish: bool = False
    """Only finish DEST (gpufeed shard DEST --finish): once every shard is complete, write the index and manifest."""

    def __post_init__(self) -> None:
        check_bounds(self)
        if self.node_rank is not None and self.num_nodes is not None and self.node_rank >= self.num_nodes:
            raise ConfigError(f"node_rank ({self.node_rank}) must be below num_nodes ({self.num_nodes})")
        if not re.fullmatch(r"[A-Za-z0-9_-]+", self.prefix):
            raise ConfigError(f"prefix must use letters, digits, '_' or '-' only, got {self.prefix!r}")


@dataclass(frozen=True, kw_only=True)
class LoaderConfig:
    """The DataLoader over a shard set, shared by ``tune`` and ``train``. ``tune`` writes this section."""

    batch_size: int = bounded(256, 1, MAX_BATCH_SIZE)
    """Samples per batch (per rank)."""
    num_workers: int = bounded(4, 0, MAX_WORKERS)
    """DataLoader worker processes per rank."""
    pin_memory: bool = True
    """Pin host batches (only meaningful with CUDA; ignored on CPU)."""
    prefetch_factor: int = bounded(2, 1, MAX_PREFETCH_FACTOR)
    """Batches prefetched per worker (ignored when num_workers == 0)."""
    persistent_workers: bool = True
    """Keep workers alive between epochs (ignored when num_workers == 0)."""
    worker_batching: bool = True
    """Collate batches inside the workers (one IPC message per batch instead of per sample)."""
    shuffle_buffer: int = bounded(2_000, 0, MAX_SHUFFLE_BUFFER)
    """Samples in the seeded shuffle buffer (0 = no shuffle)."""
    decode: Literal["pil", "pil-draft", "simplejpeg", "roi", "gpu"] = "simplejpeg"
    """Decode path: PIL full, PIL reduced-size draft, simplejpeg (libjpeg-turbo), roi (only the train crop's region:
    libjpeg-turbo's scanline crop and skip, through gpufeed's compiled module over Pillow's libjpeg-turbo, else
    nvImageCodec's CPU backend: pip install 'gpufeed[roi]') or GPU nvjpeg."""
    decode_threads: int = bounded(1, 1, MAX_DECODE_THREADS)
    """Threads decoding inside each worker process (the main process when num_workers = 0): libjpeg-turbo, PIL and
    torch's resize release the GIL, so N threads decode N images at once with no sample passed between processes.
    Same samples, order and crops as 1. Ignored with decode = "gpu"."""
    image_size: int = bounded(224, 1, MAX_IMAGE_SIZE)
    """Output side in pixels."""
    on_error: Literal["raise", "skip"] = "raise"
    """Corrupt sample policy: raise, or skip and count it."""
    check: Literal["keys", "sha256"] = "keys"
    """What the loader compares with the manifest as it reads each shard, besides the sample count: keys = each
    local shard's size before it is read (and that it does not change while read) and the digest of its key
    sequence (keys_sha256) at its end, at no extra cost; sha256 = also the whole file's sha256 the first time a
    worker reads the shard to its end (the shard is then streamed whole: it reads the bytes a worker's range
    skips, and costs hashing). A mismatch is a refusal or, with on_error = skip, the shard's samples counted."""
    seed: int = bounded(0, 0, MAX_SEED)
    """Seed for shard order, shuffle buffer and random crops."""
    crop_ratio: float = bounded(0.875, 0.0, 1.0, min_open=True)
    """Eval transform: resize the shorter side to image_size / crop_ratio, then centre-crop image_size."""
    resize: Literal["torch", "pil"] = "torch"
    """Crop+resize kernel (uint8, antialiased bilinear): torch's SIMD kernel (fast) or PIL resize(box=...)."""
    max_pixels: int = bounded(89_478_485, 1, MAX_PIXELS_LIMIT)
    """Decompression-bomb limit (width x height, from the image header) for a stored image, as in ``shard``: a
    larger image is refused before it is decoded (the loader treats it as a corrupt sample, per on_error)."""
    remote_streams: int = bounded(4, 1, MAX_REMOTE_STREAMS)
    """Range requests each worker keeps in flight on a remote (http, https, s3, gs) shard, each on its own
    connection: more hide a slow first byte and add up per-connection throttles. Each asks for 8 MiB / remote_streams
    (at least 1 MiB), so a worker holds about 8 MiB in flight plus the range it reads (more above 8 streams:
    remote_streams x 1 MiB). Ignored for local shards and pipe: commands; tune searches it for a remote set."""
    shard_split: Literal["global", "node"] = "global"
    """How an epoch's shards are split: global = every rank takes a range of all shards in a seeded per-epoch order
    (every node reads every shard over the epochs); node = node n of N reads only the shards i with i % N == n, the
    ones ``gpufeed stage --num-nodes N --node-rank n`` copies (required for a set staged per node)."""

    def __post_init__(self) -> None:
        check_bounds(self)


@dataclass(frozen=True, kw_only=True)
class TuneConfig:
    """``gpufeed tune SHARDS``: a measured, budget-aware sweep of LoaderConfig knobs."""

    shards: str | None = None
    """The shard set to read: a folder, manifest.json, URL (http, https, s3, gs) or brace pattern."""
    manifest: str | None = None
    """The set's manifest.json (a path or URL) when ``shards`` is a brace pattern or ``pipe:`` command (e.g. from
    ``gpufeed index PATTERN --out DIR``); None = the manifest next to ``shards``."""
    budget_s: float = bounded(300.0, 0.0, MAX_DURATION_S, min_open=True)
    """Wall-clock budget of the whole sweep in seconds."""
    batch_size: int | None = bounded(None, 1, MAX_BATCH_SIZE)
    """Batch size used in every trial; None = the [loader] batch_size."""
    max_workers: int | None = bounded(None, 0, MAX_WORKERS)
    """Largest num_workers per rank tried; None = the loaders' share of the usable CPUs (x cpu_budget, less
    trainer_cores per rank) split over the ranks, rounded down."""
    cpu_budget: float = bounded(1.0, 0.0, 1.0, min_open=True)
    """Fraction of the usable CPUs the loader may use (as tf.data AUTOTUNE's cpu_budget)."""
    ram_budget: int | None = bounded(None, 1, MAX_RAM_BYTES, size=True)
    """RAM the loader processes may use (bytes or '8GB'); None = half of the machine's RAM."""
    target_rate: float | None = bounded(None, 0.0, MAX_RATE, min_open=True)
    """Samples/s the node's GPUs need together (GPUs x one GPU's ceiling); the search stops once the ranks'
    aggregate beats it with margin."""
    baseline_imagefolder: str | None = None
    """An ImageFolder of the same images: measure torchvision ImageFolder + DataLoader as baseline."""
    out: str | None = None
    """Where to write the winning [loader] section (TOML)."""
    image_size: int | None = bounded(None, 1, MAX_IMAGE_SIZE)
    """Output side in pixels, as in training; None = the [loader] image_size."""
    run_dir: str | None = None
    """Run folder for trials, chart and summary; None = runs/tune-<UTC timestamp>/."""
    repeats: int = bounded(3, 1, MAX_REPEATS)
    """Measurement windows per trial (median and spread are reported)."""
    window_s: float | None = bounded(None, 0.0, MAX_WINDOW_S, min_open=True)
    """Seconds per measurement window; None = sized from the budget (0.3-10 s)."""
    warmup_batches: int = bounded(2, 0, MAX_WARMUP_BATCHES)
    """Batches read and discarded after start-up before measuring (start-up is reported separately)."""
    min_gain: float = bounded(0.05, 0.0, MAX_MIN_GAIN)
    """A knob change must win by this fraction to be kept; the worker climb stops below it."""
    target_margin: float = bounded(1.2, 1.0, MAX_TARGET_MARGIN)
    """Stop once the best rate >= target_rate x this margin."""
    device: str = "auto"
    """Where batches are moved: auto (CUDA when present), cpu, cuda or cuda:N."""
    nproc_per_node: int | None = bounded(None, 1, MAX_NPROC_PER_NODE)
    """Training processes (GPUs) per node to tune for: that many rank loaders run at once, each on its own slice;
    None = the [train] nproc_per_node."""
    trainer_cores: int = bounded(1, 0, MAX_WORKERS)
    """Cores left to each training process, kept out of its loader's worker budget."""
    with_model: str | None = None
    """A torchvision arch (as [train] arch): every trial runs this model's training step on each batch it reads,
    with the torch threads (or the GPU) a training rank gets, so a trial measures what training will get: on the
    CPU the loader shares the cores with the step, and num_workers = 0 loads in series with it, as in training.
    None = the loader alone (its ceiling)."""
    model_threads: int | None = bounded(None, 1, MAX_WORKERS)
    """torch CPU threads of the with_model step on the CPU; None = the [train] threads, else usable CPUs / ranks
    (what gpufeed train sets)."""
    storage_probe_s: float = bounded(3.0, 0.0, MAX_WINDOW_S)
    """Seconds spent probing the shard set's read rate before the trials (gpufeed io's reader ladder, cold where
    measurable), so the bound line can say whether the loader reads at the storage's limit; 0 = no probe."""

    def __post_init__(self) -> None:
        check_bounds(self)
        check_device(self.device)


@dataclass(frozen=True, kw_only=True)
class LayoutConfig:
    """The node layout a [loader] section was tuned for: ``gpufeed tune`` writes it next to [loader] and
    ``gpufeed train`` warns when it runs a different one."""

    ranks_per_node: int | None = bounded(None, 1, MAX_NPROC_PER_NODE)
    """Rank loaders measured at once on the node; None = no tuned layout recorded."""
    usable_cores: int | None = bounded(None, 1, MAX_WORKERS)
    """CPUs the tuning process could use (affinity and cgroup aware); None = not recorded."""
    trainer_cores: int = bounded(1, 0, MAX_WORKERS)
    """Cores left to each training process, kept out of its loader's worker budget."""
    device: Literal["cpu", "cuda"] | None = None
    """Device type the batches went to; None = not recorded."""

    def __post_init__(self) -> None:
        check_bounds(self)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """``gpufeed train``: AMP + DDP ResNet training that measures data stall."""

    shards: str | None = None
    """Training shard set: a folder, manifest.json, URL (http, https, s3, gs) or brace pattern."""
    manifest: str | None = None
    """The training set's manifest.json (a path or URL) when ``shards`` is a brace pattern or ``pipe:`` command
    (e.g. from ``gpufeed index PATTERN --out DIR``); None = the manifest next to ``shards``."""
    val_shards: str | None = None
    """Validation shard set (top-1/top-5 at the end of each epoch)."""
    arch: Literal["resnet18", "resnet34", "resnet50", "resnet101"] = "resnet50"
    """torchvision ResNet architecture."""
    num_classes: int | None = bounded(None, 1, MAX_CLASSES)
    """Classifier outputs; None = the training set's class count (1000 with --synthetic and no shards)."""
    epochs: int = bounded(1, 1, MAX_EPOCHS)
    """Epochs to train (ignored when steps is set)."""
    steps: int | None = bounded(None, 1, MAX_STEPS)
    """Optimizer steps to train; overrides epochs."""
    batch_size: int | None = bounded(None, 1, MAX_BATCH_SIZE)
    """Samples per micro-batch per rank (per GPU); None = the [loader] batch_size."""
    accum_steps: int = bounded(1, 1, MAX_ACCUM_STEPS)
    """Micro-batches accumulated per optimizer step (DDP syncs gradients on the last one only)."""
    image_size: int | None = bounded(None, 1, MAX_IMAGE_SIZE)
    """Training image side in pixels; None = the [loader] image_size."""
    amp: Literal["auto", "bf16", "fp16", "off"] = "auto"
    """Autocast dtype (fp16 uses a GradScaler); auto = bf16 on CUDA devices with native bf16 (compute capability
    8.0+), fp16 on older ones, off on the CPU (bf16 autocast is emulated, and many times slower than float32, on
    CPUs without native bf16 instructions; ask for bf16 explicitly on one that has them)."""
    channels_last: bool = False
    """Use the channels_last memory format (faster convolutions on tensor-core GPUs)."""
    compile: bool = False
    """torch.compile the model."""
    lr: float = bounded(0.1, 0.0, MAX_LR)
    """Peak learning rate (SGD); reached after the warm-up, then cosine decay."""
    warmup_steps: int | None = bounded(None, 0, MAX_STEPS)
    """Linear LR warm-up in optimizer steps; None = 5% of the run (at most 2000 steps)."""
    min_lr: float = bounded(0.0, 0.0, MAX_LR)
    """Learning rate at the end of the cosine decay."""
    momentum: float = bounded(0.9, 0.0, 1.0)
    """SGD momentum (Nesterov off)."""
    weight_decay: float = bounded(1e-4, 0.0, 1.0)
    """SGD weight decay (not applied to BatchNorm and bias parameters)."""
    label_smoothing: float = bounded(0.1, 0.0, 1.0, max_open=True)
    """Cross-entropy label smoothing."""
    checkpoint_dir: str | None = None
    """Folder for atomic checkpoints (last.pt); None = no checkpoints."""
    checkpoint_every: int = bounded(0, 0, MAX_STEPS)
    """Checkpoint every N optimizer steps (0 = at epoch ends and at the end of the run only)."""
    resume: bool = False
    """Continue from checkpoint_dir/last.pt (same step, LR, optimizer and loader position)."""
    resume_other_set: bool = False
    """With resume: accept a checkpoint written for another shard set (its identity is recorded in it): keep its
    step, weights and LR, and read its epoch of this set from the beginning. Without it such a resume is refused."""
    seed: int = bounded(0, 0, MAX_SEED)
    """Seed for model init and data order."""
    mode: Literal["real", "synthetic", "loader-only", "measure"] = "real"
    """real = train; synthetic = fixed batch on the device (GPU ceiling); loader-only = loader alone (loader
    ceiling); measure = synthetic, loader-only and real, briefly, in that order, then the verdict."""
    measure_steps: int = bounded(20, 1, MAX_MEASURE_STEPS)
    """Timed steps per mode with mode = measure."""
    timing_warmup_steps: int = bounded(3, 0, MAX_MEASURE_STEPS)
    """Steps at the start of each mode left out of the timing (start-up, cudnn autotune, compile)."""
    log_every: int = bounded(10, 1, MAX_STEPS)
    """Optimizer steps per JSONL log record."""
    # --- issue 19, measurement side: enough measurement and the timeline
    measure_seconds: float = bounded(40.0, 0.0, MAX_WINDOW_S)
    """Seconds --measure may spend, over its three modes, extending a mode window by window until its windows
    settle (at least 3, the 90% interval of their mean narrower than the verdict's margins); each mode runs its
    measure_steps anyway (and each re-measure of --fix gets the same share). Unsettled when the budget ends: the
    verdict is inconclusive (too noisy). 0 = measure_steps only."""
    profile_steps: int = bounded(0, 0, MAX_MEASURE_STEPS)
    """Steps captured with torch.profiler (CPU, and CUDA on a GPU) as a Chrome trace in the run folder's profile/:
    with --measure, extra real steps after the timed modes; in training, the first steps; 0 = none."""
    device: str = "auto"
    """auto (CUDA when present), cpu, cuda or cuda:N; under torchrun each rank takes cuda:LOCAL_RANK."""
    threads: int | None = bounded(None, 1, MAX_WORKERS)
    """torch CPU threads per rank; None = usable CPUs / processes on this node."""
    storage_bytes_per_s: float | None = bounded(None, 0.0, MAX_STORAGE_BYTES_PER_S, min_open=True)
    """Measured read rate of the shard storage in bytes/s (e.g. with fio); lets the verdict call a storage bound.
    Given, it replaces the probe (storage_probe_s) and storage_record."""
    storage_record: str | None = None
    """A ``gpufeed io`` summary.json that measured the shard set's folder: its best rate is the storage rate
    (instead of the probe); None = not used."""
    storage_probe_s: float = bounded(3.0, 0.0, MAX_WINDOW_S)
    """Seconds ``--measure`` spends probing the shard set's read rate (gpufeed io's reader ladder, cold where
    measurable) before the modes, unless storage_bytes_per_s or storage_record is given; 0 = no probe."""
    fix: bool = False
    """With mode = measure: when the verdict is starved by something gpufeed can change itself ([loader]
    num_workers, prefetch_factor, decode, pin_memory, remote_streams, or staging the set to /dev/shm or
    fix_stage_dir), apply one change at a time, re-measure, keep it only when it helps beyond the spread of the
    timing windows, and write the improved settings to fixed.toml in the run folder."""
    fix_budget_s: float = bounded(300.0, 0.0, MAX_DURATION_S, min_open=True)
    """Wall-clock seconds --fix may spend trying fixes (staging included); a fix is started only when the
    longest measurement so far still fits."""
    fix_stage_dir: str | None = None
    """Where --fix stages a storage-bound shard set; None = /dev/shm/gpufeed-fix-<set name> when the set fits in
    /dev/shm's free space (else staging is printed, not tried)."""
    nproc_per_node: int = bounded(1, 1, MAX_NPROC_PER_NODE)
    """Processes (GPUs) per node; > 1 or nnodes > 1 launches through torchrun."""
    nnodes: str = "1"
    """Nodes (torchrun syntax: N or MIN:MAX)."""
    node_rank: int | None = bounded(None, 0, MAX_NODES - 1)
    """This node's rank for static rendezvous (with master_addr); None = 0."""
    master_addr: str | None = None
    """Static rendezvous host (rank 0's node)."""
    master_port: int | None = bounded(None, 1, 65535)
    """Static rendezvous port; None = 29500."""
    rdzv_endpoint: str | None = None
    """c10d rendezvous endpoint HOST[:PORT] (instead of master_addr/master_port)."""
    rdzv_id: str = "gpufeed"
    """Rendezvous job id (same on all nodes)."""
    run_dir: str | None = None
    """Run folder; None = runs/train-<UTC timestamp>/."""
    progress: bool = True
    """tqdm progress bar on rank 0."""

    def __post_init__(self) -> None:
        check_bounds(self)
        check_device(self.device)
        if not re.fullmatch(r"\d+(:\d+)?", self.nnodes):
            raise ConfigError(f"nnodes must be N or MIN:MAX, got {self.nnodes!r}")
        if self.resume and not self.checkpoint_dir:
            raise ConfigError("resume needs checkpoint_dir (the folder holding last.pt)")
        if self.storage_bytes_per_s is not None and self.storage_record is not None:
            raise ConfigError("give storage_bytes_per_s (--storage-rate) or storage_record, not both")
        if self.fix and self.mode != "measure":
            raise ConfigError("fix needs mode = measure (--measure): a fix is kept only when a re-measure shows it helps")


@dataclass(frozen=True, kw_only=True)
class SynthConfig:
    """``gpufeed synth DEST``: a small ImageNet-like ImageFolder of JPEGs for demos, tests and benchmarks."""

    dest: str | None = None
    """Output folder; class sub-folders n0000, n0001, ... are created in it."""
    images: int = bounded(1_000, 1, MAX_SYNTH_IMAGES)
    """Images to write in all (spread evenly over the classes)."""
    classes: int = bounded(10, 1, MAX_CLASSES)
    """Class folders."""
    seed: int = bounded(0, 0, MAX_SEED)
    """Same seed => byte-identical files (with the same Pillow/libjpeg build), whatever the workers."""
    workers: int | None = bounded(None, 1, MAX_WORKERS)
    """Worker processes (the output does not depend on them); None = the CPUs this process may use."""
    overwrite: bool = False
    """Replace an earlier synth folder at DEST (folders holding other files are refused)."""

    def __post_init__(self) -> None:
        check_bounds(self)
        if self.classes > self.images:
            raise ConfigError(f"classes ({self.classes}) must not exceed images ({self.images}): "
                              "every class folder needs at least one image")


@dataclass(frozen=True, kw_only=True)
class IoConfig:
    """``gpufeed io PATH [PATH ...]``: read rates of shard sets and image folders, cold and warm, per reader count."""

    seconds: float = bounded(3.0, 0.0, MAX_WINDOW_S, min_open=True)
    """Wall-clock bound of one measurement step (one reader count, cold or warm) in seconds."""
    bytes: int = bounded(2_000_000_000, 1, MAX_RAM_BYTES, size=True)
    """Bytes one step may read at most (bytes or a size such as 2GB, 512MiB)."""
    max_readers: int | None = bounded(None, 1, MAX_IO_READERS)
    """Largest reader count of the ladder 1, 2, 4, ...; None = min(16, 4 x the CPUs this process may use)."""
    max_files: int = bounded(100_000, 1, MAX_IO_FILES)
    """Files listed at most in an image folder (the walk stops there and says so)."""
    target_rate: float | None = bounded(None, 0.0, MAX_RATE, min_open=True)
    """Samples/s the GPUs need; with it, each location gets the bandwidth needed and a verdict; None = no need
    line unless gpu_ceiling is given."""
    gpu_ceiling: str | None = None
    """A summary.json of a previous train --measure run: its synthetic samples/s is the target rate; None = not
    used."""
    run_dir: str | None = None
    """Run folder; None = runs/io-<UTC timestamp>/."""

    def __post_init__(self) -> None:
        check_bounds(self)
        if self.target_rate is not None and self.gpu_ceiling is not None:
            raise ConfigError("give target_rate or gpu_ceiling, not both")


@dataclass(frozen=True, kw_only=True)
class StageConfig:
    """``gpufeed stage SRC DEST``: copy a shard set to local NVMe or a RAM disk, checked, resumable."""

    src: str | None = None
    """The shard set to copy: a shard-set folder or its manifest.json."""
    dest: str | None = None
    """Local folder the set is staged into (its manifest is written there)."""
    jobs: int | None = bounded(None, 1, MAX_WORKERS)
    """Concurrent shard copies (threads); None = min(8, shards to copy)."""
    node_rank: int | None = bounded(None, 0, MAX_NODES - 1)
    """This node's rank (0..num_nodes-1); None = the launcher's (torchrun GROUP_RANK, SLURM_NODEID), else 0."""
    num_nodes: int | None = bounded(None, 1, MAX_NODES)
    """Nodes of the job; above 1 only this node's shards (i % num_nodes == node_rank) are copied, for
    [loader] shard_split = "node"; None = the launcher's (GROUP_WORLD_SIZE, SLURM_JOB_NUM_NODES), else 1."""

    def __post_init__(self) -> None:
        check_bounds(self)
        # only when both are given: a missing num_nodes comes from the launcher's environment (stage.node_of checks)
        if self.node_rank is not None and self.num_nodes is not None and self.node_rank >= self.num_nodes:
            raise ConfigError(f"node_rank ({self.node_rank}) must be below num_nodes ({self.num_nodes})")


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """``gpufeed plan``: peak training memory from real steps (will the batch fit?) and the loader's cores per GPU."""

    arch: Literal["resnet18", "resnet34", "resnet50", "resnet101"] = "resnet50"
    """torchvision ResNet architecture, built as gpufeed train builds it."""
    num_classes: int = bounded(1000, 1, MAX_CLASSES)
    """Classifier outputs."""
    batch_size: int = bounded(256, 1, MAX_BATCH_SIZE)
    """Samples per micro-batch per GPU to plan for."""
    image_size: int = bounded(224, 1, MAX_IMAGE_SIZE)
    """Training image side in pixels (every step is measured at this size)."""
    amp: Literal["auto", "bf16", "fp16", "off"] = "auto"
    """Autocast dtype, as gpufeed train: auto = bf16 on CUDA devices with compute capability 8.0+, fp16 on older
    ones, off on the CPU."""
    channels_last: bool = False
    """Use the channels_last memory format, as gpufeed train --channels-last."""
    optimizer: Literal["sgd", "adamw"] = "sgd"
    """sgd = gpufeed train's optimizer (SGD, momentum 0.9: one buffer per parameter); adamw = AdamW (two)."""
    device: str = "auto"
    """Where the steps are measured: auto (CUDA when present), cpu, cuda or cuda:N."""
    measure_batches: tuple[int, ...] | None = None
    """The two batch sizes measured for the linear model; None = b and 2b, b the smallest power of two (at least 2
    on the CPU, 16 on a GPU) whose activations are twice the gradients."""
    check_batch: int | None = bounded(None, 0, MAX_BATCH_SIZE)
    """A third batch size measured to check the model's estimate (0 = no check); None = twice the larger
    measured one."""
    gpu_memory: int | None = bounded(None, 1, MAX_RAM_BYTES, size=True)
    """GPU memory to plan for (bytes or a size such as 80GiB); None = the measuring GPU's total, none on the CPU."""
    headroom: float = bounded(0.10, 0.0, 0.9)
    """Fraction of the GPU memory kept free for allocator fragmentation, the CUDA context and workspace spikes."""
    target_rate: float | None = bounded(None, 0.0, MAX_RATE, min_open=True)
    """Samples/s ONE GPU consumes (e.g. its train --measure synthetic rate); None = the train record's synthetic
    rate per rank, when record is a train summary.json."""
    record: str | None = None
    """A gpufeed tune or train summary.json: the loader's measured samples/s per core (tune: the best trial;
    train: the loader-only mode); None = no cores-per-GPU answer."""
    gpus: int | None = bounded(None, 1, MAX_NPROC_PER_NODE)
    """GPUs per node sharing this machine's usable cores; None = the CUDA devices here (1 when there are none)."""
    trainer_cores: int = bounded(1, 0, MAX_WORKERS)
    """Cores each training process keeps for itself, on top of its loader's."""

    def __post_init__(self) -> None:
        check_bounds(self)
        check_device(self.device)
        if self.measure_batches is not None:
            mb = self.measure_batches
            if len(mb) != 2 or not all(isinstance(b, int) and 2 <= b <= MAX_BATCH_SIZE for b in mb) or mb[0] >= mb[1]:
                raise ConfigError(f"measure_batches must be two batch sizes, smaller first, within 2..{MAX_BATCH_SIZE} "
                                  f"(BatchNorm trains on 2 samples or more), got {show_value(mb)}")
        if self.check_batch == 1:
            raise ConfigError("check_batch must be 0 (no check) or at least 2 (BatchNorm trains on 2 samples or more)")
        if self.measure_batches is not None and self.check_batch in self.measure_batches:
            raise ConfigError(f"check_batch {self.check_batch} is one of measure_batches "
                              f"{show_value(self.measure_batches)}: the check must measure a third batch size, or its "
                              f"error says nothing")
        if self.target_rate is not None and self.record is None:
            raise ConfigError("target_rate needs record (a gpufeed tune or train summary.json that measured the "
                              "loader's samples/s per core)")


STEPS = ("doctor", "synth", "shard", "verify", "io", "stage", "ceiling", "tune", "measure", "train")
"""The steps of ``gpufeed run``, in the order they run (docs/design.md §8)."""

DEFAULT_STEPS = ("doctor", "shard", "verify", "io", "ceiling", "tune", "measure")
"""``[run] steps`` when the file does not give it; the loader adds "train" when ``[train]`` sets epochs or steps."""


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """gpufeed run: which steps run (always in pipeline order) and where the run folder is. The other sections
    configure their steps ([shard.val]: the validation set); run fills in the paths that pass from step to step
    (the set, the staged copy, the tuned [loader], the compute ceiling), and each step's run_dir/out, which are the
    run folder's."""

    dir: str | None = None
    """Run folder: one sub-folder per step, run.json, report.html and report.md; a re-run into it skips the
    steps already done with the same options and inputs. None = runs/NAME, NAME the config file's name without
    .toml."""
    steps: tuple[Literal["doctor", "synth", "shard", "verify", "io", "stage", "ceiling", "tune", "measure",
                         "train"], ...] = DEFAULT_STEPS
    """Steps to run, in this order whatever the list's: doctor, synth ([synth] images into shard's src), shard
    (+ [shard.val], the validation set), verify, io, stage ([stage] dest, used by every later step), ceiling
    (train --synthetic: the compute ceiling, tune's target_rate), tune, measure (train --measure, with --fix when
    train has it) and train (the full [train] epochs/steps with the tuned [loader]). Left out of the file: these
    defaults, plus train when the file's [train] sets epochs or steps; a steps list in the file is run as given."""

    def __post_init__(self) -> None:
        if not self.steps:
            raise ConfigError("steps must name at least one step")
        if len(set(self.steps)) != len(self.steps):
            raise ConfigError(f"steps names a step twice: {show_value(self.steps)}")


SECTIONS: dict[str, type] = {
    "shard": ShardConfig,
    "loader": LoaderConfig,
    "tune": TuneConfig,
    "train": TrainConfig,
    "synth": SynthConfig,
    "layout": LayoutConfig,
    "io": IoConfig,
    "stage": StageConfig,
    "plan": PlanConfig,
    "run": RunConfig,
}


@dataclass(frozen=True, kw_only=True)
class Config:
    """All sections of a configuration file, each resolved."""

    shard: ShardConfig = field(default_factory=ShardConfig)
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    tune: TuneConfig = field(default_factory=TuneConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    synth: SynthConfig = field(default_factory=SynthConfig)
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    io: IoConfig = field(default_factory=IoConfig)
    stage: StageConfig = field(default_factory=StageConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    run: RunConfig = field(default_factory=RunConfig)
    shard_val: ShardConfig | None = None
    """[shard.val] (gpufeed run): the validation set the shard step writes beside [shard]'s, with [shard]'s
    options but prefix "val", each key the sub-table gives overriding; src is required, dest None = the run
    folder's shard/val/. None = no validation set to shard (train may still read [train] val_shards)."""

    def tune_for_training(self) -> TuneConfig:
        """[tune] with nproc_per_node and model_threads None resolved to [train] nproc_per_node and threads: the
        layout training will run, and the torch threads its step gets."""
        return dataclasses.replace(
            self.tune, nproc_per_node=self.tune.nproc_per_node if self.tune.nproc_per_node is not None
            else self.train.nproc_per_node,
            model_threads=self.tune.model_threads if self.tune.model_threads is not None else self.train.threads)
