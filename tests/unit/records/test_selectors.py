"""GPU selectors (gpuguardd/records/selectors.py): the one reading of an index, a GPU UUID and a
MIG UUID that the engine, gpuguardctl's client and `gpuguardctl check` share."""

from __future__ import annotations

import pytest

from gpuguardd.errors import InvalidArgument
from gpuguardd.records.selectors import (
    GPU_UUID,
    INDEX,
    MIG_UUID,
    PCI,
    KnownGpu,
    Selected,
    pci_key,
    selector,
)

G0 = "GPU-00000000-0000-4000-8000-000000000000"
G1 = "GPU-00000000-0000-4000-8000-000000000001"
M1 = "MIG-1a2b3c4d-0000-4000-8000-00000000000a"
OLD_MIG = "MIG-GPU-00000000-0000-4000-8000-000000000001/1/0"  # before driver R470
GPUS = [KnownGpu(0, G0), KnownGpu(1, G1, (M1, OLD_MIG)), KnownGpu(3, "")]


@pytest.mark.parametrize(("item", "kind"), [
    (0, INDEX), ("2", INDEX), (" 3 ", INDEX), (G0, GPU_UUID), (G0.lower().replace("gpu", "GPU"), GPU_UUID),
    (M1, MIG_UUID), (M1.lower(), MIG_UUID), (OLD_MIG, MIG_UUID), ("gpu-0000abcd", ""), ("GPU-xyz", ""),
    ("-1", ""), ("", ""), ("nvidia0", ""), ("1,2", "")])
def test_kinds(item: object, kind: str) -> None:
    assert selector(item).kind == kind


def test_find_by_index_uuid_and_mig_uuid_in_any_case() -> None:
    assert selector(1).find(GPUS) == [Selected(1)]
    assert selector("3").find(GPUS) == [Selected(3)]
    assert selector("2").find(GPUS) == []
    assert selector(G1.lower().replace("gpu", "GPU")).find(GPUS) == [Selected(1)]
    assert selector(M1.upper().replace("MIG", "mig")).find(GPUS) == [Selected(1, M1)]  # NVML's spelling
    assert selector("GPU-00000000-0000-4000-8000-00000000000f").find(GPUS) == []
    assert selector("nvidia0").find(GPUS) == []


def test_old_mig_form_is_found_but_not_well_formed() -> None:
    chosen = selector(OLD_MIG)
    assert chosen.find(GPUS) == [Selected(1, OLD_MIG)]
    assert not chosen.well_formed and selector(M1).well_formed and selector(G0).well_formed


def test_check_names_the_bad_value() -> None:
    with pytest.raises(InvalidArgument,
                       match=r"invalid GPU 'nvidia\\\\n0': expected an index, a GPU-/MIG- UUID or a PCI bus id"):
        selector("nvidia\\n0").check()
    assert selector(" 2 ").check().index == 2


@pytest.mark.parametrize("text", ["0000:c3:00.0", "0000:C3:00.0", "00000000:c3:00.0", " 00000000:C3:00.0 "])
def test_a_pci_bus_id_in_either_spelling_names_its_gpu(text: str) -> None:
    gpus = [KnownGpu(0, G0, (), "00000000:18:00.0"), KnownGpu(2, "", (), "0000:c3:00.0")]
    assert selector(text).kind == PCI
    assert selector(text).find(gpus) == [Selected(2)]
    assert selector("0000:18:00.0").find(gpus) == [Selected(0)]
    assert selector("0000:c4:00.0").find(gpus) == []


@pytest.mark.parametrize("text", ["000:c3:00.0", "0000:c3:00.8", "0000:c3:20.0", "c3:00.0", "0000:\u0663\u0663:00.0",
                                  "0000:c3:00.0.1", "00000:c3:00.0"])
def test_what_is_no_pci_bus_id(text: str) -> None:
    assert selector(text).kind == ""
    with pytest.raises(InvalidArgument, match="PCI bus id"):
        selector(text).check()


def test_pci_key_is_one_spelling() -> None:
    assert pci_key("00000000:C3:00.0") == pci_key("0000:c3:00.0") == "0000:c3:00.0"
    assert pci_key("0001:c3:00.0") == "0001:c3:00.0"
