"""Flower's simulation engine (Ray) running a federated program on one machine: :func:`simulate`.

With :mod:`federation.flower.adapter` (whose apps it runs), the only module of the project that imports
``flwr``. Ray is started here, not by Flower, so that SIGINT and SIGTERM stop a simulation within
seconds as a run stopped on request (:class:`SimulationStop`); Ray's processes carry a marker by
which the watchdog of :mod:`federation.runtime.processes` ends whatever they leave behind.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path

from federation.flower.adapter import build_client_app, build_server_app
from federation.runtime.contract import RUN_CONFIG_DEFAULTS, Scalar, institutions, program_of
from federation.runtime.processes import PROCESS_GROUP_ENV, kill_marked, start_watchdog
from geofm.errors import ConfigError, RunInterrupted

log = logging.getLogger("geofm.fl")

SIMULATION_MARKER = "GEOFM_SIMULATION"
"""Environment variable marking a simulation's Ray processes (see :mod:`federation.runtime.processes`)."""
WORKER_MARKER = "GEOFM_SIMULATION_WORKER"
"""Environment variable marking a simulation's Ray workers alone, which run its ClientApps."""
COLOUR_PREFIX = "RAY_COLOR_PREFIX"
"""Ray's switch for the colours of the ``(pid=...)`` prefix of its workers' lines; ``0`` here also keeps
Flower's level colours out of a simulation's log (see :func:`_setup_ray_worker`)."""


class _DropFlowerNotices(logging.Filter):
    """Drops Flower's notices that tell a user nothing: the deprecation of ``run_simulation``, logged on every
    call (why it is used: :func:`simulate`), and the ``Manually terminating ClientAppActor`` of each Ray
    actor at the end of every simulation; with ``stop``, every record once a stop signal came (the
    engine's errors about the Ray workers the signal ended)."""

    NOTICES = ("`run_simulation` function is deprecated", "Manually terminating ClientAppActor")

    def __init__(self, stop: SimulationStop | None = None) -> None:
        super().__init__()
        self.stop = stop

    def filter(self, record: logging.LogRecord) -> bool:
        if self.stop is not None and self.stop.requested:
            return False
        message = record.getMessage()
        return not any(notice in message for notice in self.NOTICES)


def _colour() -> bool:
    """Whether a simulation's log lines may carry colour codes: only when they go to a terminal."""
    return os.environ.get(COLOUR_PREFIX) != "0"


def _setup_ray_worker() -> None:
    """Run by each of a simulation's Ray workers as it starts: Flower's log there (which Ray copies into
    the simulation's) drops the same notices, and has colours only on a terminal."""
    from flwr.common.logger import update_console_handler

    logging.getLogger("flwr").addFilter(_DropFlowerNotices())
    update_console_handler(colored=_colour())


@contextlib.contextmanager
def _quiet_simulation(stop: SimulationStop, verbose: bool) -> Iterator[None]:
    """Flower's console handler stays the only printer of Flower's records (no copies, no DEBUG lines through
    a root handler a command line set up), at DEBUG with timestamps when ``verbose``, without colours
    unless on a terminal; Flower's notices that tell nothing, its errors about the Ray workers a stop
    ended, SQL migration notes of its in-memory state and Ray's accelerator FutureWarning are dropped;
    everything is restored afterwards."""
    from flwr.common.logger import console_handler

    flower = logging.getLogger("flwr")
    alembic = logging.getLogger("alembic")
    notices = _DropFlowerNotices(stop)
    propagate, alembic_level = flower.propagate, alembic.level
    level, timestamps, colored = console_handler.level, console_handler.timestamps, console_handler.colored
    flower.addFilter(notices)
    flower.propagate = False
    alembic.setLevel(logging.WARNING)
    if verbose:
        console_handler.setLevel(logging.DEBUG)
        console_handler.timestamps = True
    console_handler.colored = _colour()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Tip: In future versions of Ray", category=FutureWarning)
            yield
    finally:
        flower.removeFilter(notices)
        flower.propagate = propagate
        alembic.setLevel(alembic_level)
        console_handler.setLevel(level)
        console_handler.timestamps, console_handler.colored = timestamps, colored


@contextlib.contextmanager
def _environment(values: Mapping[str, str], removed: tuple[str, ...]) -> Iterator[None]:
    """This process's environment, which Ray's processes inherit, with ``values`` set and ``removed`` left out;
    restored afterwards."""
    saved = {key: os.environ.get(key) for key in [*values, *removed]}
    for key in removed:
        os.environ.pop(key, None)
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class SimulationStop:
    """SIGINT and SIGTERM end a simulation within seconds, as a run stopped on request.

    The first signal ends the Ray workers running the ClientApps (those carrying ``marker=token``),
    and the server's transport raises :class:`~geofm.errors.RunInterrupted` at its next look for
    nodes or replies, which the round loop completes with the last round done. The server keeps it in
    :attr:`interrupted` and ends as a finished server does, so that Flower's engine ends at once (after
    an error of the server it waits 3 s for the server's context), and :func:`simulate` raises it
    then. That round's checkpoint and the clients' states are on disk: rerunning the same command
    resumes. A second signal ends the process at once (the watchdog
    then ends Ray's processes). Only the main thread handles signals; elsewhere they keep their handlers.
    """

    def __init__(self, marker: str, token: str) -> None:
        self.marker, self.token = marker, token
        self.received: int | None = None
        self.interrupted: RunInterrupted | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        """Handle the stop signals from now on (again once Ray started: it replaces the SIGTERM handler)."""
        if self.received is None and threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous.setdefault(sig, signal.signal(sig, self._handle))

    def restore(self) -> None:
        """Give the signals their handlers from before :meth:`install`."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        import ray

        self.received = signum
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        # Ray then reports each worker ended mid-task as "died ... by an unexpected system error": not copied here.
        ray._private.worker._worker_logs_enabled = False
        kill_marked(self.marker, self.token)

    @property
    def requested(self) -> bool:
        return self.received is not None

    def check(self) -> None:
        """Raise once a stop signal came (:func:`~federation.runtime.roundloop.run_server` adds the last round done).

        Raises:
            RunInterrupted: naming the signal.
        """
        if self.received is not None:
            raise RunInterrupted(f"stopped by {signal.Signals(self.received).name}")


def _start_ray(init_args: Mapping[str, object], num_nodes: int, cpus_per_node: float, token: str) -> None:
    """Start Ray for Flower's simulation engine, which then uses it as it is.

    Started here rather than by Flower so that :func:`simulate` can take SIGTERM back from Ray, which
    installs its own handler. Ray's workers get this process's ``sys.path`` (where a test or a script
    may have registered programs), as Flower's own start gives them, run :func:`_setup_ray_worker`, and
    carry :data:`WORKER_MARKER` set to ``token``.
    """
    import ray

    at_once = max(1, min(num_nodes, int(init_args["num_cpus"] // cpus_per_node))) if cpus_per_node else num_nodes
    log.info(
        "starting Ray: %d cores, %d simulated nodes, up to %d ClientApps at once (--cpus-per-node %g)",
        init_args["num_cpus"],
        num_nodes,
        at_once,
        cpus_per_node,
    )
    started = time.perf_counter()
    pythonpath = os.pathsep.join([*sys.path, *filter(None, [os.environ.get("PYTHONPATH")])])
    runtime_env = {
        "env_vars": {"PYTHONPATH": pythonpath, WORKER_MARKER: token},
        "worker_process_setup_hook": f"{__name__}._setup_ray_worker",
    }
    ray.init(runtime_env=runtime_env, **init_args)
    log.info("Ray started in %.1f s; building the server, then %d clients", time.perf_counter() - started, num_nodes)


def simulate(
    run_config: Mapping[str, Scalar],
    num_nodes: int | None = None,
    *,
    cpus_per_node: float = 1.0,
    gpus_per_node: float = 0.0,
    num_cpus: int | None = None,
    verbose: bool = False,
) -> None:
    """Run a federated program on this machine: one ServerApp and ``num_nodes`` simulated SuperNodes.

    Uses ``flwr.simulation.run_simulation`` in this process (Flower's simulation engine on Ray),
    not ``flwr run``: the latter starts a detached local SuperLink on a fixed port that outlives
    the command and reports a failed ServerApp only through its run status, while here an error
    raised by the server program is raised by this function. Node ``i`` is the institution at
    position ``i`` of the ``institutions`` run-config entry. SIGINT and SIGTERM stop it within
    seconds (see :class:`SimulationStop`).

    Args:
        run_config: the run config (see :mod:`federation.runtime.contract`); keys left out take
            their defaults.
        num_nodes: simulated SuperNodes; default: one per name in ``institutions``.
        cpus_per_node: CPU cores Ray reserves per running ClientApp (how many run at once).
        gpus_per_node: GPU share per running ClientApp.
        num_cpus: cores Ray may use in all (default: all of this machine's).
        verbose: Flower's and Ray's debug logs.

    Raises:
        ConfigError: the run config or node count is invalid.
        RunInterrupted: SIGINT or SIGTERM stopped the run.
        Exception: whatever the server program raised, e.g. FederatedRunError.
    """
    config = {**RUN_CONFIG_DEFAULTS, **run_config}
    program_of(config)
    unknown = sorted(set(config) - set(RUN_CONFIG_DEFAULTS))
    if unknown:
        raise ConfigError(f"run config: unknown keys {unknown}; expected some of {sorted(RUN_CONFIG_DEFAULTS)}")
    names = institutions(config)
    if num_nodes is None:
        num_nodes = len(names)
    if num_nodes < 1 or (names and len(names) != num_nodes):
        raise ConfigError(f"simulation: {num_nodes} nodes for institutions {names}; give one node per institution")
    import ray

    ray_dir = Path(tempfile.mkdtemp(prefix="geofm-ray-"))
    init_args = {
        "num_cpus": num_cpus or os.cpu_count() or 1,
        "include_dashboard": False,
        "logging_level": logging.DEBUG if verbose else logging.ERROR,
        "_temp_dir": str(ray_dir),
    }
    backend_config = {"client_resources": {"num_cpus": cpus_per_node, "num_gpus": gpus_per_node}}
    # Ray's processes inherit this marker: whichever way this process ends, kill -9 included, the
    # watchdog then ends what Ray left (its agents outlive their raylet by minutes) and removes its folder.
    # Nor do they get the process group this process may have joined; colours only on a terminal.
    token = uuid.uuid4().hex
    environment = {SIMULATION_MARKER: token, **({} if sys.stderr.isatty() else {COLOUR_PREFIX: "0"})}
    stop = SimulationStop(WORKER_MARKER, token)
    with _environment(environment, PROCESS_GROUP_ENV), _quiet_simulation(stop, verbose):
        watchdog = start_watchdog(os.getpid(), SIMULATION_MARKER, token, remove=ray_dir)
        try:
            stop.install()
            _start_ray(init_args, num_nodes, cpus_per_node, token)
            stop.install()
            # Imported here: deployed ServerApp and ClientApp processes never need the simulation engine (a
            # second or more of imports), and importing it logs the SQL migration notes dropped here.
            from flwr.simulation import run_simulation

            run_simulation(
                build_server_app(config, stop),
                build_client_app(config),
                num_supernodes=num_nodes,
                backend_config=backend_config,
                verbose_logging=False,  # _quiet_simulation shows Flower's DEBUG lines without forcing colours
            )
            if stop.interrupted is not None:
                raise stop.interrupted
        finally:
            stop.restore()
            ray.shutdown()
            ray._private.worker._worker_logs_enabled = True
            kill_marked(SIMULATION_MARKER, token, exclude={os.getpid()})
            shutil.rmtree(ray_dir, ignore_errors=True)
            watchdog.kill()
            watchdog.wait()


__all__ = ["COLOUR_PREFIX", "SIMULATION_MARKER", "WORKER_MARKER", "SimulationStop", "simulate"]
