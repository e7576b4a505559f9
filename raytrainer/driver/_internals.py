"""Every private Ray name (and internal convention) the driver side uses, and nothing else.

Each use says why raytrainer needs it, the versions it was checked on, and what happens
without it. tests/test_internals.py checks that each still exists, so an upgrade that
removes one fails there with the name and what it is for; tests/test_layout.py checks that
no other module of the package uses a private Ray or torch name. The driver imports no torch.

Checked on Ray 2.60.0 (pinned) and Ray 2.40.0 (the oldest pyproject.toml claims:
`bash .ci/oldest.sh`, with torch 2.7.0).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import time
from typing import Any, Callable, Iterator


def started_local_ray() -> bool:
    """Whether this process started the Ray it is connected to (so no autoscaler can add
    capacity, and Ray's own fate-sharing stops it if this process is killed). Ray keeps the
    node it started in ray._private.worker._global_node (None when it joined a cluster); no
    public API tells. Without it: placement that cannot fit would wait for the autoscaler
    (scaling.placement_timeout_s) instead of failing at once."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    return bool(node is not None and node.head)


def bootstrap_address() -> str | None:
    """The Ray that a `ray start` on this machine left (what a plain ray.init() joins: the
    address in /tmp/ray/ray_current_cluster), if any, by Ray's own lookup
    (ray._private.services.find_bootstrap_address), so that a run decides as ray.init would;
    None if that Ray is gone (its GCS port refuses a connection: a head killed or a machine
    restarted without `ray stop`, which leaves the file behind), with a warning once. Without
    it: a run would start or join the kept local Ray (localray.py) where a user's own
    `ray start` Ray should have been joined; without the check, a plain ray.init() waits
    minutes on the dead address."""
    from ray._private import services

    address = services.find_bootstrap_address(None)
    if address is None or answers(address):
        return address
    _warn_stale(address)
    return None


def answers(address: str, timeout_s: float = 2.0) -> bool:
    """Whether something listens at `address` (host:port), a GCS's: a connection is
    accepted within `timeout_s`. A GCS that died refuses at once."""
    import socket

    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


@functools.lru_cache(maxsize=None)
def _warn_stale(address: str) -> None:
    import sys

    from ray._private import utils

    print(f"raytrainer: warning: {utils.get_ray_address_file(None)} names a Ray at {address} that is not "
          "running (a `ray start` head stopped without `ray stop`); ignoring it", file=sys.stderr)


@contextlib.contextmanager
def quiet_token_auth_notice() -> Iterator[None]:
    """While it lasts, Ray's notice that a local Ray it starts has token authentication on
    (or off) is not printed: a WARNING at every run, about a Ray raytrainer started for the
    run on this machine, which the user did not ask for and cannot act on. Its logger is
    the module's (ray._private.authentication.authentication_token_setup.logger). Without
    it: that line again at each run."""
    import logging

    from ray._private.authentication import authentication_token_setup

    logger = authentication_token_setup.logger
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def minimal_dashboard_agent() -> Iterator[None]:
    """While it lasts, a Ray node started in this process runs its dashboard agent as Ray
    runs it where ray[default]'s packages are missing (`--minimal`: services.start_raylet
    asks ray._private.utils as it builds the agent's command, see dashboard_check): no HTTP
    server, no metrics agent or exporter; the GCS, raylet, runtime env agent and workers as
    before. Nothing raytrainer starts serves a dashboard, jobs or metrics.

    - A start on a loaded machine: the raylet waits for its agent to write each of its
      ports, 15 s a port (hard-coded: node_manager.cc, WaitForDashboardAgentPorts), then
      aborts ("Timed out waiting for file .../metrics_agent_port_..."), and the node's start
      fails. The full agent imports grpc's and aiohttp's servers and starts them first,
      which a loaded small machine does not do in time; minimal agents start in time
      (docs/results/2026-11-30-kept-ray-start-dashboard-agent.md).
    - No fixed port: the full agent's HTTP server listens on 52365 (RayParams' default,
      which ray.init does not let a caller set), the port a user's `ray start --head` beside
      the kept Ray takes by default; with it taken, every `ray job submit` to that head
      failed ("No available agent to submit job").
    - Its agents' ports told to the raylet as it starts (agent_ports_given), so that it waits
      for neither agent, however slow the machine."""
    from ray._private import services, utils

    name, answer = dashboard_check()
    full, start_raylet = getattr(utils, name), services.start_raylet
    setattr(utils, name, answer)
    services.start_raylet = agent_ports_given(start_raylet)
    try:
        yield
    finally:
        setattr(utils, name, full)
        services.start_raylet = start_raylet


def agent_ports_given(start_raylet: Callable[..., Any]) -> Callable[..., Any]:
    """services.start_raylet, starting a raylet that need not wait for its agents' ports.

    The raylet, as it starts, waits up to 15 s for each port its agents write into the
    session directory, then aborts (node_manager.cc, WaitForDashboardAgentPorts and
    WaitForRuntimeEnvAgentPort: hard-coded, RAY_agent_register_timeout_ms does not move
    them), and the node's start fails. A minimal dashboard agent, two Python processes
    importing Ray on a loaded machine, missed that, and the node failed to start; with
    this, it starts (docs/results/2026-11-30-kept-ray-start-dashboard-agent.md).

    - The minimal agent's three ports are written before the raylet starts, as the agent
      writes them once up: -1, "not served" (dashboard/agent.py). The raylet waits for a
      port's file only where it was given none (0), and for the HTTP port always.
    - The runtime env agent's port is chosen here (a free one on the node's address) and
      given, as a `ray start --runtime-env-agent-port` would be; the agent binds it. The
      raylet then waits for nothing: it asks the agent only when a worker needs a runtime
      env, and waits up to agent_register_timeout_ms for it then. The port stays bound here
      (SO_REUSEADDR, not listening: the agent's bind and listen still succeed) until the
      agent has written it (held_until_served): released at once, it could be taken in the
      seconds before the agent binds it, by another bind to port 0 or by a connection's
      own port, both drawn from the same range.

    Without persist_port (Ray before it persisted the agents' ports) it is start_raylet."""
    import inspect
    import socket

    try:
        from ray._raylet import (DASHBOARD_AGENT_LISTEN_PORT_NAME, METRICS_AGENT_PORT_NAME,
                                 METRICS_EXPORT_PORT_NAME, RUNTIME_ENV_AGENT_PORT_NAME, get_port_filename,
                                 persist_port)
    except ImportError:
        return start_raylet
    signature = inspect.signature(start_raylet)

    @functools.wraps(start_raylet)
    def starting(*args: Any, **kwargs: Any) -> Any:
        call = signature.bind(*args, **kwargs)
        given = call.arguments
        for port_name, argument in ((METRICS_AGENT_PORT_NAME, "metrics_agent_port"),
                                    (METRICS_EXPORT_PORT_NAME, "metrics_export_port"),
                                    (DASHBOARD_AGENT_LISTEN_PORT_NAME, None)):  # not given to the raylet
            if argument is None or not given.get(argument):
                persist_port(given["session_dir"], given["node_id"], port_name, -1)
        if not given.get("runtime_env_agent_port"):
            family, kind, proto, _, address = socket.getaddrinfo(given["node_ip_address"], 0,
                                                                  type=socket.SOCK_STREAM)[0]
            held = socket.socket(family, kind, proto)
            held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            held.bind(address)
            given["runtime_env_agent_port"] = held.getsockname()[1]
            written = os.path.join(given["session_dir"],
                                   get_port_filename(given["node_id"], RUNTIME_ENV_AGENT_PORT_NAME))
            held_until_served(held, written)
        return start_raylet(*call.args, **call.kwargs)

    return starting


def held_until_served(held: Any, written: str, most_s: float = 600.0) -> None:
    """Close the socket `held` once the file `written` exists (its agent has bound the port),
    or after `most_s` seconds (its node never came up), from a daemon thread."""
    import threading

    def wait() -> None:
        deadline = time.monotonic() + most_s
        while not os.path.exists(written) and time.monotonic() < deadline:
            time.sleep(0.2)
        held.close()

    threading.Thread(target=wait, name="raytrainer-agent-port", daemon=True).start()


def dashboard_check() -> tuple[str, Callable[[], Any]]:
    """The function of ray._private.utils that says whether ray[default]'s packages are
    missing, and an answer of its that says they are: Ray 2.60's
    get_dashboard_dependency_error (an import error), Ray 2.40's
    check_dashboard_dependencies_installed (False)."""
    from ray._private import utils

    if hasattr(utils, "get_dashboard_dependency_error"):
        return "get_dashboard_dependency_error", lambda: ImportError("raytrainer: this Ray serves no dashboard")
    return "check_dashboard_dependencies_installed", lambda: False


NODE_START_S = 90.0
"""How long a node raytrainer starts may take to register with its GCS (patient_node_start)."""


@contextlib.contextmanager
def patient_node_start(seconds: float = NODE_START_S) -> Iterator[None]:
    """While it lasts, a Ray node started in this process (ray.init starting a local Ray,
    ray.cluster_utils) gets `seconds` for its raylet to register with its GCS, not Ray's fixed
    30 s (ray._private.node.Node.__init__, raylet_start_wait_time_s, which nothing sets).

    On a loaded machine the kept local Ray's start failed so ("The current node timed out
    during startup"; the run then started a Ray of its own). A slow start is not a failed
    one: Ray's loop asks services.get_node until the node is there, and each ask here waits
    on, as long as the node's raylet lives (a live process with `--node_id=<the node>` in its
    command line; not checked where there is no /proc), up to `seconds` from the first. A
    raylet that died fails as before, within Ray's 30 s. Its dashboard agent runs minimal
    (minimal_dashboard_agent): the raylet does not wait past 15 s for a full one."""
    from ray._private import services

    get_node = services.get_node
    deadline: float | None = None

    def waiting(gcs_address: str, node_id: str) -> Any:
        nonlocal deadline
        deadline = deadline or time.monotonic() + seconds
        while True:
            try:
                return get_node(gcs_address, node_id)
            except RuntimeError:
                if time.monotonic() > deadline or not _raylet_lives(node_id):
                    raise
                time.sleep(0.2)

    services.get_node = waiting
    try:
        with minimal_dashboard_agent():
            yield
    finally:
        services.get_node = get_node


@contextlib.contextmanager
def own_process_groups() -> Iterator[None]:
    """While it lasts, each process a Ray node started in this process starts (its GCS,
    raylet, dashboard, monitors; the raylet's agents and workers with the raylet) leads a
    process group of its own, where it also dies with this process (kernel fate-sharing:
    ray._private.utils.set_kill_on_parent_death_linux, called by services.start_ray_process
    in the child before it runs the program, exactly where Ray has it die with its parent).

    A signal to the run's process group (Ctrl-C in a terminal, `timeout`, a container stop,
    `scancel`, systemd) is meant for the run: the driver stops it at a step boundary with a
    checkpoint. In that group, a Ray started by ray.init in this process gets it too: a SIGTERM
    stops its GCS and raylet at once (Ray blocks only SIGINT in them), the workers' calls fail,
    and the driver waits 60 s on the dead GCS until Ray ends it with status 1. In groups of
    their own they stop when ray.shutdown stops them, or die with this process if it is killed
    (as on Windows, where Ray gives them a new process group where they die with their parent).
    Without fate-sharing (no prctl) they stay in this group: Ray's reaper then stops them
    by signalling it."""
    from ray._private import utils

    original = utils.set_kill_on_parent_death_linux

    def dies_with_parent_in_its_own_group() -> None:
        original()
        os.setpgid(0, 0)

    utils.set_kill_on_parent_death_linux = dies_with_parent_in_its_own_group
    try:
        yield
    finally:
        utils.set_kill_on_parent_death_linux = original


def _raylet_lives(node_id: str) -> bool:
    if not os.path.isdir("/proc/self"):
        return True
    flag = f"--node_id={node_id}".encode()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if flag in f.read().split(b"\0"):
                        return True
            except OSError:
                continue
    return False


def enable_token_auth() -> None:
    """Turn token authentication on in this process when a token exists, as ray.init does for
    a local Ray it starts (ray._private.authentication.authentication_token_setup): a process
    joining the kept local Ray, started with a token by its keeper, does not do it itself.
    Without it: joining a kept Ray that runs with token auth fails with 'Authentication
    required'. Quietly: Ray's notice that token authentication is on is about a Ray
    raytrainer started (the issue of the notice at every run)."""
    from ray._private.authentication import authentication_token_setup as auth

    with quiet_token_auth_notice():
        auth.maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


_muted: dict[int, float] = {}  # pid -> when raytrainer killed it (time.monotonic())
_MUTE_S = 600.0  # a pid Linux hands out again later is some other process's
_DEATH_NOTICE = re.compile(r"A worker died or was killed while executing a task.*Worker PID: (\d+)", re.S)


def mute_death_notice(pid: int) -> None:
    """Ray's driver prints "(raylet) A worker died or was killed while executing a task by an
    unexpected system error ... Worker PID: N ... (1) the process was killed by the OOM
    killer ..." for every worker of the job that dies while it runs a call (a thread,
    ray._private.worker.listen_error_messages, passes each to the module's
    print_to_stdstream, looked up at every call). raytrainer kills workers itself: a hung
    one, one left waiting in a collective after a peer's loss, a rank still starting when
    the group's forming failed. For those Ray's notice misleads (an "unexpected system
    error", the OOM killer), and raytrainer's own line says what happened (metrics.notice):
    the notice of a process raytrainer killed is not printed; any other death's still is.
    Without it: that notice again, before raytrainer's own error at a wrong task.target."""
    import ray._private.worker as ray_worker

    now = time.monotonic()
    for old in [p for p, at in _muted.items() if now - at > _MUTE_S]:
        del _muted[old]
    _muted[pid] = now
    shown = ray_worker.print_to_stdstream
    if getattr(shown, "raytrainer_mutes", False):
        return

    @functools.wraps(shown)
    def print_to_stdstream(data: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        if data.get("pid") == "raylet":
            lines = [line for line in data["lines"] if not _is_muted(line)]
            if not lines:
                return
            data = {**data, "lines": lines}
        shown(data, *args, **kwargs)

    print_to_stdstream.raytrainer_mutes = True  # type: ignore[attr-defined]
    ray_worker.print_to_stdstream = print_to_stdstream


def _is_muted(line: str) -> bool:
    found = _DEATH_NOTICE.search(line)
    return found is not None and int(found.group(1)) in _muted


def draining_nodes() -> dict[str, float | None]:
    """The nodes being drained: node id -> deadline (time.time() seconds, None: none). Ray's
    own view (ray._private.state.state.get_draining_nodes), as Ray Train's and Ray Data's
    preemption handling read it: no public API yet. {} if it cannot be read (the GCS busy:
    the driver looks again at its next poll). Without it: a drained node's workers are lost
    at its deadline and recovered from, instead of leaving it at a step boundary first."""
    try:
        from ray._private import state

        nodes = state.state.get_draining_nodes()  # node id hex -> deadline ms, 0: none
    except Exception:  # noqa: BLE001 - the GCS busy: look again later
        return {}
    return {node: (ms / 1000 if ms else None) for node, ms in nodes.items()}


def is_placement_group_resource(key: str) -> bool:
    """Whether a key of ray.cluster_resources() is a placement group's own resource (Ray
    names them "<resource>_group_<pg id>" and "<resource>_group_<index>_<pg id>"): left out
    of the resources an error message lists. Without it: those lines list them too."""
    return "_group_" in key


def single_slot_on(bundle: dict[str, float], node_id: str, **options: Any):
    """A placement group of one bundle that Ray places on `node_id` if it has room, else
    anywhere (ray.util.placement_group's private `_soft_target_node_id`, which Ray Serve uses;
    it needs the STRICT_PACK strategy). The group's slots start as one group of all
    min_workers bundles, placed at once with the user's strategy, then are traded for one
    group each on the same nodes (group/slots.py: a lost node's bundle of a shared group
    cannot be given back). Without it: the single groups land wherever Ray puts them, and
    scaling.placement (PACK, SPREAD) holds for the first placement only by chance."""
    from ray.util.placement_group import placement_group

    return placement_group([bundle], strategy="STRICT_PACK", _soft_target_node_id=node_id, **options)


def placement_groups_named(prefix: str) -> list[tuple[Any, dict[str, Any]]]:
    """The placement groups (not removed) whose name starts with `prefix`, with their table
    entries: the groups a lost driver of a run reserved (group/orphans.py). Ray lists them
    publicly (placement_group_table) but makes a handle from an id only privately:
    PlacementGroup(PlacementGroupID), the class its own handles are. Without it: a new
    driver could not take over the slots of the workers it takes over, nor give them back."""
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, placement_group_table

    return [(PlacementGroup(PlacementGroupID.from_hex(pg_id)), info)
            for pg_id, info in placement_group_table().items()
            if (info.get("name") or "").startswith(prefix) and info.get("state") != "REMOVED"]
