"""The one place gpufeed reads NVML (nvidia-ml-py's ``pynvml``): opening a device, reading one sample of its
health fields, and decoding its clocks-event (throttle) reason bits. Used by :mod:`gpufeed.doctor`,
:mod:`gpufeed.measure.telemetry` and :mod:`gpufeed.measure.health`.

Every field is read on its own: a query the GPU, driver or nvidia-ml-py version does not support (the fan of an
SXM board raises ``NVMLError_NotSupported``) gives ``None`` for that field and never an exception.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

THROTTLE_BITS = {0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
                 0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
                 0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting"}
"""NVML's clocks-event (throttle) reason bits and their names; other bits are not decoded."""
BENIGN_THROTTLE = frozenset({"gpu_idle", "applications_clocks_setting", "sync_boost", "display_clock_setting"})
"""Reasons that do not mean the GPU was held back by heat or power."""
SLOWDOWN_LABELS = {"sw_power_cap": "power cap", "sw_thermal_slowdown": "SW thermal",
                   "hw_thermal_slowdown": "HW thermal", "hw_slowdown": "HW slowdown",
                   "hw_power_brake_slowdown": "HW power brake"}
"""The reasons that mean clocks were held back by heat, power or the board, with their short labels."""

HEALTH_FIELDS = ("util_pct", "mem_used_bytes", "power_w", "power_limit_w", "temp_c", "fan_pct", "sm_clock_mhz")
"""The numeric fields of :func:`read_health`, in record order."""


def decode_reasons(bits: Any) -> tuple[str, ...]:
    """The names of the set bits of an NVML clocks-event reason mask (in bit order); () for a non-integer."""
    if isinstance(bits, bool) or not isinstance(bits, int):
        return ()
    return tuple(name for bit, name in THROTTLE_BITS.items() if bits & bit)


def get(fn: Callable[[], Any]) -> Any:
    """``fn()``, or None when it raises (a query this GPU, driver or nvidia-ml-py does not support)."""
    try:
        return fn()
    except Exception:  # noqa: BLE001 - NVMLError_NotSupported and friends, or a function this version lacks
        return None


def read_reasons(n: Any, h: Any) -> int | None:
    """The clocks-event reason mask of handle ``h``: ``nvmlDeviceGetCurrentClocksEventReasons`` (nvidia-ml-py
    12.535+), else the older ``nvmlDeviceGetCurrentClocksThrottleReasons``; None when neither answers."""
    for name in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
        fn = getattr(n, name, None)
        if fn is not None:
            bits = get(lambda: fn(h))
            if isinstance(bits, int) and not isinstance(bits, bool):
                return bits
    return None


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _milli(x: Any) -> float | None:
    return None if (v := _num(x)) is None else v / 1000.0


def power_limit_w(n: Any, h: Any) -> float | None:
    """The power limit in force (enforced limit, else the management limit), in W; None when unknown."""
    return _milli(get(lambda: n.nvmlDeviceGetEnforcedPowerLimit(h))) or \
        _milli(get(lambda: n.nvmlDeviceGetPowerManagementLimit(h)))


def read_health(n: Any, h: Any) -> dict[str, Any]:
    """One sample of handle ``h``: :data:`HEALTH_FIELDS` (each a float or None) and ``reasons`` (the
    clocks-event mask, an int or None)."""
    return {
        "util_pct": _num(get(lambda: n.nvmlDeviceGetUtilizationRates(h).gpu)),
        "mem_used_bytes": _num(get(lambda: n.nvmlDeviceGetMemoryInfo(h).used)),
        "power_w": _milli(get(lambda: n.nvmlDeviceGetPowerUsage(h))),
        "power_limit_w": power_limit_w(n, h),
        "temp_c": _num(get(lambda: n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU))),
        "fan_pct": _num(get(lambda: n.nvmlDeviceGetFanSpeed(h))),
        "sm_clock_mhz": _num(get(lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM))),
        "reasons": read_reasons(n, h),
    }


def open_device(index: int, nvml: Any = None) -> tuple[Any, Any, str | None]:
    """(pynvml module, handle, None) for the GPU torch calls ``cuda:index``, or (None, None, error text) when
    there is no nvidia-ml-py, no driver or no such GPU. ``nvml`` replaces the ``pynvml`` module (tests)."""
    try:
        if nvml is None:
            import pynvml as nvml
        nvml.nvmlInit()
        handle = _handle_by_uuid(nvml, index) or nvml.nvmlDeviceGetHandleByIndex(index)
        return nvml, handle, None
    except Exception as exc:  # noqa: BLE001 - no driver, no GPU, no package
        return None, None, f"{type(exc).__name__}: {exc}".splitlines()[0]


def _handle_by_uuid(pynvml: Any, torch_index: int) -> Any:
    """NVML numbers GPUs in PCI order and ignores CUDA_VISIBLE_DEVICES; torch's index does not. Match by UUID."""
    torch = sys.modules.get("torch")  # only when the caller already uses torch (train); never import it here
    if torch is None:
        return None
    try:
        uuid = str(torch.cuda.get_device_properties(torch_index).uuid)
        return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    except Exception:  # older torch without .uuid, MIG devices, no CUDA: fall back to the index
        return None


def gpu_processes(n: Any, h: Any) -> list[tuple[int, int | None]]:
    """(pid, GPU memory bytes or None) of every compute and graphics process on handle ``h``; [] when NVML cannot
    tell (containers often hide other processes' pids)."""
    out: dict[int, int | None] = {}
    for name in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
        fn = getattr(n, name, None)
        procs = get(lambda: fn(h)) if fn is not None else None
        for p in procs or ():
            pid = getattr(p, "pid", None)
            if isinstance(pid, int):
                mem = getattr(p, "usedGpuMemory", None)
                out[pid] = int(mem) if isinstance(mem, int) else None
    return sorted(out.items())


def clock_slowdowns(bits: Any) -> tuple[str, ...]:
    """The reasons of a clocks-event mask that mean heat, power or the board held the clocks back."""
    return tuple(r for r in decode_reasons(bits) if r in SLOWDOWN_LABELS)
