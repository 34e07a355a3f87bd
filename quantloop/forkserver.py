"""A warm process for the CLI: Prefect, MLflow, torch and the flows imported once, one
fork per command.

A research run's imports (Prefect, MLflow's SQL stores, torch, pandas, Dask) cost 7 s
of CPU on this 2-core machine before its first node, and a no-op re-run does little
else. The first `quantloop run` (or nodes, verify, ...) starts this server beside it,
detached; each later one is a small client that passes its argv, environment, working
folder and its three standard streams (the file descriptors themselves, SCM_RIGHTS)
to the server, which forks a child that becomes the command: it writes to the client's
terminal or pipes, reads its stdin, and sends back its exit status. This is how
nailgun, Spring (Rails) and multiprocessing's forkserver avoid start-up costs.

What keeps a child the same as an in-process command:
- The server imports libraries and quantloop's flows only, never the CLI modules (their
  Rich consoles detect the terminal at import): the child imports those itself.
- The environment, working folder, umask and sys.path are the client's; Prefect's
  settings and logging and Dask's configuration are read again from that environment.
  Variables that libraries read at import (PYTHON*, LD_*, OMP_*, TORCH*, CUDA*, DASK_*,
  PREFECT_*, HOME, TMPDIR, locale ...) are part of the server's address: a client whose
  values differ gets (and starts) another server.
- Code that changed on disk: before each fork the server compares the modules it
  imported with their files (mtime and size); one that changed ends the server and the
  client runs in-process, starting a fresh server.
- A kill -9 of the client kills the child (its connection closes); SIGINT, SIGTERM and
  SIGHUP the client receives are forwarded to the child.
- Only the user who started the server may use it (SO_PEERCRED); the address is an
  abstract Unix socket, Linux only (elsewhere every command runs in-process).

A command it forked may also hand it a call (tasks/runtime/overlap.call: one of CALLS,
JSON in and out): the server forks another child that runs the function with the
command's environment, folder and streams and answers on the command's connection; a
research run exports its model so, on another core than its own simulation.

QUANTLOOP_FORKSERVER=0 turns it off (every command in-process, nothing started);
QUANTLOOP_FORKSERVER_IDLE_S (600) is how long an unused server stays;
`python -m quantloop.forkserver --ping` prints the ready server's pid for this
environment, `--stop` stops it, `--flow-runs` starts the one a Prefect worker started
with this environment gives its flow runs (`quantloop engine --warm`).
"""

from __future__ import annotations

import array
import contextlib
import gc
import hashlib
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator

IDLE_S = 600.0
IN_CHILD = False  # true in a child that runs a command (quantloop/cli/common.quiet_console)
# The commands a warm process runs: the ones that import the flows. serve, api, deploy
# and ladder start long-lived servers or benchmarks of their own and stay in-process.
COMMANDS = frozenset({"run", "nodes", "verify", "reproduce", "retrain", "backtest", "promote",
                      "engine"})  # fmt: skip
# What libraries read from the environment at import: a different value needs another
# server (prefixes and exact names).
IMPORT_ENV_PREFIXES = (
    "PYTHON", "LD_", "OMP_", "MKL_", "OPENBLAS_", "TORCH", "PYTORCH", "CUDA", "NCCL",
    "TRITON", "DASK_", "PREFECT_", "FSSPEC_", "LC_", "QUANTLOOP_",
)  # fmt: skip
IMPORT_ENV_NAMES = ("HOME", "TMPDIR", "TEMP", "TMP", "LANG", "LANGUAGE", "USER", "PATH")
# The server's own settings are not part of its address, nor settings read only while a
# command runs.
OWN_ENV = ("QUANTLOOP_FORKSERVER", "QUANTLOOP_FORKSERVER_IDLE_S", "QUANTLOOP_OVERLAP")
# What a Prefect worker sets for each flow run it starts (PREFECT__FLOW_RUN_ID, the
# control channel's port and token, the worker's and deployment's ids): read while the
# run runs, never at import, so flow runs of one worker share a server.
RUN_ENV_PREFIXES = ("PREFECT__",)
# What a command may hand to a fresh child of its server (tasks/runtime/overlap.call):
# "module:function" taking and returning JSON.
CALLS = frozenset({"quantloop.tasks.records.registry:export_stored"})
# What the server imports before it forks: what a research run imports, less the CLI.
WARM_MODULES = (
    # first: its exit handler (the run's breakdown) must run after those of the
    # libraries below, as it does in-process, where the CLI imports it first
    "quantloop.tasks.runtime.timeline",
    "quantloop.flows.params",
    # what `quantloop engine` runs (a process worker's flow runs): Prefect's engine and
    # the deployment steps it runs before the flow (set_working_directory)
    "prefect.engine",
    "prefect.deployments.steps",
    "quantloop.flows.research",
    "quantloop.tasks.records.summary",
    "quantloop.tasks.research.training",
    "quantloop.profiling.proof",
    "mlflow.store.tracking.sqlalchemy_store",
    "mlflow.store.model_registry.sqlalchemy_store",
    "distributed",
    "typer",
    "rich.console",
    "rich.progress",
    "rich.table",
    # what a run that computes imports on the way (py-spy, a run with one product's
    # features changed): dynamo (every torch.optim optimizer's first __init__, 1.0 s),
    # the MLflow figures (0.3 s); the statistics' one import (scipy.special) is
    # uncertainty:warm's below. Not arch or scipy.stats: arch is a test oracle only ([dev]),
    # absent where README's first command installed, and ~800 modules nobody uses
    "torch._dynamo",
    # and what a cached re-run imports late (py-spy over a warm child, 2026-12-05): the
    # feature stage's read of a store's Parquet files and its summary's group-by (30 ms),
    # MLflow's SQLite dialect, Prefect's task engine (the first task run)
    "pyarrow.dataset",
    "pyarrow.acero",
    "sqlalchemy.dialects.sqlite",
    "prefect.task_engine",
)
# Inductor, which every compiled training imports (`torch._dynamo.reset()` imports its
# CUDA graph trees where CUDA is built: 2-3 s of an H200 run's train stage) and which a
# registration's export imports too (its serializer imports torch._inductor.ir). Imported
# under `cuda_asked_of_devices`: at import, torch._inductor.runtime.benchmarking asks
# `torch.cuda.is_available()`, which opened /dev/nvidiactl on the H200 (NVML), and this
# process then served no one (bench/cuda_open.py --trace).
WARM_INDUCTOR = ("torch._inductor.compile_fx", "torch._inductor.cudagraph_trees")
# called once the modules are in: matplotlib's Figure and its Agg canvas (as the figures
# of tasks/records/plots.py draw), and torch.export's first call
# (a registration's export runs in a child of this process: tasks/records/registry.py),
# the estimators' first call (scipy.special's Student t), MLflow's
# migration head, which each opening of a SQL store otherwise finds again (~55 ms), and a
# run's first MLflow calls on a scratch store (a child's first client and run 0.5 -> 0.2
# CPU-s here), and what Prefect's and MLflow's first calls build
# (tasks/runtime/first_calls.py)
WARM_CALLS = (
    "quantloop.tasks.records.plots:_figure_class",
    "quantloop.tasks.records.registry:warm_export",
    "quantloop.tasks.research.uncertainty:warm",
    "quantloop.tasks.records.tracking:warm_client",
    "quantloop.tasks.runtime.first_calls:warm",
)


def enabled() -> bool:
    return sys.platform == "linux" and os.environ.get("QUANTLOOP_FORKSERVER", "1") != "0"


def address(env: dict[str, str] | None = None) -> str:
    """The abstract socket name of the server for this interpreter, this quantloop, this
    user and the import-time environment."""
    env = os.environ if env is None else env
    here = os.path.dirname(os.path.abspath(__file__))
    imported = sorted(
        (k, v) for k, v in env.items()
        if k not in OWN_ENV and not k.startswith(RUN_ENV_PREFIXES)
        and (k in IMPORT_ENV_NAMES or k.startswith(IMPORT_ENV_PREFIXES))
    )  # fmt: skip
    # Not sys.path: it is the interpreter's, its prefix's (site-packages) and PYTHONPATH's,
    # all in the key, plus the script's folder, which differs between callers (and which
    # the child takes from its client).
    key = json.dumps([os.path.realpath(sys.executable), sys.prefix, here, os.getuid(),
                      _flags(), imported])  # fmt: skip
    return "\0quantloop-forkserver-" + hashlib.sha256(key.encode()).hexdigest()[:24]


def _flags() -> list[str]:
    """The interpreter options that change what an import finds, as options."""
    f = sys.flags
    named = (("-I", f.isolated), ("-E", f.ignore_environment), ("-s", f.no_user_site),
             ("-P", f.safe_path))  # fmt: skip
    return [option for option, on in named if on]


def log_path(env: dict[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    base = env.get("XDG_RUNTIME_DIR") or os.path.join(
        env.get("TMPDIR", "/tmp"), f"quantloop-{os.getuid()}"
    )
    return os.path.join(base, "forkserver.log")


# ------------------------------------------------------------------------------ client


def run(argv: list[str], started: float) -> int | None:
    """Run the command in a warm server's child and return its exit status; None when
    there is no usable server (then one is started for the next command, and the caller
    runs the command itself)."""
    name = address()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(name)
    except OSError:
        sock.close()
        start_server(name)
        return None
    with sock:
        try:
            cwd = os.getcwd()
        except OSError:  # a folder removed under the shell: the command says so itself
            return None
        request = {"argv": argv, "env": dict(os.environ), "cwd": cwd,
                   "umask": _umask(), "path": sys.path, "started": started}  # fmt: skip
        data = json.dumps(request).encode() + b"\n"
        fds = array.array("i", [0, 1, 2])
        try:
            sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
            if sent < len(data):
                sock.sendall(data[sent:])
        except OSError:  # the server went away meanwhile (stale code, idle): in-process
            return None
        reader = sock.makefile("rb")
        child = None
        forwarded = {}

        def forward(signum, _frame):
            if child is None:
                # Still waiting for the server (its imports): stop here with the shell's
                # status for the signal (130 for Ctrl-C); a child forked later finds us
                # gone and ends itself.
                sys.exit(128 + signum)
            try:
                os.kill(child, signum)
            except ProcessLookupError:
                pass

        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            forwarded[signum] = signal.signal(signum, forward)
        try:
            for line in reader:
                message = json.loads(line)
                if "stale" in message:
                    start_server(name)
                    return None
                if "pid" in message:
                    child = message["pid"]
                elif "exit" in message:
                    return int(message["exit"])
        except OSError:
            # The server died: still importing, the connection in its backlog is reset
            # (ECONNRESET); after the fork, its child's status is unknown (below).
            pass
        finally:
            for signum, old in forwarded.items():
                signal.signal(signum, old)
        if child is None:  # the server went away before it forked: run in-process
            return None
        print(f"quantloop: the command's process ({child}) ended without an exit status "
              f"(killed?); the warm server's log: {log_path()}", file=sys.stderr)  # fmt: skip
        return 1


def ping(env: dict[str, str] | None = None, timeout: float = 300.0, *, stop: bool = False
         ) -> int | None:  # fmt: skip
    """The pid of the server for `env` (this process's environment by default) once it
    has done its imports, or None when there is none; with `stop`, it exits after it
    answers (commands it forked run on)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    with sock:
        try:
            sock.connect(address(env))
            sock.sendall(json.dumps({"ping": True, "stop": stop}).encode() + b"\n")
            answer = sock.makefile("rb").readline()
        except OSError:
            return None
    return json.loads(answer)["pong"] if answer else None


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def start_server(name: str, env: dict[str, str] | None = None) -> None:
    """Start a server at `name` for this environment (or `env`) and interpreter options,
    detached (its own session), logging to log_path(); it exits at once if another holds
    `name`."""
    import subprocess

    log = log_path(env)
    os.makedirs(os.path.dirname(log), mode=0o700, exist_ok=True)
    with open(log, "ab") as out:
        subprocess.Popen(
            [sys.executable, *_flags(), "-m", "quantloop.forkserver", name.lstrip("\0")],
            stdin=subprocess.DEVNULL, stdout=out, stderr=out, cwd="/",
            start_new_session=True, close_fds=True, env=env,
        )  # fmt: skip


def flow_run_environment() -> dict[str, str]:
    """The environment a Prefect process worker started with this one gives its flow
    runs, less the variables it sets per run (PREFECT__*, not part of an address): this
    one, with its Prefect settings written out as variables over it, by the worker's own
    code (a setting is written as Prefect writes it: "False", "1.0")."""
    from prefect.workers.base import BaseJobConfiguration

    return {**os.environ, **BaseJobConfiguration._base_environment()}


def start_for_flow_runs() -> str | None:
    """Start the server that the flow runs of a worker started with this environment
    will use (`quantloop engine`, their command), unless it is up; its log, or None when
    servers are off here."""
    if not enabled():
        return None
    env = flow_run_environment()
    start_server(address(env), env)  # exits at once if another holds the address
    return log_path(env)


# ------------------------------------------------------------------------------ server


def warm_up(after: Callable[[str], None] | None = None) -> None:
    """What the server imports and calls before it serves; `after(step)` after each
    step (bench/cuda_open.py checks for an open device there)."""
    import importlib

    for module in WARM_MODULES:
        importlib.import_module(module)
    if after:
        after("modules")
    with cuda_asked_of_devices():
        # only where a GPU is: on a CPU `auto` compiles nothing (profiling/proof.py), and
        # the import costs ~3 s of CPU and ~150 MB in every warm process
        for module in WARM_INDUCTOR if gpu_present() else ():
            _speed_up(module, lambda m=module: importlib.import_module(m))
            if after:
                after(module)
        for call in WARM_CALLS:
            module, _, function = call.partition(":")
            _speed_up(call, lambda m=module, f=function: getattr(importlib.import_module(m), f)())
            if after:
                after(call)


def _speed_up(what: str, do: Callable[[], object]) -> None:
    """A step of the warm-up that only saves the commands time: one that fails is said in
    the log and left out (each command then does it itself), not the end of the server."""
    try:
        do()
    except Exception as exc:  # noqa: BLE001 - any failure: the server serves without it
        _log(f"warm-up step {what} failed, left out: {type(exc).__name__}: {exc}")


def gpu_present() -> bool:
    """torch is built with CUDA, CUDA_VISIBLE_DEVICES hides nothing and a GPU's device
    node is there (/dev/nvidia0 ...): asked without the driver."""
    import torch

    if not torch.cuda._is_compiled():
        return False
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    return any(n.startswith("nvidia") and n[6:].isdigit() for n in os.listdir("/dev"))


@contextlib.contextmanager
def cuda_asked_of_devices() -> Iterator[None]:
    """`torch.cuda.is_available()` answered inside the block without the driver
    (`gpu_present`). The real question initializes the driver
    (cuInit, or NVML with PYTORCH_NVML_BASED_CUDA_CHECK=1), and a forked child cannot
    use a driver its parent opened. What an import computes from the answer (Inductor's
    choice of benchmarker) is what a child on the same machine would compute."""
    import torch

    asked = torch.cuda.is_available
    torch.cuda.is_available = gpu_present
    try:
        yield
    finally:
        torch.cuda.is_available = asked


def serve(name: str, idle_s: float) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(name)
    except OSError:  # another server holds this address
        return
    # Bound before the imports: a client that connects meanwhile waits in the backlog
    # for the fork instead of paying the same imports itself.
    listener.listen(64)
    t0 = time.perf_counter()
    # Said at once: a log that shows a server only once it is ready hides one that is
    # still importing (seconds on a busy machine), and what ended it meanwhile.
    _log(f"pid {os.getpid()} warming up")
    from quantloop.tasks.runtime import collector

    with collector.paused():  # and frozen after: a child's passes skip what it inherits
        warm_up()
    files = _module_files()
    cuda = _cuda_opened()
    if cuda is not None:
        # A forked child cannot use a CUDA context its parent made: serve no one.
        _log(f"an import opened {cuda} (CUDA initialized): not serving; commands run "
             "in-process")  # fmt: skip
        listener.close()
        return
    _log(f"pid {os.getpid()} ready in {time.perf_counter() - t0:.1f} s, "
         f"{gc.get_freeze_count():,} objects frozen, {len(files)} module files watched, "
         f"idle timeout {idle_s:.0f} s")  # fmt: skip
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    listener.settimeout(idle_s)
    while True:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            _log(f"idle for {idle_s:.0f} s: exiting")
            return
        conn.settimeout(30)  # a client that connects and sends nothing holds no one up
        try:
            request, fds = _receive(conn)
            conn.settimeout(None)
        except (OSError, ValueError) as exc:
            _log(f"a bad request: {exc}")
            conn.close()
            continue
        if request.get("ping"):
            if request.get("stop"):
                listener.close()
                _log("asked to stop: exiting")
            _send(conn, {"pong": os.getpid()})
            conn.close()
            if request.get("stop"):
                return
            continue
        target = request.get("call")
        if target is not None and target not in CALLS:
            _send(conn, {"error": f"{target!r} is not a call this server runs"})
            for fd in fds:
                os.close(fd)
            conn.close()
            continue
        changed = _changed(files)
        if changed:
            # Release the address first, so the client's new server can take it.
            listener.close()
            _log(f"{changed} changed on disk: exiting")
            _send(conn, {"stale": changed})
            conn.close()
            return
        pid = os.fork()
        if pid == 0:
            listener.close()
            if target is not None:
                _call_child(conn, fds, request)  # never returns
            _child(conn, fds, request, name)  # never returns
        for fd in fds:
            os.close(fd)
        conn.close()
        if target is not None:
            _log(f"pid {pid}: call {target}")
        else:
            _log(f"pid {pid}: quantloop {request['argv'][0] if request['argv'] else ''}")


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
    uid = int.from_bytes(creds[4:8], sys.byteorder)
    if uid != os.getuid():
        raise ValueError(f"a client of uid {uid}, not ours ({os.getuid()}): refused")
    data, fds = b"", []
    while not data.endswith(b"\n"):
        chunk, ancillary, _, _ = conn.recvmsg(1 << 16, socket.CMSG_SPACE(3 * 4))
        if not chunk:
            raise ValueError("the client closed before its request ended")
        data += chunk
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
                fds.extend(got)
    request = json.loads(data)
    if len(fds) != (0 if request.get("ping") else 3):
        for fd in fds:
            os.close(fd)
        raise ValueError(f"expected 3 file descriptors, got {len(fds)}")
    return request, fds


def _module_files() -> dict[str, tuple[int, int]]:
    files = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if path:
            try:
                st = os.stat(path)
            except OSError:
                continue
            files[path] = (st.st_mtime_ns, st.st_size)
    return files


def _cuda_opened() -> str | None:
    """A /dev/nvidia* device this process holds open (CUDA's driver was initialized)."""
    try:
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/self/fd/{fd}")
                if target.startswith("/dev/nvidia"):
                    return target
    except OSError:
        pass
    return None


def _changed(files: dict[str, tuple[int, int]]) -> str | None:
    for path, seen in files.items():
        try:
            st = os.stat(path)
        except OSError:
            return path
        if (st.st_mtime_ns, st.st_size) != seen:
            return path
    return None


def _send(conn: socket.socket, message: dict) -> None:
    try:
        conn.sendall(json.dumps(message).encode() + b"\n")
    except OSError:
        pass


def _log(message: str) -> None:
    print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} forkserver: {message}", flush=True)


# ------------------------------------------------------------------------------- child


def _become(conn: socket.socket, fds: list[int], request: dict) -> None:
    """Take the client's streams, environment, folder, umask and sys.path, answer with
    this pid, and die with the client."""
    os.setsid()  # signals to the server's session do not reach the command
    for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    # as an interpreter started on these streams buffers them: stdout by line on a
    # terminal, stderr by line always (Python 3.9+), so a pipe (a Prefect worker's, a
    # `| tee`) gets each log line as it is written
    sys.stdout.reconfigure(line_buffering=sys.stdout.isatty())
    sys.stderr.reconfigure(line_buffering=True)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    os.umask(int(request["umask"]))
    sys.path[:] = request["path"]
    _send(conn, {"pid": os.getpid()})
    _watch_client(conn)
    _fresh_state(float(request["started"]))


def _child(conn: socket.socket, fds: list[int], request: dict, server: str) -> None:
    """Become the client's command: its streams, environment, folder and argv."""
    global IN_CHILD
    IN_CHILD = True
    code = 1
    try:
        sys.argv = ["quantloop", *request["argv"]]
        _become(conn, fds, request)
        from quantloop.tasks.runtime import overlap

        overlap.SERVER = server  # the command may hand work to a child of this server
        from quantloop.cli import run_app

        code = run_app()
    except BaseException as exc:  # noqa: BLE001 - the child must always exit here
        try:
            import traceback

            traceback.print_exc()
        finally:
            code = exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) else 1
    finally:
        try:
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
        finally:
            _send(conn, {"exit": code})
            os._exit(code)


def _call_child(conn: socket.socket, fds: list[int], request: dict) -> None:
    """Run a command's call (tasks/runtime/overlap.call): `module:function(**kwargs)` with
    the command's streams, environment and folder; its JSON result, or its traceback,
    goes back on the connection."""
    code = 1
    try:
        _become(conn, fds, request)
        import importlib

        module, _, name = request["call"].partition(":")
        result = getattr(importlib.import_module(module), name)(**request["kwargs"])
        _send(conn, {"result": result})
        code = 0
    except BaseException:  # noqa: BLE001 - the child must always answer and exit here
        import traceback

        _send(conn, {"error": traceback.format_exc()})
    finally:
        try:
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
        finally:
            os._exit(code)


def _watch_client(conn: socket.socket) -> None:
    """A kill -9 of the client closes the connection: end this command as a kill -9 of
    an in-process command would end it (its reaper then ends what it started)."""
    import threading

    def watch() -> None:
        try:
            while conn.recv(4096):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="forkserver-client", daemon=True).start()


def _fresh_state(started: float) -> None:
    """What the server's imports read from its environment, read again from the client's."""
    import random
    import tempfile

    random.seed()
    tempfile.tempdir = None
    if "prefect.context" in sys.modules:
        import prefect.context
        from prefect.logging.configuration import setup_logging

        before = prefect.context.get_settings_context().settings
        prefect.context.refresh_global_settings_context()
        # Logging's set-up (65 ms of every command here) again only when the client's
        # settings differ from the server's (its folder's .env or prefect.toml): its
        # template reads any setting; the server set it up from the same ones
        if prefect.context.get_settings_context().settings != before:
            setup_logging(incremental=False)
    if "dask.config" in sys.modules:
        import dask.config

        dask.config.refresh()
    from quantloop.tasks.runtime import timeline

    # The command's time counts from the client's start, not the fork.
    tl = timeline.TIMELINE
    tl.origin = started
    tl.process = "warm"
    tl.spans.clear()
    tl.totals.clear()
    tl._open.clear()


if __name__ == "__main__":
    # The module itself, not this `__main__` copy: the child's IN_CHILD is read there.
    from quantloop import forkserver

    if sys.argv[1:] == ["--flow-runs"]:  # `quantloop engine --warm`
        log = forkserver.start_for_flow_runs()
        print("QUANTLOOP_FORKSERVER=0: flow runs run in their own process; nothing started"
              if log is None else f"a warm process for flow runs: log {log}")  # fmt: skip
        sys.exit(0)
    if sys.argv[1:] in (["--ping"], ["--stop"]):
        # the pid of this environment's ready server (--stop: which then exits), or exit 1
        pid = forkserver.ping(stop=sys.argv[1] == "--stop")
        print(pid or "no warm process")
        sys.exit(0 if pid else 1)
    idle = float(os.environ.get("QUANTLOOP_FORKSERVER_IDLE_S", IDLE_S))
    forkserver.serve("\0" + sys.argv[1], idle)
