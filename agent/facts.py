"""What this machine is: host facts from psutil, backends and devices from the frameworks'
own queries, and the memory each device can offer for weights and KV after an OS floor.

The frameworks are queried in a child process (`python -m agent.facts`), so the agent never
holds a CUDA context or a Metal device of its own and a broken driver cannot take it down.
Turning raw numbers into usable memory is a pure function (`build_facts`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import json
import os
import platform
import socket
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import psutil

BACKEND_EVENT = "backends"  # the probe child's one JSON line: {"event": "backends", ...}


@dataclass(frozen=True)
class HostFacts:
    node: str
    hostname: str
    platform: str  # sys.platform: linux, darwin
    os: str  # platform.platform()
    arch: str  # platform.machine(): x86_64, aarch64, arm64
    python: str
    cores_physical: int
    cores_logical: int
    ram_total_bytes: int
    ram_available_bytes: int
    unified_memory: bool  # CPU and GPU share one memory (Apple silicon, GB10)
    os_floor_bytes: int
    gpu_wired_limit_bytes: int | None  # macOS: what Metal may wire; None elsewhere


@dataclass(frozen=True)
class DeviceFacts:
    backend: str
    index: int
    name: str
    memory_total_bytes: int
    memory_usable_bytes: int  # for weights and KV, after the OS floor or framework reserve
    unified: bool


@dataclass(frozen=True)
class BackendFacts:
    backend: str  # torch-cuda, torch-mps, torch-cpu, mlx-metal, mlx-cuda, mlx-cpu
    framework: str  # torch, mlx
    framework_version: str
    present: bool
    reason: str  # why it is absent; empty when present
    devices: tuple[DeviceFacts, ...] = ()


@dataclass(frozen=True)
class Facts:
    host: HostFacts
    backends: tuple[BackendFacts, ...]
    engine_version: str
    collected_at: float

    @property
    def present_backends(self) -> frozenset[str]:
        return frozenset(b.backend for b in self.backends if b.present)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def digest(self) -> str:
        """Changes when a fact the supervisor plans with changes (not free RAM or the clock)."""
        stable = self.to_dict()
        stable.pop("collected_at")
        stable["host"].pop("ram_available_bytes")
        return hashlib.sha256(json.dumps(stable, sort_keys=True).encode()).hexdigest()[:16]


# --- host -------------------------------------------------------------------------------

def _sysctl_int(name: str) -> int | None:
    """A macOS integer sysctl, read through libc (no child process, no /proc)."""
    libc_name = ctypes.util.find_library("c")
    if not libc_name:
        return None
    libc = ctypes.CDLL(libc_name, use_errno=True)
    value = ctypes.c_uint64(0)
    size = ctypes.c_size_t(ctypes.sizeof(value))
    if libc.sysctlbyname(name.encode(), ctypes.byref(value), ctypes.byref(size), None, 0) != 0:
        return None
    return int(value.value) if size.value in (4, 8) else None


def gpu_wired_limit_bytes() -> int | None:
    """macOS's `iogpu.wired_limit_mb` when set (0 means the system default); else None."""
    if sys.platform != "darwin":
        return None
    mb = _sysctl_int("iogpu.wired_limit_mb")
    return mb << 20 if mb else None


def host_facts(node: str, os_floor_bytes: int, unified: bool | None = None) -> HostFacts:
    memory = psutil.virtual_memory()
    apple_silicon = sys.platform == "darwin" and platform.machine() == "arm64"
    return HostFacts(
        node=node, hostname=socket.gethostname(), platform=sys.platform,
        os=platform.platform(), arch=platform.machine(), python=platform.python_version(),
        cores_physical=psutil.cpu_count(logical=False) or psutil.cpu_count() or 1,
        cores_logical=psutil.cpu_count() or 1,
        ram_total_bytes=memory.total, ram_available_bytes=memory.available,
        unified_memory=apple_silicon if unified is None else unified,
        os_floor_bytes=os_floor_bytes, gpu_wired_limit_bytes=gpu_wired_limit_bytes(),
    )


# --- backends (run in the probe child) --------------------------------------------------

def _absent(backend: str, framework: str, version: str, reason: str) -> dict[str, Any]:
    return {"backend": backend, "framework": framework, "version": version, "present": False,
            "reason": reason, "devices": []}


def probe_torch() -> list[dict[str, Any]]:
    try:
        import torch
    except ImportError as exc:
        return [_absent(b, "torch", "", f"PyTorch is not installed ({exc})")
                for b in ("torch-cuda", "torch-mps", "torch-cpu")]
    version = torch.__version__
    out = []
    if torch.cuda.is_available():
        devices = []
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            devices.append({"index": i, "name": props.name,
                            "memory_total_bytes": int(props.total_memory),
                            "integrated": bool(getattr(props, "is_integrated", False))})
        out.append({"backend": "torch-cuda", "framework": "torch", "version": version,
                    "present": True, "reason": "", "devices": devices,
                    "cuda": torch.version.cuda or ""})
    else:
        why = ("this PyTorch build has no CUDA" if not torch.version.cuda
               else "no CUDA device is visible")
        out.append(_absent("torch-cuda", "torch", version, why))
    if torch.backends.mps.is_available():
        recommended = None
        if hasattr(torch.mps, "recommended_max_memory"):
            recommended = int(torch.mps.recommended_max_memory())
        out.append({"backend": "torch-mps", "framework": "torch", "version": version,
                    "present": True, "reason": "", "devices": [{
                        "index": 0, "name": "mps", "memory_total_bytes": None,
                        "integrated": True, "recommended_max_bytes": recommended}]})
    else:
        out.append(_absent("torch-mps", "torch", version, "Metal (MPS) is not available"))
    out.append({"backend": "torch-cpu", "framework": "torch", "version": version,
                "present": True, "reason": "", "devices": [{
                    "index": 0, "name": platform.processor() or platform.machine(),
                    "memory_total_bytes": None, "integrated": True}]})
    return out


def probe_mlx() -> list[dict[str, Any]]:
    try:
        import mlx.core as mx
    except ImportError as exc:
        return [_absent(b, "mlx", "", f"MLX is not installed ({exc})")
                for b in ("mlx-metal", "mlx-cuda", "mlx-cpu")]
    version = getattr(mx, "__version__", "")
    out = []
    info: dict[str, Any] = {}
    try:
        info = dict(mx.device_info())
    except (AttributeError, RuntimeError):  # older MLX: metal.device_info only
        try:
            info = dict(mx.metal.device_info())
        except (AttributeError, RuntimeError):
            info = {}
    name = str(info.get("device_name") or info.get("architecture") or "")
    gpu_device = {"index": 0, "name": name, "memory_total_bytes": info.get("memory_size"),
                  "integrated": True,
                  "recommended_max_bytes": info.get("max_recommended_working_set_size")}
    if mx.metal.is_available():
        out.append({"backend": "mlx-metal", "framework": "mlx", "version": version,
                    "present": True, "reason": "", "devices": [gpu_device]})
    else:
        out.append(_absent("mlx-metal", "mlx", version, "Metal is not available to MLX"))
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        out.append({"backend": "mlx-cuda", "framework": "mlx", "version": version,
                    "present": True, "reason": "", "devices": [dict(gpu_device, integrated=False)]})
    else:
        out.append(_absent("mlx-cuda", "mlx", version, "this MLX build has no CUDA device"))
    out.append({"backend": "mlx-cpu", "framework": "mlx", "version": version, "present": True,
                "reason": "", "devices": [{"index": 0, "name": name or platform.machine(),
                                           "memory_total_bytes": None, "integrated": True}]})
    return out


def probe_backends() -> list[dict[str, Any]]:
    return probe_torch() + probe_mlx()


# --- raw numbers -> facts (pure) --------------------------------------------------------

def usable_bytes(backend: str, device: dict[str, Any], host: HostFacts,
                 gpu_reserve_bytes: int) -> tuple[int, int, bool]:
    """(total, usable, unified) for one device: what weights and KV may take on it."""
    after_floor = max(0, host.ram_total_bytes - host.os_floor_bytes)
    kind = backend.split("-", 1)[1]
    if kind == "cpu":
        return host.ram_total_bytes, after_floor, True
    if kind in ("mps", "metal"):
        limit = host.gpu_wired_limit_bytes or device.get("recommended_max_bytes") or after_floor
        return host.ram_total_bytes, min(int(limit), after_floor), True
    total = int(device.get("memory_total_bytes") or 0)
    if device.get("integrated"):  # GB10 and other unified CUDA parts: the floor applies
        return total, max(0, min(total, host.ram_total_bytes) - host.os_floor_bytes), True
    return total, max(0, total - gpu_reserve_bytes), False


def build_facts(host: HostFacts, probed: list[dict[str, Any]], engine_version: str,
                gpu_reserve_bytes: int, now: float) -> Facts:
    backends = []
    unified_gpu = False
    for raw in probed:
        devices = []
        for dev in raw.get("devices", ()):
            total, usable, unified = usable_bytes(raw["backend"], dev, host, gpu_reserve_bytes)
            unified_gpu |= unified and raw["backend"].endswith(("cuda", "mps", "metal"))
            devices.append(DeviceFacts(raw["backend"], int(dev.get("index", 0)),
                                       str(dev.get("name", "")), total, usable, unified))
        backends.append(BackendFacts(raw["backend"], raw["framework"], raw.get("version", ""),
                                     bool(raw["present"]), raw.get("reason", ""), tuple(devices)))
    if unified_gpu and not host.unified_memory:
        from dataclasses import replace

        host = replace(host, unified_memory=True)
    return Facts(host, tuple(backends), engine_version, now)


def engine_version() -> str:
    try:
        from engine import ENGINE_VERSION
    except ImportError:
        return "unknown"
    return ENGINE_VERSION


def collect_facts(node: str, os_floor_bytes: int, gpu_reserve_bytes: int,
                  probed: list[dict[str, Any]] | None = None) -> Facts:
    """All facts in this process (the CLI's `fleet-agent facts`); the agent probes in a child."""
    probed = probe_backends() if probed is None else probed
    return build_facts(host_facts(node, os_floor_bytes), probed, engine_version(),
                       gpu_reserve_bytes, time.time())


class FactsService:
    """The agent's current facts: host facts refreshed on a timer, backends probed in a child
    at start and on demand."""

    def __init__(self, node: str, os_floor_bytes: int, gpu_reserve_bytes: int, logs_dir: Any,
                 probe_timeout_s: float = 120.0) -> None:
        self.node = node
        self.os_floor_bytes = os_floor_bytes
        self.gpu_reserve_bytes = gpu_reserve_bytes
        self.logs_dir = logs_dir
        self.probe_timeout_s = probe_timeout_s
        self.probed: list[dict[str, Any]] = []
        self.probe_error = ""
        self.current: Facts | None = None
        self._probed: Any = None  # an asyncio.Event, made inside the running loop

    def _event(self) -> Any:
        import asyncio

        if self._probed is None:
            self._probed = asyncio.Event()
        return self._probed

    async def wait_probed(self, timeout_s: float) -> bool:
        """Wait for the first backend probe (a spawn needs to know the backends)."""
        import asyncio

        try:
            await asyncio.wait_for(self._event().wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def probe(self) -> None:
        """Run `python -m agent.facts` under the child wrapper and keep what it reports."""
        import asyncio
        import signal
        from pathlib import Path

        from agent.child import ChildProcess, GracePeriods, RotatingLog

        found: list[dict[str, Any]] = []

        def on_line(_line: str, event: dict | None) -> None:
            if event and event.get("event") == BACKEND_EVENT:
                found.append(event)

        env = {k: v for k, v in os.environ.items() if k not in ("CUDA_LAUNCH_BLOCKING",)}
        child = ChildProcess.spawn("backend probe", [sys.executable, "-m", "agent.facts"], env,
                                   RotatingLog(Path(self.logs_dir) / "backend-probe.log",
                                               1 << 20, 1), from_start=False, on_line=on_line)
        try:
            exit_ = await child.wait(self.probe_timeout_s)
        except asyncio.CancelledError:  # the agent is stopping: the probe goes with it
            child.signal_group(signal.SIGKILL)
            raise
        if exit_ is None:
            exit_ = await child.stop(GracePeriods(term_s=2.0, kill_s=2.0))
        if found:
            self.probed, self.probe_error = found[-1]["backends"], ""
        else:
            self.probe_error = (f"the backend probe failed: "
                                f"{exit_.reason if exit_ else 'it would not exit'}")
        self.refresh_host()
        self._event().set()

    def refresh_host(self) -> Facts:
        self.current = build_facts(host_facts(self.node, self.os_floor_bytes), self.probed,
                                   engine_version(), self.gpu_reserve_bytes, time.time())
        return self.current

    def present_backends(self) -> frozenset[str]:
        return self.current.present_backends if self.current else frozenset()


def main() -> int:
    """The probe child: one JSON line with every backend's raw facts, then exit."""
    started = time.monotonic()
    backends = probe_backends()
    sys.stdout.write(json.dumps({"event": BACKEND_EVENT, "backends": backends,
                                 "elapsed_s": round(time.monotonic() - started, 3),
                                 "pid": os.getpid()}) + "\n")
    sys.stdout.write(json.dumps({"event": "exiting", "code": 0, "reason": "probe done"}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
