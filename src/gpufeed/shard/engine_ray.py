"""``gpufeed shard --engine ray``: the job's worker pool as Ray tasks (docs/design.md §1, ``shard/``).

The scan, the plan and the finish stay in this process, exactly as with the local engine; every task the job
gives its pool (walking class folders, validation batches, the one pass's shards, whole shards to write) is a
Ray task instead of a local process's, through ``RayPool``, a :class:`concurrent.futures.Executor`. The job
bounds the tasks in flight as it bounds the local pool's (a few validation batches and one shard a CPU of the
cluster), and each shard is written and hashed whole by one task (``write_all(whole=True)``) and renamed into
place by this process once complete: the bytes are the local engine's. Workers read SRC and write DEST by the
same paths, so both must be on storage every node mounts at the same path, and gpufeed must be installed on
every node.

Ray retries a task whose worker or node dies (``MAX_RETRIES``) and one that raised an ``OSError`` (a storage
hiccup); a task that raised one of the job's errors (a file changed while sharding) is that error, as one
sentence; anything else is a ``RunError`` naming the task and the reason's first line. Tasks and their results travel through
Ray's own serialisation; they are the job's own records (plan columns, validation results), never data read
from files."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import threading
from typing import Any, Callable

from gpufeed.config import ShardConfig
from gpufeed.core.errors import ConfigError, GpufeedError, Interrupted, RunError, signal_name

MAX_RETRIES = 3
"""Tries Ray makes again of a task whose worker died or that raised an OSError."""

_remote: Any = None

LOCAL_GCS_RECONNECT_S = 30
"""``RAY_gcs_rpc_server_reconnect_timeout_s`` for a local instance started by ``shard --engine ray`` (Ray's default:
60): once the job's Ray is gone, its ``ray::DashboardAgent`` and ``ray::RuntimeEnvAgent`` wait this long for the dead
GCS before they exit. Not shorter: the same timeout ends the driver itself, silently with exit 1, when its GCS does
not answer for that long, which a busy 2-core machine can cause."""

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""Signals that stop a Ray job in one sentence, exit 128 + N (SIGINT stays Python's KeyboardInterrupt: "interrupted",
exit 130). ``ray.init`` replaces the driver's SIGTERM handler with its own (``sys.exit(15)``) and, unless
``RAY_DISABLE_FAILURE_SIGNAL_HANDLER`` is set, its core worker installs a C++ one that prints a stack dump and aborts
(exit 134): gpufeed sets that variable for its driver and puts its own handlers back once Ray has started."""


_ENV_ADDED: set[str] = set()
"""The ``RAY_*`` variables :func:`ray_pool` added to this process's environment, removed by :func:`_restore_env`."""


def _restore_env() -> None:
    """Take out of this process's environment what :func:`ray_pool` put in (once the job's Ray is shut down)."""
    while _ENV_ADDED:
        os.environ.pop(_ENV_ADDED.pop(), None)


def stop_message(signum: int) -> str:
    return (f"shard stopped by {signal_name(signum)}; Ray was shut down and the shards completed so far are kept (run "
            f"the same command again to resume)")


def _stop(signum: int, _frame: Any) -> None:
    """The driver's handler of :data:`STOP_SIGNALS` while a Ray job runs: the job unwinds (its pool's shutdown stops
    Ray) and the CLI exits 128 + ``signum`` with :func:`stop_message`."""
    raise Interrupted(stop_message(signum), signum)


def _handlers(handler: Any) -> None:
    """Set ``handler`` for :data:`STOP_SIGNALS` (or each signal's own, given a dict); nothing outside the main thread
    (where Python cannot set them)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in STOP_SIGNALS:
        previous = handler.get(sig) if isinstance(handler, dict) else handler
        signal.signal(sig, signal.SIG_DFL if previous is None else previous)


def _call(fn: Callable[..., Any], *args: Any) -> Any:
    """The Ray task: one call of the job's worker function."""
    return fn(*args)


def ray_pool(cfg: ShardConfig) -> tuple[int, RayPool]:
    """Join Ray (``cfg.ray_address``, else ``RAY_ADDRESS``, else a local instance with ``cfg.workers`` CPUs, or
    this machine's) -> (the cluster's CPUs, or ``cfg.workers`` when set: the tasks in flight; the pool)."""
    address = cfg.ray_address or os.environ.get("RAY_ADDRESS") or None
    # before `import ray`: Ray reads these into constants when imported, and its processes inherit them; the
    # process's environment is put back by the pool's shutdown (a library caller's later Ray is its own)
    wanted = {"RAY_DISABLE_FAILURE_SIGNAL_HANDLER": "1"}  # no stack dump and abort on SIGTERM
    if address is None:  # the instance is this job's: its agents give up on its GCS sooner than Ray's minute
        wanted["RAY_gcs_rpc_server_reconnect_timeout_s"] = str(LOCAL_GCS_RECONNECT_S)
    for name, value in wanted.items():
        if name not in os.environ:
            os.environ[name] = value
            _ENV_ADDED.add(name)
    try:
        import ray
    except ImportError:
        _restore_env()
        raise ConfigError("--engine ray needs Ray: pip install 'gpufeed[ray]'") from None
    started = False
    before = ({sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
              if threading.current_thread() is threading.main_thread() else {})  # the driver's, before Ray's
    if not ray.is_initialized():
        import logging

        kwargs: dict[str, Any] = {"address": address, "logging_level": logging.ERROR, "log_to_driver": False,
                                  "include_dashboard": False}
        if address is None and cfg.workers:
            kwargs["num_cpus"] = cfg.workers
        try:
            ray.init(**kwargs)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            _handlers(before)
            _restore_env()
            where = address or "a local Ray instance"
            raise ConfigError(f"Ray at {where} cannot be joined ({str(exc).splitlines()[0] if str(exc) else exc}); "
                              f"check --ray-address / RAY_ADDRESS and that `ray start` runs there") from None
        except SystemExit as exc:  # ray.init's own SIGTERM handler, during start-up: sys.exit(signum)
            ray.shutdown()
            _handlers(before)
            _restore_env()
            signum = exc.code if isinstance(exc.code, int) and 0 < exc.code < 65 else signal.SIGTERM
            raise Interrupted(stop_message(signum), signum) from None
        started = True
    _handlers(_stop)
    try:
        cpus = int(ray.cluster_resources().get("CPU", 1)) or 1
    except BaseException:
        RayPool(started, before).shutdown()
        raise
    return cfg.workers or cpus, RayPool(started, before)


class RayPool(cf.Executor):
    """``submit`` runs the function as a Ray task and returns a ``concurrent.futures.Future`` holding its result,
    or the job's own exception (Ray's wrapper removed), or a ``RunError`` once Ray gave up."""

    def __init__(self, started: bool, handlers: dict[int, Any] | None = None) -> None:
        import ray

        global _remote
        if _remote is None:
            _remote = ray.remote(_call)
        self._started = started
        self._handlers = handlers or {}
        """The driver's signal handlers before Ray's and the job's, put back by ``shutdown``."""
        self._refs: dict[Any, cf.Future] = {}

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> cf.Future:  # type: ignore[override]
        assert not kwargs, "the job's worker functions take positional arguments"
        ref = _remote.options(max_retries=MAX_RETRIES, retry_exceptions=[OSError]).remote(fn, *args)
        out: cf.Future = cf.Future()
        out.set_running_or_notify_cancel()
        self._refs[ref] = out
        name = getattr(fn, "__name__", "task")

        def done(inner: cf.Future) -> None:
            self._refs.pop(ref, None)
            try:
                out.set_result(inner.result())
            except BaseException as exc:  # noqa: BLE001 - translated below, then the job's to raise
                out.set_exception(task_error(exc, name))

        ref.future().add_done_callback(done)
        return out

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        import ray

        if cancel_futures:
            for ref in list(self._refs):
                try:
                    ray.cancel(ref, force=True)
                except Exception:  # noqa: BLE001 - already finished or gone
                    pass
        if self._handlers:
            _handlers(signal.SIG_IGN)  # a second SIGTERM does not cut Ray's shutdown short
        if self._started:
            ray.shutdown()
        _restore_env()
        if self._handlers:
            _handlers(self._handlers)
            self._handlers = {}


def task_error(exc: BaseException, name: str) -> BaseException:
    """A failed Ray task's error as the job raises it: the task's own exception when it raised one of the job's
    (GpufeedError, OSError: the job words them as one sentence), else a RunError naming the task and Ray's
    reason's first line."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, (GpufeedError, OSError)):
        return cause
    if cause is not None:  # the task raised: not retried (it would raise again)
        reason = str(cause).strip().splitlines()
        return RunError(f"a Ray task ({name}) raised {type(cause).__name__}{': ' + reason[0] if reason else ''}")
    reason = str(exc).strip().splitlines()
    return RunError(f"a Ray task ({name}) failed after {MAX_RETRIES} retries: {type(exc).__name__}"
                    f"{': ' + reason[0] if reason else ''}")
