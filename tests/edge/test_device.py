"""Device profiles: the registry, budgets, and detecting this machine."""

from __future__ import annotations

import pytest

from edgecloud.edge.device import PROFILES, DeviceProfile, detect_device, device_names, get_device
from edgecloud.errors import InvalidRequestError

GiB = 1024**3


def test_named_profiles_exist_with_budgets_below_ram() -> None:
    for name in ("phone-8gb", "laptop-16gb", "mac-16gb", "server-24gb"):
        profile = get_device(name)
        assert profile.name == name
        assert 0 < profile.budget_bytes <= profile.total_bytes
        assert profile.description


def test_phone_is_cpu_only_and_leaves_the_os_half_of_ram() -> None:
    phone = get_device("phone-8gb")
    assert phone.gpu_bytes == 0 and not phone.has_gpu
    assert phone.budget_bytes <= phone.total_bytes // 2


def test_mac_is_unified_memory_within_metal_working_set() -> None:
    mac = get_device("mac-16gb")
    assert mac.unified_memory and mac.has_gpu
    # Metal's recommended working set is ~2/3 of RAM on a 16 GiB Mac
    assert mac.gpu_bytes <= mac.total_bytes * 3 // 4


def test_unknown_device_names_the_known_profiles() -> None:
    with pytest.raises(InvalidRequestError) as info:
        get_device("toaster-1gb")
    message = str(info.value)
    for name in (*PROFILES, "this"):
        assert name in message
    assert info.value.param == "device"


def test_detect_device_reports_this_machine() -> None:
    this = detect_device()
    assert this.name == "this"
    assert this.cpu_threads >= 1
    assert 0 < this.budget_bytes <= this.total_bytes
    assert get_device("this").name == "this"
    assert "this" in device_names()


def test_profile_passes_through_and_validates() -> None:
    custom = DeviceProfile(name="tiny", description="test", total_bytes=2 * GiB, budget_bytes=GiB)
    assert get_device(custom) is custom
    assert custom.to_dict()["budget_bytes"] == GiB
    with pytest.raises(InvalidRequestError):
        DeviceProfile(name="bad", description="test", total_bytes=GiB, budget_bytes=2 * GiB)


def test_planning_for_llama_cpp_never_imports_torch() -> None:
    # importing torch to look for a GPU cost a llama.cpp process ~180 MiB it never used
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from edgecloud.edge.device import detect_device\n"
        "from edgecloud.edge.memory import plan\n"
        "detect_device(); plan('smollm2-135m-instruct-q4', 'this', ctx=512)\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
