"""``gpufeed plan``: will a ResNet training step fit in GPU memory, and how many cores per GPU must its loader have?

Memory is measured, not computed from formulas. The model is built as ``gpufeed train`` builds it (torchvision
ResNet, ``zero_init_residual``, channels_last when asked) with train's optimizer (SGD, momentum, no weight decay on
biases and BatchNorm) or AdamW, and real training steps run - uint8 batch, normalise, forward under autocast,
label-smoothed cross-entropy, backward, optimizer step - at two small batch sizes. Each step's peak is:

- on a GPU: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` (every tensor of the process
  on that device, workspaces the caching allocator hands out included; not the CUDA context), over the second
  step at that batch size: cuDNN autotuning (``cudnn.benchmark``, on as in train) tries workspaces on the first;
- on the CPU, where torch keeps no peak counter: the model and optimizer state (the sum of their tensors' bytes)
  plus the highest point, over the step, of the running sum of the allocation and free events that
  ``torch.profiler`` records with ``profile_memory=True`` (every block torch's CPU allocator hands out; scratch
  memory a library such as oneDNN takes from malloc itself is not seen).

Gradients are set to None before each measured step (as train's ``zero_grad(set_to_none=True)``), so they are
part of the step's peak. Activations are the bytes of the distinct tensor storages autograd saves for backward
(``torch.autograd.graph.saved_tensors_hooks``), parameters left out. Weights (parameters and buffers), gradients
and optimizer state are the bytes of the real tensors after a step. The peak and the activations are modelled as
linear in the batch size through the two measurements - the estimate is the higher of the peak's line and the
floor line weights + optimizer state + activations - then checked against a third measured step.

Cores: a tune or train summary.json gives the loader's samples/s per busy core; the target rate over it is the
loader cores one GPU needs, compared with this machine's usable cores per GPU (:func:`gpufeed.core.system.usable_cpus`).

``plan`` returns a :class:`PlanReport` (``ok`` false, exit 1, when the batch does not fit the memory or the cores
per GPU are too few); :func:`render` turns it into text.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from gpufeed.config import MAX_BATCH_SIZE, PlanConfig
from gpufeed.core.errors import ConfigError, DataError

MAX_RECORD_BYTES = 64 << 20
"""Largest tune/train summary.json read (a tune summary with thousands of trials is a few MiB)."""
CPU_MIN_MEASURE_BATCH = 2
GPU_MIN_MEASURE_BATCH = 16
CPU_METHOD = ("cpu: model and optimizer state (tensor bytes) + the peak of the running sum of torch.profiler "
              "memory events (profile_memory=True, torch's CPU allocator) over one real step; oneDNN's own "
              "scratch memory is not seen")
GPU_METHOD = ("cuda: torch.cuda.max_memory_allocated over one real step after reset_peak_memory_stats, the "
              "second at its batch size (cuDNN autotune's first-step trial workspaces and the CUDA context not "
              "included)")
ACTIVATION_METHOD = "activations: distinct storages autograd saves for backward (saved_tensors_hooks), parameters excluded"


@dataclass(frozen=True)
class StepMeasurement:
    """One measured training step."""

    batch_size: int
    peak_bytes: int
    """Peak bytes during the step, model and optimizer state included."""
    activation_bytes: int
    """Bytes autograd saved for backward (distinct storages, parameters excluded)."""
    seconds: float


@dataclass(frozen=True)
class MemoryParts:
    """Peak training memory at one batch size, split into its parts."""

    batch_size: int
    weights_bytes: int
    """Parameters and buffers (BatchNorm running statistics)."""
    gradients_bytes: int
    optimizer_state_bytes: int
    activations_bytes: int
    other_bytes: int
    """peak - the four parts above: the input batch, temporaries, workspaces. Negative when the parts are never all
    live at once (activations are freed while gradients are made)."""
    peak_bytes: int


@dataclass(frozen=True)
class CoresPlan:
    """Loader cores one GPU needs against the cores per GPU this machine has."""

    target_rate: float
    """Samples/s one GPU consumes."""
    target_source: str
    samples_per_core_s: float
    """The loader's measured samples/s per busy core."""
    rate_source: str
    loader_cores_per_gpu: float
    trainer_cores: int
    usable_cores: int
    gpus: int
    usable_cores_per_gpu: float
    enough: bool


@dataclass(frozen=True)
class PlanReport:
    """What ``gpufeed plan`` returns (``--json`` prints it)."""

    ok: bool
    arch: str
    num_classes: int
    batch_size: int
    image_size: int
    amp: str
    channels_last: bool
    optimizer: str
    device: str
    device_name: str
    method: str
    activation_method: str
    measurements: list[StepMeasurement]
    fixed_bytes: float
    """Intercept of the line through the two measured peaks: fixed_bytes + per_sample_bytes x b."""
    per_sample_bytes: float
    activation_fixed_bytes: float
    activation_per_sample_bytes: float
    floor_fixed_bytes: float
    """weights + optimizer state + activation_fixed_bytes: with floor_per_sample_bytes (= the activations' slope)
    the floor line, the bytes live at the end of the forward pass. The estimated peak is the higher of the two
    lines (measured at small batches where the gradients set the peak, the first line is too flat)."""
    floor_per_sample_bytes: float
    estimate: MemoryParts
    """The parts at batch_size, from the linear model."""
    check: StepMeasurement | None
    check_estimate_bytes: int | None
    check_error_pct: float | None
    """(estimate - measured) / measured x 100 at the check batch."""
    gpu_memory_bytes: int | None
    gpu_memory_source: str | None
    headroom: float
    usable_memory_bytes: int | None
    """gpu_memory x (1 - headroom)."""
    max_batch_size: int | None
    """Largest batch whose estimated peak fits the usable memory (0: not even 1)."""
    fits: bool | None
    cores: CoresPlan | None
    elapsed_s: float
    notes: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- measuring


def tensor_bytes(tensors: Any) -> int:
    """Bytes of the tensors in ``tensors`` (an iterable, nested in dicts/lists, non-tensors ignored)."""
    import torch

    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    if isinstance(tensors, dict):
        return sum(tensor_bytes(v) for v in tensors.values())
    if isinstance(tensors, (list, tuple)) or hasattr(tensors, "__next__"):
        return sum(tensor_bytes(v) for v in tensors)
    return 0


class Stepper:
    """A model, optimizer and AMP set-up as ``gpufeed train`` has them, stepping on synthetic batches."""

    def __init__(self, cfg: PlanConfig, device: Any, amp: str) -> None:
        import torch

        from gpufeed.model import Amp, build_model, build_optimizer

        torch.manual_seed(0)
        self.device, self.channels_last = device, cfg.channels_last
        if device.type == "cuda":
            torch.cuda.set_device(device)
            torch.backends.cudnn.benchmark = True  # as gpufeed train
        self.num_classes, self.image_size = cfg.num_classes, cfg.image_size
        module = build_model(cfg.arch, cfg.num_classes, device, channels_last=cfg.channels_last)
        self.model = module
        self.optimizer = build_optimizer(module, name=cfg.optimizer, lr=0.1 if cfg.optimizer == "sgd" else 1e-3,
                                         momentum=0.9, weight_decay=1e-4)
        self.criterion = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
        # fp16: train's GradScaler starts at 2**16 and skips the first steps (inf gradients), which would leave the
        # optimizer state unmade after the warm-up; memory does not depend on the scale, so start at 1
        self.amp = Amp.build(amp, device, init_scale=1.0)
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in module.parameters()}

    def step(self, batch_size: int) -> int:
        """One training step on a fresh random uint8 batch; -> bytes autograd saved for backward."""
        import torch

        from gpufeed.loader import normalize

        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            try:
                st = t.untyped_storage()
                key, size = st.data_ptr(), st.nbytes()
            except (RuntimeError, NotImplementedError):  # a tensor without storage (opaque): its own bytes
                key, size = id(t), t.numel() * t.element_size()
            if key not in self.param_ptrs:
                saved[key] = max(saved.get(key, 0), size)
            return t

        x = torch.randint(0, 256, (batch_size, 3, self.image_size, self.image_size), dtype=torch.uint8,
                          device=self.device)
        y = torch.randint(0, self.num_classes, (batch_size,), device=self.device)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            inputs = normalize(x, dtype=torch.float32, channels_last=self.channels_last)
            with self.amp.autocast():
                out = self.model(inputs)
                loss = self.criterion(out.float(), y)
        del inputs, out
        self.amp.scaler.scale(loss).backward()
        del loss
        self.amp.scaler.step(self.optimizer)
        self.amp.scaler.update()
        return sum(saved.values())

    def state_bytes(self) -> tuple[int, int, int]:
        """(weights: parameters + buffers, gradients, optimizer state) in bytes of the real tensors."""
        m = self.model
        weights = tensor_bytes(m.parameters()) + tensor_bytes(m.buffers())
        grads = tensor_bytes(p.grad for p in m.parameters() if p.grad is not None)
        return weights, grads, tensor_bytes(list(self.optimizer.state.values()))

    def measure(self, batch_size: int) -> StepMeasurement:
        """Peak bytes of one real step at ``batch_size`` (gradients set to None first, as train does)."""
        import torch

        self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            self.step(batch_size)  # cuDNN autotunes each new shape on its first step (its trial workspaces)
            self.optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            activations = self.step(batch_size)
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            weights, _, opt_state = self.state_bytes()  # gradients are None here
            with _profiled_cpu_allocations() as events:
                activations = self.step(batch_size)
            peak = weights + opt_state + _peak_of(events)
        return StepMeasurement(batch_size=batch_size, peak_bytes=int(peak), activation_bytes=activations,
                               seconds=time.perf_counter() - t0)


@contextlib.contextmanager
def _profiled_cpu_allocations() -> Iterator[list[tuple[int, int]]]:
    """Record torch's CPU allocator events inside the block: yields a list that, after the block, holds
    (time ns, +bytes allocated / -bytes freed) per event. The profiler's own start/stop lines, which its C++ side
    prints on file descriptor 2, are dropped."""
    from torch.profiler import ProfilerActivity, profile

    events: list[tuple[int, int]] = []
    with _quiet_fd2():
        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        prof.start()
    try:
        yield events
    finally:
        with _quiet_fd2():
            prof.stop()
        events.extend((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                      if e.name() == "[memory]")


def _peak_of(events: list[tuple[int, int]]) -> int:
    """Highest running sum of (time, signed bytes) events in time order: the peak of bytes allocated in the window
    over what was live at its start (frees of blocks allocated before any profiling are not reported, so this
    errs high, never low)."""
    live = peak = 0
    for _, nbytes in sorted(events, key=lambda e: e[0]):
        live += nbytes
        peak = max(peak, live)
    return peak


@contextlib.contextmanager
def _quiet_fd2() -> Iterator[None]:
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as sink:
            os.dup2(sink.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(saved, 2)
    finally:
        os.close(saved)


# --------------------------------------------------------------------------- the linear model


def min_measure_batch(device_type: str) -> int:
    return GPU_MIN_MEASURE_BATCH if device_type == "cuda" else CPU_MIN_MEASURE_BATCH


def peak_estimate(fixed: float, per_sample: float, floor_fixed: float, floor_per_sample: float, b: int) -> int:
    """The estimated peak at batch ``b``: the higher of the line through the measured peaks and the floor line
    (weights + optimizer state + activations), so a measured line that is nearly flat - where the gradients, not
    the activations, set the measured peaks - never estimates below what the forward pass must hold."""
    return int(round(max(fixed + per_sample * b, floor_fixed + floor_per_sample * b)))


def default_measure_batches(device_type: str, gradient_bytes: int, activation_bytes_per_sample: float
                            ) -> tuple[int, int]:
    """(b1, 2 b1): b1 the smallest power of two, at least the device's minimum, whose activations are twice the
    gradients. Below that the step's peak comes when the gradients are made (weights, optimizer state and all the
    gradients live), which does not grow with the batch, and a line through two such batches underestimates the
    peak of a large one."""
    b1 = min_measure_batch(device_type)
    if activation_bytes_per_sample > 0:
        while b1 < MAX_BATCH_SIZE // 4 and b1 * activation_bytes_per_sample < 2 * gradient_bytes:
            b1 *= 2
    return b1, 2 * b1


def linear(p1: tuple[int, float], p2: tuple[int, float]) -> tuple[float, float]:
    """(intercept, slope) of the line through two (batch, bytes) points."""
    (b1, y1), (b2, y2) = p1, p2
    slope = (y2 - y1) / (b2 - b1)
    return y1 - slope * b1, slope


def max_fitting_batch(fixed: float, per_sample: float, usable: float) -> int:
    """Largest b (<= MAX_BATCH_SIZE) with fixed + per_sample x b <= usable; 0 when not even b = 1 fits."""
    if fixed + per_sample > usable:
        return 0
    if per_sample <= 0:
        return MAX_BATCH_SIZE
    b = min(MAX_BATCH_SIZE, int((usable - fixed) // per_sample))
    while b > 0 and fixed + per_sample * b > usable:  # float rounding at the boundary
        b -= 1
    return b


# --------------------------------------------------------------------------- cores


MIN_MEASURED = 1e-6
"""The smallest rate (samples/s, per core or not) or core count a record may hold: anything smaller (a denormal
such as 5e-324 included) is not a measurement, and dividing by it would ask for infinitely many cores."""


def _number(value: Any, lo: float = 0.0, hi: float = 1e12) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value) if lo < value <= hi else None


def _measured(d: dict, key: str, path: str) -> float | None:
    """``d[key]``, a rate or core count measured by a run: None when absent or not a number; a DataError in one
    sentence when it is a number but not a measurement (below :data:`MIN_MEASURED`, over 1e12, inf or NaN)."""
    value = d.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if not (math.isfinite(value) and MIN_MEASURED <= value <= 1e12):
        raise DataError(f"{path}: {key} is {value:g}, not a measured rate (a number from {MIN_MEASURED:g} to 1e12)")
    return float(value)


def _per_core(value: float, path: str) -> float:
    """A per-core rate computed from a record's numbers, bounded as the record's own numbers are (a core count
    of 1e-300 would make it infinite)."""
    if _number(value) is None:
        raise DataError(f"{path}: the loader's samples/s per core ({value:g}) is not a positive rate up to 1e12")
    return value


def loader_rates(path: str) -> tuple[float, str, float | None, str | None]:
    """From a tune or train summary.json: (loader samples/s per busy core, where from, the GPU's samples/s per
    rank or None, where from). A DataError in one sentence when the file holds neither."""
    from gpufeed.core.records import read_json_file

    data = read_json_file(path, MAX_RECORD_BYTES, "a gpufeed tune or train summary.json")
    if not isinstance(data, dict):
        raise DataError(f"{path} is not a gpufeed tune or train summary.json (not a JSON object)")
    if isinstance(data.get("modes"), dict):  # train
        modes = data["modes"]
        lonly = modes.get("loader-only") if isinstance(modes.get("loader-only"), dict) else {}
        rate, cores = _measured(lonly, "samples_per_s", path), _measured(lonly, "loader_cores_used", path)
        if rate is None or cores is None:
            raise DataError(f"{path} holds no loader-only samples/s and cores used (run gpufeed train --mode "
                            "measure to record them)")
        per_core = _per_core(rate / cores, path)
        synth = modes.get("synthetic") if isinstance(modes.get("synthetic"), dict) else {}
        gpu_rate = _measured(synth, "samples_per_s", path)
        ranks = data.get("world_size")
        ranks = ranks if isinstance(ranks, int) and not isinstance(ranks, bool) and 1 <= ranks <= 1 << 20 else 1
        where = f"{path} (train loader-only: {rate:.1f} samples/s on {cores:.2f} cores)"
        if gpu_rate is None:
            return per_core, where, None, None
        return per_core, where, gpu_rate / ranks, f"{path} (train synthetic: {gpu_rate:.1f} samples/s / {ranks} rank(s))"
    trials, best = data.get("trials"), data.get("best_trial")
    if isinstance(trials, list) and "best_trial" in data:
        if not trials and best is not None:  # gpufeed tune keeps its trials in trials.jsonl beside summary.json
            trials = _tune_trials(Path(path).parent / "trials.jsonl")
        valid = isinstance(best, int) and not isinstance(best, bool) and 0 <= best < 1 << 31
        trial = next((t for t in trials if valid and isinstance(t, dict) and t.get("trial") == best), None)
        if trial is None:
            raise DataError(f"{path} is a tune summary without a successful best trial")
        per_core = _measured(trial, "samples_per_core_s", path)
        if per_core is None:
            rate, cores = _measured(trial, "samples_per_s", path), _measured(trial, "tree_cores_used", path)
            if rate is None or cores is None:
                raise DataError(f"{path}: the best tune trial recorded no samples/s per core")
            per_core = _per_core(rate / cores, path)
        workers = _number(trial.get("num_workers"), -1, 1 << 20)
        return per_core, f"{path} (tune best trial {best}, {workers or 0:g} workers)", None, None
    raise DataError(f"{path} is neither a gpufeed tune nor a train summary.json (no 'modes', no 'trials')")


MAX_TRIALS = 100_000
"""Most trial lines read from a tune run's trials.jsonl."""


def _tune_trials(path: Path) -> list[Any]:
    """The trial records of a tune run folder's ``trials.jsonl`` (untrusted: a regular file of at most
    :data:`MAX_RECORD_BYTES`, UTF-8, at most :data:`MAX_TRIALS` lines, each a JSON value). DataError in one
    sentence when it is missing or not such a file."""
    import stat

    try:
        if not stat.S_ISREG(path.stat().st_mode):
            raise DataError(f"{path} is not a regular file, so not a tune run's trials")
        with open(path, "rb") as f:
            raw = f.read(MAX_RECORD_BYTES + 1)
    except OSError as exc:
        raise DataError(f"{path}: the tune run's trials cannot be read ({exc.strerror or exc}); give the "
                        f"summary.json of a complete gpufeed tune run folder") from None
    if len(raw) > MAX_RECORD_BYTES:
        raise DataError(f"{path} is over {MAX_RECORD_BYTES} bytes, more than a tune run's trials")
    try:
        lines = raw.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise DataError(f"{path} is not UTF-8, so not a tune run's trials.jsonl") from None
    if len(lines) > MAX_TRIALS:
        raise DataError(f"{path} holds over {MAX_TRIALS} lines, more than a tune run's trials")
    try:
        return [json.loads(line) for line in lines if line.strip()]
    except (ValueError, RecursionError) as exc:
        raise DataError(f"{path} is not a tune run's trials.jsonl ({str(exc).splitlines()[0][:80]})") from None


def plan_cores(cfg: PlanConfig, gpus: int) -> CoresPlan | None:
    """The cores-per-GPU answer, or None without a record."""
    if cfg.record is None:
        return None
    from gpufeed.core.system import usable_cpus

    per_core, rate_source, gpu_rate, gpu_source = loader_rates(cfg.record)
    if cfg.target_rate is not None:
        target, target_source = cfg.target_rate, "--target-rate"
    elif gpu_rate is not None:
        target, target_source = gpu_rate, gpu_source or ""
    else:
        raise DataError(f"{cfg.record} gives the loader's rate but no GPU rate: give --target-rate (samples/s one "
                        "GPU consumes)")
    usable = usable_cpus()
    per_gpu = usable / gpus
    need = target / per_core
    return CoresPlan(target_rate=target, target_source=target_source, samples_per_core_s=per_core,
                     rate_source=rate_source, loader_cores_per_gpu=need, trainer_cores=cfg.trainer_cores,
                     usable_cores=usable, gpus=gpus, usable_cores_per_gpu=per_gpu,
                     enough=need + cfg.trainer_cores <= per_gpu)


# --------------------------------------------------------------------------- the job


def plan(cfg: PlanConfig) -> PlanReport:
    """Measure, model, check, and answer both questions (see the module docstring)."""
    import torch

    from gpufeed.model import resolve_amp

    t0 = time.perf_counter()
    want = cfg.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want.startswith("cuda") and not torch.cuda.is_available():
        raise DataError(f"device {cfg.device} asked for, but torch sees no CUDA device")
    device = torch.device(want)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda" and device.index >= torch.cuda.device_count():
        raise DataError(f"device {cfg.device} asked for, but torch sees {torch.cuda.device_count()} CUDA device(s) "
                        f"(cuda:0..cuda:{torch.cuda.device_count() - 1})")
    amp, amp_note = resolve_amp(cfg.amp, device)
    notes = [amp_note] if amp_note else []
    gpus = cfg.gpus or (torch.cuda.device_count() if torch.cuda.is_available() else 1) or 1
    cores = plan_cores(cfg, gpus)  # reads the record first: a bad record fails before minutes of measuring

    stepper = Stepper(cfg, device, amp)
    warm_batch = min(cfg.measure_batches[0], min_measure_batch(device.type)) if cfg.measure_batches \
        else min_measure_batch(device.type)
    warm_activations = stepper.step(warm_batch)  # warm-up: optimizer state and gradients created
    weights, grads, opt_state = stepper.state_bytes()
    b1, b2 = cfg.measure_batches or default_measure_batches(device.type, grads, warm_activations / warm_batch)
    check_batch = 2 * b2 if cfg.check_batch is None else cfg.check_batch
    if check_batch in (b1, b2):  # the model goes through the measured points: an "error" there checks nothing
        raise ConfigError(f"check_batch {check_batch} is one of the measured batches {b1} and {b2}: give another "
                          f"(or 0 for no check)")
    m1, m2 = stepper.measure(b1), stepper.measure(b2)
    fixed, per_sample = linear((b1, m1.peak_bytes), (b2, m2.peak_bytes))
    a_fixed, a_per_sample = linear((b1, m1.activation_bytes), (b2, m2.activation_bytes))
    floor_fixed = weights + opt_state + a_fixed
    check = stepper.measure(check_batch) if check_batch else None

    def peak_at(b: int) -> int:
        return peak_estimate(fixed, per_sample, floor_fixed, a_per_sample, b)

    n = cfg.batch_size
    peak = peak_at(n)
    activations = int(round(a_fixed + a_per_sample * n))
    estimate = MemoryParts(batch_size=n, weights_bytes=weights, gradients_bytes=grads,
                           optimizer_state_bytes=opt_state, activations_bytes=activations,
                           other_bytes=peak - weights - grads - opt_state - activations, peak_bytes=peak)
    check_est = peak_at(check.batch_size) if check else None
    check_err = (check_est - check.peak_bytes) / check.peak_bytes * 100 if check and check_est is not None else None

    gpu_memory, source = cfg.gpu_memory, "--gpu-memory" if cfg.gpu_memory is not None else None
    if gpu_memory is None and device.type == "cuda":
        gpu_memory, source = torch.cuda.get_device_properties(device).total_memory, "the GPU's total memory"
    usable = max_b = fits = None
    if gpu_memory is not None:
        usable = int(gpu_memory * (1 - cfg.headroom))
        max_b = min(max_fitting_batch(fixed, per_sample, usable),
                    max_fitting_batch(floor_fixed, a_per_sample, usable))
        fits = peak <= usable
    if device.type == "cpu":
        notes.append("measured on the CPU: a GPU step adds cuDNN/cuBLAS workspaces and allocator rounding that CPU "
                     "kernels do not have; confirm on the GPU (gpufeed plan --device cuda)")
    if per_sample <= 0:
        notes.append("the peak did not grow with the batch size between the measured batches; measure larger "
                     "ones (--measure-batches)")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    ok = fits is not False and (cores is None or cores.enough)
    return PlanReport(
        ok=ok, arch=cfg.arch, num_classes=cfg.num_classes, batch_size=n, image_size=cfg.image_size, amp=amp,
        channels_last=cfg.channels_last, optimizer=cfg.optimizer, device=str(device), device_name=name,
        method=GPU_METHOD if device.type == "cuda" else CPU_METHOD, activation_method=ACTIVATION_METHOD,
        measurements=[m1, m2], fixed_bytes=fixed, per_sample_bytes=per_sample, activation_fixed_bytes=a_fixed,
        activation_per_sample_bytes=a_per_sample, floor_fixed_bytes=floor_fixed, floor_per_sample_bytes=a_per_sample,
        estimate=estimate, check=check, check_estimate_bytes=check_est,
        check_error_pct=check_err, gpu_memory_bytes=gpu_memory, gpu_memory_source=source, headroom=cfg.headroom,
        usable_memory_bytes=usable, max_batch_size=max_b, fits=fits, cores=cores,
        elapsed_s=time.perf_counter() - t0, notes=notes)


def _cpu_name() -> str:
    import platform

    from gpufeed.core.system import usable_cpus

    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f.read(1 << 20).splitlines():
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{name[:80]}, {usable_cpus()} usable cores"


# --------------------------------------------------------------------------- text


def _gib(n: float) -> str:
    if abs(n) >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    return f"{n / (1 << 20):.1f} MiB"


def render(r: PlanReport) -> str:
    est = r.estimate
    lines = [f"plan: {r.arch}, {r.num_classes} classes, batch {r.batch_size}, {r.image_size} px, amp {r.amp}"
             f"{', channels_last' if r.channels_last else ''}, {r.optimizer}",
             f"measured on {r.device} ({r.device_name}) in {r.elapsed_s:.1f} s",
             f"  peak: {r.method}", f"  {r.activation_method}"]
    for m in r.measurements:
        lines.append(f"  batch {m.batch_size}: peak {_gib(m.peak_bytes)}, activations {_gib(m.activation_bytes)} "
                     f"({m.seconds:.2f} s)")
    lines.append(f"  linear model: peak(b) = max({_gib(r.fixed_bytes)} + {_gib(r.per_sample_bytes)} x b, "
                 f"weights + optimizer state + activations = {_gib(r.floor_fixed_bytes)} + "
                 f"{_gib(r.floor_per_sample_bytes)} x b)")
    if r.check is not None and r.check_estimate_bytes is not None and r.check_error_pct is not None:
        lines.append(f"  check: estimate at batch {r.check.batch_size}: {_gib(r.check_estimate_bytes)}, measured "
                     f"{_gib(r.check.peak_bytes)}, error {r.check_error_pct:+.1f}%")
    lines += [f"estimate at batch {est.batch_size}:",
              f"  weights          {_gib(est.weights_bytes):>12}  (parameters + buffers)",
              f"  gradients        {_gib(est.gradients_bytes):>12}",
              f"  optimizer state  {_gib(est.optimizer_state_bytes):>12}  ({r.optimizer})",
              f"  activations      {_gib(est.activations_bytes):>12}  (saved for backward)",
              f"  workspace/other  {_gib(est.other_bytes):>12}  (peak minus the parts: input batch, temporaries"
              f"{'; negative: the parts are never all live at once' if est.other_bytes < 0 else ''})",
              f"  peak             {_gib(est.peak_bytes):>12}"]
    if r.gpu_memory_bytes is None or r.usable_memory_bytes is None:
        lines.append("memory: no GPU here and no --gpu-memory: fit not judged")
    else:
        verdict = "fits" if r.fits else "does NOT fit"
        lines.append(f"memory: {_gib(r.gpu_memory_bytes)} ({r.gpu_memory_source}) less {r.headroom:.0%} headroom "
                     f"(fragmentation, CUDA context, workspace spikes) = {_gib(r.usable_memory_bytes)}: batch "
                     f"{r.batch_size} {verdict}; the largest batch that fits is {r.max_batch_size}")
    c = r.cores
    if c is None:
        lines.append("cores: no --record (a tune or train summary.json): loader cores per GPU not judged")
    else:
        lines.append(f"cores: the loader does {c.samples_per_core_s:.1f} samples/s per core ({c.rate_source}); "
                     f"{c.target_rate:.1f} samples/s per GPU ({c.target_source}) needs {c.loader_cores_per_gpu:.2f} "
                     f"loader cores + {c.trainer_cores} trainer core(s) per GPU; this machine has "
                     f"{c.usable_cores_per_gpu:.2f} usable cores per GPU ({c.usable_cores} / {c.gpus} GPU(s)): "
                     f"{'enough' if c.enough else 'TOO FEW'}")
    lines += [f"note: {n}" for n in r.notes]
    return "\n".join(lines)
