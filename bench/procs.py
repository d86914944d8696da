"""Child processes of the benchmark (bench upstream, gateway, optional nginx) and /proc readers.

Every child is started in its own session (a terminal's Ctrl-C reaches only the harness, which then stops
the children itself), with ``PR_SET_PDEATHSIG`` = SIGTERM (if the harness dies, even by SIGKILL, the kernel
signals the children), and a raised ``RLIMIT_NOFILE``. :class:`Children` stops every child it started,
SIGTERM then SIGKILL, on every exit path: ``with Children() as kids: ...`` plus an ``atexit`` hook.

It also reads what a run records of where it ran: the CPU model, the load, the git revision (:func:`git_rev`).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import hashlib
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
NGINX = Path("/usr/sbin/nginx")
ROOT = Path(__file__).resolve().parent.parent  # the checkout (git_rev)
_PR_SET_PDEATHSIG = 1
try:
    _LIBC: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True)
except OSError:  # pragma: no cover
    _LIBC = None


def raise_nofile(want: int = 65536) -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` towards ``want`` (children inherit it); returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _child_setup() -> None:  # runs in the forked child before exec
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def free_port() -> int:
    """A free loopback TCP port (bind to 0 and release; the tiny race is acceptable on a quiet machine)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pin_prefix(cpu: int | None) -> list[str]:
    """``taskset -c CPU`` when pinning is possible, else nothing."""
    if cpu is None or shutil.which("taskset") is None:
        return []
    return ["taskset", "-c", str(cpu)]


class Child:
    """One started process: ``proc``, a name, and its log file."""

    def __init__(self, name: str, proc: subprocess.Popen[bytes], log: Path, stop_signal: int) -> None:
        self.stop_signal = stop_signal
        self.name = name
        self.proc = proc
        self.log = log

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""


class Children:
    """Starts children and guarantees they are stopped (SIGTERM, then SIGKILL after ``grace`` seconds)."""

    def __init__(self, grace: float = 8.0) -> None:
        self.grace = grace
        self.kids: list[Child] = []
        atexit.register(self.stop_all)

    def __enter__(self) -> Children:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def start(self, name: str, argv: list[str], log: Path, *, cwd: Path | None = None,
              env: dict[str, str] | None = None, stop_signal: int = signal.SIGTERM) -> Child:
        """Start ``argv`` (stdout and stderr to ``log``); ``stop_signal`` is sent first when stopping it."""
        log.parent.mkdir(parents=True, exist_ok=True)
        fh = log.open("wb")
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT, cwd=cwd,
                                    env=env, start_new_session=True, preexec_fn=_child_setup)
        finally:
            fh.close()
        child = Child(name, proc, log, stop_signal)
        self.kids.append(child)
        return child

    def stop(self, child: Child) -> int | None:
        """Stop one child gracefully (SIGTERM), SIGKILL if it lingers; returns its exit code."""
        if child.alive():
            with contextlib.suppress(ProcessLookupError):
                child.proc.send_signal(child.stop_signal)
            try:
                child.proc.wait(self.grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    child.proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.proc.wait(5)
        if child in self.kids:
            self.kids.remove(child)
        return child.proc.returncode

    def stop_all(self) -> None:
        # newest first: the gateway before the upstream it talks to
        for child in reversed(list(self.kids)):
            self.stop(child)


def wait_upstream_ready(child: Child, timeout: float = 15.0) -> int:
    """Wait for ``READY <port>`` in the bench upstream's log; returns the port."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in child.log_tail(4000).splitlines():
            if line.startswith("READY "):
                return int(line.split()[1])
        if not child.alive():
            raise RuntimeError(f"the bench upstream exited ({child.proc.returncode}):\n{child.log_tail()}")
        time.sleep(0.02)
    raise RuntimeError(f"the bench upstream did not start within {timeout:g} s:\n{child.log_tail()}")


def wait_http_ready(child: Child, url: str, timeout: float = 30.0) -> None:
    """Poll ``url`` until it answers 200."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not child.alive():
            raise RuntimeError(f"{child.name} exited ({child.proc.returncode}):\n{child.log_tail()}")
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:  # noqa: S310 - loopback only
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{child.name} was not ready at {url} within {timeout:g} s:\n{child.log_tail()}")


def gateway_config(upstream_port: int, redis_url: str | None = None, *, keys: bool = False) -> str:
    """The gateway YAML for one openai-dialect upstream at the bench upstream, model map ``bench: bench``; with
    ``redis_url``, its state shared through that Redis (``state.redis_url``); with ``keys``, gateway keys on
    (``auth``): ``bench.loadgen.BENCH_KEY``, with per-minute request and token limits the bench never reaches."""
    state = f"state: {{redis_url: '{redis_url}'}}\n" if redis_url else ""
    if keys:
        from bench.loadgen import BENCH_KEY  # what the load generator sends

        digest = hashlib.sha256(BENCH_KEY.encode()).hexdigest()
        state += ("auth:\n  keys:\n    - {name: bench, sha256: " + digest + ", limits: {requests_per_minute: "
                  "100000000, tokens_per_minute: 1000000000000}}\n")
    return state + f"""# generated by bench/run.py
default_tier: fast
fallback: false
max_attempts: 1
upstreams:
  - name: bench
    tier: fast
    base_url: http://127.0.0.1:{upstream_port}/v1
    api_key_env: null
    dialect: openai
    timeouts: {{connect: 5, idle: 120, total: 120}}
    models: {{bench: bench}}
"""


def nginx_config(workdir: Path, listen_port: int, upstream_port: int) -> str:
    """A minimal nginx reverse proxy with ``proxy_buffering off`` (one worker, keep-alive to the upstream)."""
    return f"""daemon off;
worker_processes 1;
pid {workdir}/nginx.pid;
error_log {workdir}/nginx-error.log warn;
worker_rlimit_nofile 65536;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {workdir}/nginx-body;
    proxy_temp_path {workdir}/nginx-proxy;
    fastcgi_temp_path {workdir}/nginx-fastcgi;
    uwsgi_temp_path {workdir}/nginx-uwsgi;
    scgi_temp_path {workdir}/nginx-scgi;
    upstream bench {{ server 127.0.0.1:{upstream_port}; keepalive 1024; }}
    server {{
        listen 127.0.0.1:{listen_port};
        location /healthz {{ return 200 '{{"status":"ok"}}'; }}
        location / {{
            proxy_pass http://bench;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 300s;
        }}
    }}
}}
"""


def cpu_ticks(pid: int) -> int:
    """utime + stime + cutime + cstime of ``pid`` in clock ticks (/proc/PID/stat fields 14-17)."""
    with open(f"/proc/{pid}/stat", "rb") as fh:
        data = fh.read()
    fields = data[data.rindex(b")") + 2:].split()
    return int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])


def cpu_split(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of ``pid``, children included."""
    with open(f"/proc/{pid}/stat", "rb") as fh:
        data = fh.read()
    f = data[data.rindex(b")") + 2:].split()
    return (int(f[11]) + int(f[13])) / CLK_TCK, (int(f[12]) + int(f[14])) / CLK_TCK


def cpu_seconds(pid: int) -> float:
    return cpu_ticks(pid) / CLK_TCK


def self_cpu_seconds() -> float:
    """This process's user + system CPU seconds (the load generator)."""
    t = os.times()
    return t.user + t.system


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (scans /proc; e.g. nginx's worker processes)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                data = fh.read()
        except OSError:
            continue
        parent[int(entry)] = int(data[data.rindex(b")") + 2:].split()[1])
    out: list[int] = []
    frontier = [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        frontier += kids
    return out


def rss_bytes(pid: int) -> int:
    """VmRSS of ``pid`` in bytes (/proc/PID/status)."""
    with open(f"/proc/{pid}/status", "rb") as fh:
        for line in fh:
            if line.startswith(b"VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def system_busy_seconds() -> float:
    """CPU seconds all CPUs spent not idle since boot (/proc/stat ``cpu`` line: all but idle and iowait)."""
    with open("/proc/stat", "rb") as fh:
        parts = fh.readline().split()
    vals = [int(v) for v in parts[1:]]
    busy = sum(vals[:8]) - vals[3] - vals[4]  # user nice system idle iowait irq softirq steal
    return busy / CLK_TCK


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "?"


def git_rev() -> str:
    """The checkout's short revision, noting uncommitted changes under ``gateway/`` (what a run measured), or ``?``."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "gateway"], cwd=ROOT, capture_output=True,
                               text=True, timeout=5).stdout.strip()
        return rev + (" (gateway/ has uncommitted changes)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "?"


def python_exe() -> str:
    return sys.executable
