"""A fake sysfs tree of AMD GPUs, laid out as the kernel lays it out, for engine/amd.py's tests.

Under `root` (what amd.read_gpus takes as `sysfs`):
  devices/pci0000:00/0000:00:0N.1/<bdf>/          the PCI device: vendor, device, revision,
      mem_info_vram_total, mem_info_vram_used, product_name, power/runtime_status,
      driver -> ../../../../bus/pci/drivers/amdgpu, drm/renderD<M>/, drm/card<C>/
      (each with `dev` and a `device` link back: ../../../<bdf>)
  class/drm/renderD<M>, class/drm/card<C>          RELATIVE links into devices/
  bus/pci/devices/<bdf>                            a relative link into devices/
  bus/pci/drivers/amdgpu/<bdf>                     the driver's link back
  class/kfd/kfd -> ../../devices/virtual/kfd/kfd   KFD, as on a real host:
      topology/nodes/<n>/{gpu_id,name,properties}  node 0 a CPU (gpu_id 0)
      proc/<pid>/{pasid,vram_<gpu_id>}
Attribute values are written the kernel's way (decimal with a newline, PCI ids "0x%04x") and
replaced atomically (rename), as a reader of sysfs never sees half a value.

Modes: mi300x() (a KFD GPU with unique_id), radeon_apu() (an amdgpu device KFD does not list),
suspend(), break_file() (any bytes, or a directory, or no file), add_proc_entry() (any name:
"12ab"), and release_later(): the holder's exit as KFD tears down, asynchronously.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.helpers import gone

if TYPE_CHECKING:  # the tree alone (bench/bench_scan.py --amd) needs no pytest
    from tests.conftest import GpuHost

GiB = 1 << 30
MI300X = 0x74A1
APU = 0x15BF  # Phoenix (Radeon 780M)

# What a test writes as libdrm's amdgpu.ids: the real file's shape, a few real lines.
AMDGPU_IDS_TEXT = """\
# List of AMDGPU IDs
#
# Syntax:
# device_id,\trevision_id,\tproduct_name        <-- single tab after comma

1.0.0
15BF,\tC1,\tAMD Radeon 780M
15BF,\tC2,\tAMD Radeon 760M
74A1,\t00,\tAMD Instinct MI300X
"""


@dataclass
class FakeGpu:
    bdf: str
    device_dir: Path
    render_minor: int
    card_minor: int
    gpu_id: int = 0  # 0: KFD does not list it
    node: int | None = None
    # pid -> bytes of that process in KFD's proc entries (what release_later frees)
    holders: dict[int, int] = field(default_factory=dict)


class AmdSysfs:
    """A fake sysfs at `root`; `sysfs` is what read_gpus() takes."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.sysfs = str(root)
        self.kfd = root / "devices/virtual/kfd/kfd"
        self.gpus: list[FakeGpu] = []
        self.timers: list[threading.Timer] = []
        self._nodes = 0
        (root / "class/drm").mkdir(parents=True, exist_ok=True)
        (root / "bus/pci/devices").mkdir(parents=True, exist_ok=True)
        (root / "bus/pci/drivers/amdgpu").mkdir(parents=True, exist_ok=True)

    # -- writing, the kernel's way --------------------------------------------------------------

    @staticmethod
    def write(path: Path, text: str | bytes) -> None:
        """Replace `path` whole (a reader sees the old value or the new, never half)."""
        data = text.encode() if isinstance(text, str) else text
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(path.name + ".new")
        temporary.write_bytes(data)
        os.replace(temporary, path)

    def _kfd_tree(self) -> None:
        if (self.root / "class/kfd/kfd").is_symlink():
            return
        (self.kfd / "proc").mkdir(parents=True)
        (self.root / "class/kfd").mkdir(parents=True)
        os.symlink("../../devices/virtual/kfd/kfd", self.root / "class/kfd/kfd")
        self._node("CPU", 0, {"cpu_cores_count": 64, "simd_count": 0, "drm_render_minor": 0})

    def _node(self, name: str, gpu_id: int, props: dict[str, int]) -> int:
        number = self._nodes
        self._nodes += 1
        node = self.kfd / "topology/nodes" / str(number)
        self.write(node / "gpu_id", f"{gpu_id}\n")
        self.write(node / "name", f"{name}\n")
        self.write(node / "properties", "".join(f"{k} {v}\n" for k, v in props.items()))
        return number

    # -- GPUs ----------------------------------------------------------------------------------

    def add_pci_gpu(self, bdf: str, device: int, *, revision: int = 0, render_minor: int = 128,
                    card_minor: int = 1, vram_total: int = 192 * GiB, vram_used: int = 300 << 20,
                    runtime_status: str | None = "active", product_name: str | None = None,
                    driver: str = "amdgpu") -> FakeGpu:
        """The PCI device, its DRM nodes and every link to them; KFD does not list it (yet)."""
        slot = len(self.gpus) + 1
        domain = bdf.split(":", maxsplit=1)[0]
        bridge = f"devices/pci{domain}:00/{domain}:00:{slot:02x}.1"
        rel = f"{bridge}/{bdf}"
        dev = self.root / rel
        values = {"vendor": "0x1002", "device": f"0x{device:04x}", "revision": f"0x{revision:02x}",
                  "mem_info_vram_total": str(vram_total), "mem_info_vram_used": str(vram_used)}
        for key, value in values.items():
            self.write(dev / key, value + "\n")
        if product_name is not None:
            self.write(dev / "product_name", product_name + "\n")
        if runtime_status is not None:
            self.write(dev / "power/runtime_status", runtime_status + "\n")
        bound = self.root / "bus/pci/drivers" / driver
        bound.mkdir(parents=True, exist_ok=True)
        os.symlink(f"../../../../bus/pci/drivers/{driver}", dev / "driver")
        os.symlink(f"../../../../{rel}", bound / bdf)
        os.symlink(f"../../../{rel}", self.root / "bus/pci/devices" / bdf)
        for node, minor in ((f"renderD{render_minor}", render_minor), (f"card{card_minor}", card_minor)):
            self.write(dev / "drm" / node / "dev", f"226:{minor}\n")
            os.symlink(f"../../../{bdf}", dev / "drm" / node / "device")
            os.symlink(f"../../{rel}/drm/{node}", self.root / "class/drm" / node)
        gpu = FakeGpu(bdf=bdf, device_dir=dev, render_minor=render_minor, card_minor=card_minor)
        self.gpus.append(gpu)
        return gpu

    def add_kfd_node(self, gpu: FakeGpu, gpu_id: int, *, device: int, unique_id: int | None) -> None:
        """KFD's topology node for `gpu` (after the CPU node), as kfd_topology.c prints it."""
        self._kfd_tree()
        domain, bus, rest = gpu.bdf.split(":")
        slot, function = rest.split(".")
        props = {"cpu_cores_count": 0, "simd_count": 1216, "vendor_id": 0x1002, "device_id": device,
                 "location_id": int(bus, 16) << 8 | int(slot, 16) << 3 | int(function),
                 "domain": int(domain, 16), "drm_render_minor": gpu.render_minor, "hive_id": 0}
        if unique_id is not None:
            props["unique_id"] = unique_id
        gpu.gpu_id = gpu_id
        gpu.node = self._node("gfx942", gpu_id, props)

    def mi300x(self, bdf: str = "0000:c3:00.0", *, gpu_id: int = 53987, render_minor: int = 128,
               card_minor: int = 1, unique_id: int | None = 0x9A5D4F3C2B1E0D07,
               vram_used: int = 300 << 20, runtime_status: str | None = "active",
               product_name: str | None = None) -> FakeGpu:
        """An MI300X (0x74a1) with KFD: a topology node, a unique_id, proc entries possible."""
        gpu = self.add_pci_gpu(bdf, MI300X, render_minor=render_minor, card_minor=card_minor,
                               vram_used=vram_used, runtime_status=runtime_status,
                               product_name=product_name)
        self.add_kfd_node(gpu, gpu_id, device=MI300X, unique_id=unique_id)
        return gpu

    def radeon_apu(self, bdf: str = "0000:65:00.0", *, render_minor: int = 129, card_minor: int = 0,
                   revision: int = 0xC1, runtime_status: str | None = "active",
                   product_name: str | None = None) -> FakeGpu:
        """A Radeon 780M APU that KFD does not list: class/drm alone, 512 MiB carve-out."""
        return self.add_pci_gpu(bdf, APU, revision=revision, render_minor=render_minor,
                                card_minor=card_minor, vram_total=512 << 20, vram_used=60 << 20,
                                runtime_status=runtime_status, product_name=product_name)

    # -- modes ---------------------------------------------------------------------------------

    def suspend(self, gpu: FakeGpu, status: str = "suspended", trap: bool = True) -> None:
        """Runtime-suspend `gpu`; with `trap`, its mem_info files become directories, so an
        attempt to read them fails (and shows as an error) instead of passing unseen."""
        self.write(gpu.device_dir / "power/runtime_status", status + "\n")
        if trap:
            for name in ("mem_info_vram_total", "mem_info_vram_used"):
                (gpu.device_dir / name).unlink()
                (gpu.device_dir / name).mkdir()

    def break_file(self, path: Path, content: str | bytes | None) -> None:
        """`path` now holds `content` (bytes as they are), or is gone (None)."""
        if content is None:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
        else:
            self.write(path, content)

    def add_proc_entry(self, name: str, files: dict[str, str]) -> Path:
        """KFD's proc/<name>/ with `files` as they are: any name, any content."""
        self._kfd_tree()
        entry = self.kfd / "proc" / name
        for file, text in files.items():
            self.write(entry / file, text)
        return entry

    def add_process(self, pid: int, uses: dict[int, int], pasid: int = 0x8001) -> None:
        """Process `pid` holding {gpu_id: bytes} through KFD; used memory goes up to match."""
        files = {"pasid": f"{pasid}\n"}
        for gpu_id, size in uses.items():
            files[f"vram_{gpu_id}"] = f"{size}\n"
            gpu = self.by_gpu_id(gpu_id)
            gpu.holders[pid] = size
            self.set_used(gpu, self.used(gpu) + size)
        self.add_proc_entry(str(pid), files)

    def by_gpu_id(self, gpu_id: int) -> FakeGpu:
        return next(gpu for gpu in self.gpus if gpu.gpu_id == gpu_id)

    def used(self, gpu: FakeGpu) -> int:
        return int((gpu.device_dir / "mem_info_vram_used").read_text())

    def set_used(self, gpu: FakeGpu, value: int) -> None:
        self.write(gpu.device_dir / "mem_info_vram_used", f"{value}\n")

    def release_later(self, pid: int, memory_after: float = 0.3, entry_after: float = 0.6
                      ) -> list[threading.Timer]:
        """What KFD does once holder `pid` has exited, later, as its release worker does
        (kfd_process_wq_release): the GPUs' used memory drops after `memory_after` seconds,
        proc/<pid> goes after `entry_after`; until then the entry outlives the PID."""

        def free() -> None:
            for gpu in self.gpus:
                size = gpu.holders.pop(pid, 0)
                if size:
                    self.set_used(gpu, max(0, self.used(gpu) - size))

        def remove() -> None:
            shutil.rmtree(self.kfd / "proc" / str(pid), ignore_errors=True)

        timers = [threading.Timer(memory_after, free), threading.Timer(entry_after, remove)]
        for timer in timers:
            timer.daemon = True
            timer.start()
        self.timers += timers
        return timers

    def close(self) -> None:
        """Cancel and wait for what release_later started (a test's teardown)."""
        for timer in self.timers:
            timer.cancel()
            timer.join()


def write_amdgpu_ids(path: Path, text: str = AMDGPU_IDS_TEXT) -> str:
    path.write_text(text)
    return str(path)


# -- a host: the fake tree beside tests/conftest.py's GpuHost ------------------------------------


@dataclass
class AmdHost:
    host: GpuHost
    sysfs: AmdSysfs
    gpus: list[FakeGpu]
    kfd: str
    render: list[str]
    watchers: list[threading.Thread] = field(default_factory=list)

    def release_after_exit(self, pid: int, memory_after: float, entry_after: float) -> None:
        """KFD's teardown of `pid`, once it has exited: memory and proc entry go later."""
        def watch() -> None:
            deadline = time.monotonic() + 60
            while not gone(pid) and time.monotonic() < deadline:
                time.sleep(0.01)
            self.sysfs.release_later(pid, memory_after, entry_after)
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        self.watchers.append(watcher)

    def no_nvml_env(self) -> dict[str, str]:
        """The host's environment without the fake libnvidia-ml: NVML is not installed."""
        env = dict(self.host.env)
        env.pop("LD_LIBRARY_PATH", None)
        return env

    def close(self) -> None:
        for pid in [p.pid for p in self.host.procs]:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
        for watcher in self.watchers:
            watcher.join(timeout=70)
        self.sysfs.close()

    def holder(self, gpu: FakeGpu | None, vram: int = 0, *, kfd: bool = True, comm: str = "vllm-rocm") -> int:
        """A ROCm-like process: /dev/kfd, `gpu`'s render node, and KFD's entry of `vram` bytes."""
        holds = ([self.kfd] if kfd else []) + ([self.render[self.gpus.index(gpu)]] if gpu else [])
        args = [a for node in holds for a in ("--hold", node)]
        pid = self.host.spawn("--comm", comm, *args).pid
        if gpu is not None and vram:
            self.sysfs.add_process(pid, {gpu.gpu_id: vram})
        return pid

    def cli_json(self, *args: str, env: dict[str, str] | None = None) -> tuple[int, Any]:
        done = self.cli(*args, "--json", env=env)
        return done.returncode, json.loads(done.stdout) if done.stdout.strip() else None

    def cli(self, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "gpuguardd.cli.main", *args, "--local", "--config",
                               str(self.host.config_path)], check=False, env=env or self.host.env,
                              capture_output=True, text=True, timeout=60)


def make_amd_host(host: GpuHost, tmp_path: Path, *, nvidia: bool) -> AmdHost:
    """Two fake MI300X beside `host`'s fake NVML (or alone: `nvidia` False configures no NVIDIA
    node), with /dev/kfd and their render nodes mknod'd in its /dev."""
    fake = AmdSysfs(tmp_path / "sys")
    base = random.randrange(1, 1 << 17) * 4 + 128
    gpus = [fake.mi300x("0000:c3:00.0", gpu_id=41234, render_minor=base, card_minor=1),
            fake.mi300x("0000:c4:00.0", gpu_id=52345, render_minor=base + 1, card_minor=2,
                        unique_id=0x1122334455667788)]
    kfd = str(host.dev / "kfd")
    os.mknod(kfd, 0o666 | 0o020000, os.makedev(120, base + 2))
    render = []
    for gpu in gpus:
        path = str(host.dev / f"renderD{gpu.render_minor}")
        os.mknod(path, 0o666 | 0o020000, os.makedev(120, gpu.render_minor))
        render.append(path)
    paths = f"Paths={host.dev}/nvidia*\n" if nvidia else ""
    host.write_config("[Devices]\nPaths=\n" + paths + f"Paths={kfd} {host.dev}/renderD*\n"
                      f"SysfsPath={fake.sysfs}\n")
    return AmdHost(host, fake, gpus, kfd, render)
