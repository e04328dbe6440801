"""The one supervisor of child processes, for the three places that run some: the node (``llamamesh
serve`` / ``demo``, llamamesh/cli/node.py: the gateway and the embedded Redis are essential, the
workers are restarted), the gateway's processes sharing one port (``LLAMAMESH_GATEWAY_PROCESSES``,
services/server.py) and a worker's replicas, one per GPU group (workers/replicas.py). It restarts
what exits with backoff, forwards SIGTERM / SIGINT, and leaves no orphans when it dies.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Protocol

import structlog

log = structlog.get_logger(__name__)

# Waiting is a poll (portable, negligible CPU), not a platform-specific child watcher.
POLL_S = 0.1


class Process(Protocol):
    """What the supervisor needs of a process it watches (``subprocess.Popen`` has it)."""

    pid: int

    def poll(self) -> int | None: ...

    def send_signal(self, sig: int) -> None: ...


@dataclass(frozen=True)
class Child:
    """A process to run: ``argv`` with this process's environment plus ``env``. ``essential``: its
    exit ends the whole set (it is not restarted); otherwise it is restarted with backoff."""

    name: str
    argv: Sequence[str]
    env: Mapping[str, str]
    essential: bool = False


@dataclass(frozen=True)
class Backoff:
    """The delay before a child's restart: it doubles with each quick exit in a row (1 s, 2 s, 4 s …
    up to 30 s, each scaled by a random factor so that restarted siblings do not move in lockstep),
    and starts again from 1 s once a run lasted ``reset_after_s``. After ``report_after`` quick exits
    in a row the child is reported as crash-looping and still retried at the longest delay, never in
    a tight loop."""

    first_s: float = 1.0
    max_s: float = 30.0
    # Each delay is multiplied by a random factor in [1 - jitter, 1 + jitter].
    jitter: float = 0.25
    # A run this long resets the delay to first_s.
    reset_after_s: float = 60.0
    # Quick exits in a row after which the child is reported as crash-looping.
    report_after: int = 5

    def delay(self, quick_exits: int, rand: float) -> float:
        """The delay before a restart after ``quick_exits`` quick exits in a row; ``rand`` in [0, 1)."""
        base = min(self.max_s, self.first_s * 2 ** max(0, quick_exits - 1))
        return base * (1 - self.jitter + 2 * self.jitter * rand)


@dataclass
class ChildState:
    child: Child
    process: Process | None = None
    started_at: float = 0.0
    starts: int = 0
    quick_exits: int = 0
    last_exit: int | None = None
    # Monotonic time of the next start while it waits out its backoff; None while it runs.
    restart_at: float | None = None
    crash_looping: bool = False
    # Watched, not started by us (the embedded Redis): never restarted.
    external: bool = False

    @property
    def name(self) -> str:
        return self.child.name

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None


@dataclass
class Supervisor:
    """Runs ``children``, restarting the ones that exit (a crash, kill -9, a failed engine start)
    after their ``backoff``. A crash loop is reported by a log line, :meth:`crash_looping` and the
    ``on_exit`` hook (which the node uses to put the reason in the worker's heartbeat). On Linux
    each child also gets SIGTERM when the supervisor itself dies (``PR_SET_PDEATHSIG``)."""

    children: Sequence[Child]
    backoff: Backoff = field(default_factory=Backoff)
    # Where the children's stdout and stderr go (None: inherited).
    output: IO[bytes] | None = None
    # Called after each exit of a restartable child, once its restart is scheduled.
    on_exit: Callable[[ChildState], None] | None = None
    clock: Callable[[], float] = time.monotonic
    rand: Callable[[], float] = random.random
    # How a child is started (tests give a fake); None: a subprocess, see _popen.
    launch: Callable[[Child, IO[bytes] | None], Process] | None = None
    states: dict[str, ChildState] = field(default_factory=dict)
    stopping: bool = False

    def start(self) -> None:
        """Start every child. Raises OSError if one cannot be started."""
        for child in self.children:
            self.states[child.name] = state = ChildState(child)
            self._spawn(state)

    def watch(self, name: str, process: Process) -> None:
        """Also watch a process started elsewhere; its exit ends the set, like an essential child's."""
        self.states[name] = ChildState(Child(name, (), {}, essential=True), process, self.clock(), 1, external=True)

    def _spawn(self, state: ChildState) -> None:
        c = state.child
        state.process = (self.launch or _popen)(c, self.output)
        state.started_at, state.restart_at = self.clock(), None
        state.starts += 1
        log.info("child_started", child=c.name, pid=state.process.pid, start=state.starts)

    def step(self) -> int | None:
        """Reap exits and start what is due, once (no waiting). Returns the set's exit code when an
        essential child ended (its code, at least 1), else None."""
        now = self.clock()
        for state in self.states.values():
            p = state.process
            if state.restart_at is not None:
                if now >= state.restart_at and not self.stopping:
                    self._spawn(state)
                continue
            if p is None or (code := p.poll()) is None:
                continue
            state.last_exit = code
            if state.child.essential:
                log.error("child_exited", child=state.name, exit_code=code, essential=True)
                return code or 1
            self._schedule(state, now)
        return None

    def _schedule(self, state: ChildState, now: float) -> None:
        ran = now - state.started_at
        state.quick_exits = state.quick_exits + 1 if ran < self.backoff.reset_after_s else 1
        delay = self.backoff.delay(state.quick_exits, self.rand())
        state.restart_at = now + delay
        looping = state.quick_exits >= self.backoff.report_after
        if looping and not state.crash_looping:
            log.error(
                "child_crash_looping",
                child=state.name,
                exits_in_a_row=state.quick_exits,
                exit_code=state.last_exit,
                restart_in_s=round(delay, 1),
            )
        else:
            log.warning(
                "child_exited",
                child=state.name,
                exit_code=state.last_exit,
                ran_s=round(ran, 1),
                restart_in_s=round(delay, 1),
            )
        state.crash_looping = looping
        if self.on_exit is not None:
            try:
                self.on_exit(state)
            except Exception as exc:  # a report must never stop the supervisor
                log.warning("child_exit_report_failed", child=state.name, error=f"{type(exc).__name__}: {exc}")

    def crash_looping(self) -> list[ChildState]:
        return [s for s in self.states.values() if s.crash_looping]

    def run(self, signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT)) -> int:
        """Supervise until one of ``signals`` (forwarded to the children: each drains as it does on
        its own; returns 0) or until an essential child ends (returns its code). Call :meth:`stop`
        afterwards."""
        old = {s: signal.signal(s, self._on_signal) for s in signals}
        try:
            while not self.stopping:
                code = self.step()
                if code is not None:
                    return code
                time.sleep(POLL_S)
            return 0
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.stopping = True

    def stop(self, grace_s: float = 30.0, sig: int = signal.SIGTERM, first: Collection[str] = ()) -> int:
        """Send ``sig`` to every running child, wait up to ``grace_s`` for all, kill the rest; the
        children named in ``first`` before the others (each in ``grace_s``): a node's gateway
        drains while its workers still run what it accepts. Returns 0, or 1 if a child had to be
        killed. Watched processes are left to their owner. A SIGTERM or SIGINT meanwhile is passed
        on to the children (a gateway's second signal skips its settle wait), never the end of
        this process before theirs."""
        self.stopping = True
        ours = [s for s in self.states.values() if not s.external and s.process is not None and s.restart_at is None]
        code = 0
        with self.forwarding(ours):
            for stage in ([s for s in ours if s.name in first], [s for s in ours if s.name not in first]):
                for s in stage:
                    self._send(s, sig)
                code = max(code, self._wait(stage, grace_s))
        log.info("children_stopped", children=len(ours))
        return code

    @contextlib.contextmanager
    def forwarding(self, states: Sequence[ChildState]) -> Iterator[None]:
        """For the block: SIGTERM and SIGINT go on to the running ``states`` (main thread only; in
        another the handlers are left as they are)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        pass_on = (signal.SIGTERM, signal.SIGINT)
        old = {n: signal.signal(n, lambda signum, frame: [self._send(s, signum) for s in states]) for n in pass_on}
        try:
            yield
        finally:
            for n, handler in old.items():
                signal.signal(n, handler)

    @staticmethod
    def _send(state: ChildState, sig: int) -> None:
        if state.process is not None and state.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                state.process.send_signal(sig)

    def _wait(self, ours: Sequence[ChildState], grace_s: float) -> int:
        deadline = self.clock() + grace_s
        code = 0
        for s in ours:
            p = s.process
            assert p is not None
            while p.poll() is None and self.clock() < deadline:
                time.sleep(POLL_S / 2)
            if p.poll() is None:
                log.warning("child_killed", child=s.name, grace_s=grace_s)
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGKILL)
                while p.poll() is None:
                    time.sleep(POLL_S / 2)
                code = 1
        return code


# On Linux each child is first this bare interpreter (-I -S: no site, no environment, only ctypes):
# it asks for SIGTERM at its parent's death, checks the parent is still there (else the signal
# would never come), then execs the real command; PR_SET_PDEATHSIG survives exec. This is never a
# ``preexec_fn``: that runs Python between fork and exec in a process with threads (gRPC's, the
# event loop's executor), and the child then died of SIGSEGV or SIGABRT in about one start in
# seven while gRPC was busy (tests/unit/test_supervisor.py). Without it subprocess uses vfork.
_GUARD = """import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    sys.exit(128 + signal.SIGTERM)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def _popen(child: Child, output: IO[bytes] | None) -> Process:
    env = {**os.environ, **child.env}
    return subprocess.Popen(_with_parent_death(child.argv), env=env, stdout=output, stderr=output)


def _with_parent_death(argv: Sequence[str]) -> list[str]:
    """The command line that runs ``argv`` so that it gets SIGTERM (and drains) when the supervisor
    dies, even by kill -9, instead of living on as an orphan. Elsewhere than Linux: ``argv``."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-I", "-S", "-c", _GUARD, str(os.getpid()), *argv]
