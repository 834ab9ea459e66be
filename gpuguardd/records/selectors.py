"""How a caller names a GPU (an index, a GPU or MIG UUID, a PCI bus id), read and matched for
the engine, gpuguardctl's client and `check`; each says what an unknown one means to it. UUIDs
match in any case (NVML "GPU-4e1f…"), a bus id in any case and domain width (NVML's 8 digits).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from gpuguardd.errors import InvalidArgument
from gpuguardd.numbers import is_digits, parse_uint

INDEX = "index"
GPU_UUID = "gpu-uuid"
MIG_UUID = "mig-uuid"
PCI = "pci"

_UUID = re.compile(r"^(GPU|MIG)-[0-9A-Fa-f-]{8,}$")
_MIG_UUID = re.compile(r"^MIG-[0-9A-F-]{8,}$", re.IGNORECASE)
# domain:bus:device.function, the domain 4 (the kernel) or 8 (NVML) hex digits.
_PCI = re.compile(r"^(?:[0-9A-Fa-f]{4}|[0-9A-Fa-f]{8}):[0-9A-Fa-f]{2}:[0-1][0-9A-Fa-f]\.[0-7]$")


@dataclass(frozen=True)
class KnownGpu:
    index: int
    uuid: str = ""
    mig: tuple[str, ...] = ()
    pci_bus_id: str = ""


@dataclass(frozen=True)
class Selected:
    index: int
    mig: str = ""  # the MIG instance's UUID as the GPU list spells it, when one is named


@dataclass(frozen=True)
class Selector:
    kind: str  # INDEX, GPU_UUID, MIG_UUID or PCI; "" for text that names no GPU
    text: str  # as given, stripped
    index: int = -1  # for INDEX

    def find(self, gpus: Iterable[KnownGpu]) -> list[Selected]:
        if self.kind == INDEX:
            return [Selected(g.index) for g in gpus if g.index == self.index]
        if self.kind == MIG_UUID:
            return [Selected(g.index, m) for g in gpus for m in g.mig if m.lower() == self.text.lower()]
        if self.kind == GPU_UUID:
            return [Selected(g.index) for g in gpus if g.uuid and g.uuid.lower() == self.text.lower()]
        if self.kind == PCI:
            return [Selected(g.index) for g in gpus if g.pci_bus_id and pci_key(g.pci_bus_id) == pci_key(self.text)]
        return []

    @property
    def well_formed(self) -> bool:
        """A MIG UUID as current drivers spell them (MIG- and hex), not the pre-R470 form."""
        return self.kind != MIG_UUID or bool(_MIG_UUID.match(self.text))

    def check(self) -> Selector:
        if not self.kind:
            raise InvalidArgument(f"invalid GPU {self.text!r}: expected an index, a GPU-/MIG- UUID or a "
                                  "PCI bus id (0000:c3:00.0)")
        return self


def selector(item: object) -> Selector:
    text = str(item).strip()
    if isinstance(item, int) or is_digits(text):
        # BadNumber names a negative index or one past 2^32-1 (the bus carries a `u`); U+00B2
        # and U+0660 are not digits here, so they name no GPU (check() says so).
        return Selector(INDEX, text, parse_uint(text, "GPU index"))
    if text.upper().startswith("MIG-"):
        return Selector(MIG_UUID, text)
    if _UUID.match(text):
        return Selector(GPU_UUID, text)
    if _PCI.match(text):
        return Selector(PCI, text)
    return Selector("", text)


def one_gpu(indices: Iterable[int], text: str) -> int:
    found = list(indices)
    if len(found) != 1 or selector(text).kind == MIG_UUID:
        raise InvalidArgument(f"--gpu {text!r} must name one whole GPU")
    return found[0]


def pci_key(bus_id: str) -> str:
    """"00000000:18:00.0" (NVML) and "0000:18:00.0" (the kernel) as one spelling, lower case."""
    text = bus_id.strip().lower()
    domain, sep, rest = text.partition(":")
    if not sep or not domain or len(domain) > 8 or any(c not in "0123456789abcdef" for c in domain):
        return text
    return f"{int(domain, 16):04x}:{rest}"
