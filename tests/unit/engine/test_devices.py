"""engine/devices.py: which device nodes are GPUs' (the rest is tests/host/test_discovery.py)."""

from __future__ import annotations

import os

from gpuguardd.engine.devices import DeviceMap, role_for_name


def test_a_drm_node_counts_only_where_amdgpu_drives_it() -> None:
    # DRM's major is every DRM driver's: an Intel iGPU's render node or a BMC's card0 is no GPU
    # of gpuguard's, and its holders are no holders.
    drm = DeviceMap(majors={226: "drm", 240: "kfd"}, amd_minors=frozenset({128, 1}))
    render = drm.node_for_rdev(os.makedev(226, 128))
    card = drm.node_for_rdev(os.makedev(226, 1))
    assert render is not None and (render.role, render.minor) == ("render", 128)
    assert card is not None and (card.role, card.minor) == ("card", 1)
    assert drm.node_for_rdev(os.makedev(226, 129)) is None  # the iGPU's renderD129
    assert drm.node_for_rdev(os.makedev(226, 0)) is None
    kfd = drm.node_for_rdev(os.makedev(240, 0))
    assert kfd is not None and kfd.role == "kfd"


def test_amd_node_names() -> None:
    assert role_for_name("/dev/kfd") == ("kfd", None)
    assert role_for_name("/dev/dri/renderD128") == ("render", 128)
    assert role_for_name("/dev/dri/card0") == ("card", 0)
    assert role_for_name("/dev/nvidia3") == ("gpu", 3)
    # Only ASCII digits name a minor.
    assert role_for_name("/dev/dri/renderD\u0661\u0662\u0668")[0] == "control"
