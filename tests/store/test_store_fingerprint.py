"""Hardware fingerprints and their differences."""

from __future__ import annotations

import json
import os

import pytest
from conftest import GIB, make_fingerprint

from autobalance import ConfigError
from autobalance.protocol import cpu_model_name
from autobalance.store import (
    HardwareFingerprint,
    cap_lifted_note,
    current_fingerprint,
    differences,
    minor_differences,
)
from autobalance.store._fingerprint import cap_lifted_ranks


def test_round_trip() -> None:
    fp = make_fingerprint()
    again = HardwareFingerprint.from_dict(json.loads(json.dumps(fp.to_dict())))
    assert again == fp
    assert again.cap_bytes == [None, 40 * GIB, None]


def test_cap_bytes_default_is_no_cap() -> None:
    fp = make_fingerprint(cap_bytes=[])
    assert fp.cap_bytes == [None, None, None]


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ("nope", "not a JSON object"),
        ({"device_type": "cuda"}, "lacks field"),
        ({**make_fingerprint().to_dict(), "colour": 1}, "unknown field"),
        ({**make_fingerprint().to_dict(), "device_type": "tpu"}, "device_type='tpu'"),
        ({**make_fingerprint().to_dict(), "capacity_bytes": [1, 2]}, "one entry per rank"),
        ({**make_fingerprint().to_dict(), "world_size": 0}, "world_size=0"),
        ({**make_fingerprint().to_dict(), "cap_bytes": ["x", None, None]}, "cap_bytes"),
    ],
)
def test_from_dict_validates(data: object, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected) as info:
        HardwareFingerprint.from_dict(data)
    assert "\n" not in str(info.value)


def test_same_hardware_has_no_differences() -> None:
    assert differences(make_fingerprint(), make_fingerprint()) == []
    assert minor_differences(make_fingerprint(), make_fingerprint()) == []


def test_world_size_difference() -> None:
    diffs = differences(make_fingerprint(world_size=2), make_fingerprint(world_size=4))
    assert diffs == ["world size 2 (tuned) vs 4 (this job)"]


def test_nodes_and_device_type_difference() -> None:
    diffs = differences(make_fingerprint(), make_fingerprint(nnodes=3))
    assert diffs == ["nodes 1 (tuned) vs 3 (this job)"]
    cpu = make_fingerprint(device_type="cpu", device_name="x")
    assert differences(make_fingerprint(), cpu) == ["device cuda (tuned) vs cpu (this job)"]


def test_gpu_model_difference() -> None:
    diffs = differences(
        make_fingerprint(),
        make_fingerprint(device_name="NVIDIA A100", capacity_bytes=[140 * GIB] * 3),
    )
    assert diffs == ["GPU 'NVIDIA H200' (tuned) vs 'NVIDIA A100' (this job)"]


def test_capacity_difference_beyond_tolerance() -> None:
    stored = make_fingerprint(cap_bytes=[])
    close = make_fingerprint(cap_bytes=[], capacity_bytes=[int(140 * GIB * 0.99)] * 3)
    assert differences(stored, close) == []
    far = make_fingerprint(cap_bytes=[], capacity_bytes=[140 * GIB, 80 * GIB, 140 * GIB])
    assert differences(stored, far) == ["rank 1 memory 140 GiB (tuned) vs 80.0 GiB (this job)"]


def test_emulated_cap_difference() -> None:
    stored = make_fingerprint()  # rank 1 capped at 40 GiB
    # the job runs without the cap on the 140 GiB card: the configuration fits with room to spare,
    # which is no mismatch (issue 31: a note, not a warning per load)
    uncapped = make_fingerprint(cap_bytes=[])
    assert differences(stored, uncapped) == []
    assert cap_lifted_ranks(stored, uncapped) == [1]
    assert cap_lifted_note(stored, uncapped) == (
        "tuned under an emulated cap of 40.0 GiB on rank 1; this job runs without it "
        "(the configuration fits with room to spare)")
    # ... but a smaller card without a cap, or a tighter cap, is less memory than tuned for
    smaller = make_fingerprint(cap_bytes=[], capacity_bytes=[140 * GIB, 24 * GIB, 140 * GIB])
    assert differences(stored, smaller) == ["rank 1 memory 40.0 GiB (tuned) vs 24.0 GiB (this job)"]
    assert cap_lifted_note(stored, smaller) is None
    tighter = make_fingerprint(cap_bytes=[None, 20 * GIB, None])
    assert differences(stored, tighter) == ["rank 1 memory 40.0 GiB (tuned) vs 20.0 GiB (this job)"]
    # a cap above the physical capacity does not limit anything
    huge = make_fingerprint(cap_bytes=[1000 * GIB, 40 * GIB, None])
    assert differences(stored, huge) == []
    assert cap_lifted_note(stored, huge) is None  # the cap is still there
    # tuned uncapped, run under a cap: less memory, a difference
    assert differences(uncapped, stored) == ["rank 1 memory 140 GiB (tuned) vs 40.0 GiB (this job)"]


def test_cpu_compares_caps_only() -> None:
    stored = make_fingerprint(device_type="cpu", device_name="A", cap_bytes=[GIB, GIB, GIB])
    other_ram = make_fingerprint(
        device_type="cpu", device_name="B", cap_bytes=[GIB, GIB, GIB], capacity_bytes=[GIB * 3] * 3
    )
    assert differences(stored, other_ram) == []
    assert minor_differences(stored, other_ram) == ["CPU 'A' (tuned) vs 'B' (this job)"]
    no_cap = make_fingerprint(device_type="cpu", device_name="A", cap_bytes=[GIB, None, GIB])
    assert differences(stored, no_cap) == []  # runs without the emulated cap: room to spare
    assert cap_lifted_note(stored, no_cap) == (
        "tuned under an emulated cap of 1.00 GiB on rank 1; this job runs without it (the configuration fits "
        "with room to spare)")
    demo = make_fingerprint(device_type="cpu", device_name="A", world_size=2, cap_bytes=[15569256] * 2)
    plain = make_fingerprint(device_type="cpu", device_name="A", world_size=2, cap_bytes=[])
    assert cap_lifted_note(demo, plain) == (
        "tuned under an emulated cap of 14.8 MiB per rank; this job runs without it (the configuration fits "
        "with room to spare)")
    smaller_cap = make_fingerprint(device_type="cpu", device_name="A", cap_bytes=[GIB, GIB // 2, GIB])
    assert differences(stored, smaller_cap) == ["rank 1 memory cap 1.00 GiB (tuned) vs 512 MiB (this job)"]
    assert differences(no_cap, stored) == ["rank 1 memory cap no cap (tuned) vs 1.00 GiB (this job)"]


def test_versions_are_minor() -> None:
    current = make_fingerprint(torch_version="2.7.0+cu128", cuda_version="12.8")
    assert differences(make_fingerprint(), current) == []
    assert minor_differences(make_fingerprint(), current) == [
        "torch 2.6.0+cu124 (tuned) vs 2.7.0+cu128 (this job)",
        "CUDA 12.4 (tuned) vs 12.8 (this job)",
    ]


def _meminfo_total() -> int:
    with open("/proc/meminfo", encoding="utf-8") as fh:
        for line in fh:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no MemTotal in /proc/meminfo")


def _cpuinfo_model() -> str:
    with open("/proc/cpuinfo", encoding="utf-8") as fh:
        for line in fh:
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    raise AssertionError("no model name in /proc/cpuinfo")


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="reads the machine's figures from /proc (Linux)")
def test_current_fingerprint_cpu_reports_this_machine() -> None:
    """Checked against /proc, not against the inputs: fails if the host memory is misreported
    (a 1-byte or a per-process figure), if the CPU model is not the machine's, if the torch
    version is not the running one, or if one cap is applied to every rank."""
    import torch

    fp = current_fingerprint(device_type="cpu", world_size=2, nnodes=1, cap_bytes=[GIB, None])
    assert fp.device_type == "cpu"
    assert fp.world_size == 2
    assert fp.cap_bytes == [GIB, None]
    total = _meminfo_total()
    assert len(fp.capacity_bytes) == 2
    for capacity in fp.capacity_bytes:
        assert abs(capacity - total) <= 0.01 * total, (capacity, total)
    assert fp.device_name == _cpuinfo_model()
    assert fp.torch_version == torch.__version__
    assert fp.nnodes == 1
    assert differences(fp, fp) == []
    # tuned without a cap on rank 1, this job caps it: named as the difference
    assert differences(fp, current_fingerprint(device_type="cpu", world_size=2, nnodes=1, cap_bytes=GIB)) == [
        "rank 1 memory cap no cap (tuned) vs 1.00 GiB (this job)"]


def test_current_fingerprint_rejects_unknown_device() -> None:
    with pytest.raises(ConfigError, match="device_type='tpu'"):
        current_fingerprint(device_type="tpu", world_size=1)


def test_small_caps_are_printed_with_their_digits() -> None:
    stored = make_fingerprint(device_type="cpu", device_name="A", cap_bytes=[int(0.0145 * GIB)] * 3)
    uncapped = make_fingerprint(device_type="cpu", device_name="A", cap_bytes=[])
    assert differences(uncapped, stored)[0] == "rank 0 memory cap no cap (tuned) vs 14.8 MiB (this job)"
    assert "an emulated cap of 14.8 MiB per rank" in (cap_lifted_note(stored, uncapped) or "")


def test_an_unknown_cpu_model_is_not_a_difference() -> None:
    """Studies tuned before trials reported the CPU model say 'cpu': not a different machine."""
    old = make_fingerprint(device_type="cpu", device_name="cpu", cap_bytes=[])
    here = make_fingerprint(device_type="cpu", device_name=cpu_model_name(), cap_bytes=[])
    assert minor_differences(old, here) == []
    assert cpu_model_name()  # e.g. 'Intel(R) Xeon(R) Processor': what this machine's fingerprint names


@pytest.mark.parametrize(("tuned_gib", "now_gib", "expected"), [
    (1.50, 1.54, "1.50 GiB (tuned) vs 1.54 GiB (this job)"),  # 2.6% apart: beyond the tolerance
    (40.0, 41.0, "40.0 GiB (tuned) vs 41.0 GiB (this job)"),  # one decimal is enough
    (1.00, 1.03, "1.00 GiB (tuned) vs 1.03 GiB (this job)"),
    (0.0145, 0.0150, "14.8 MiB (tuned) vs 15.4 MiB (this job)"),  # below 1 GiB: MiB, three significant digits
    (0.95, 1.0, "973 MiB (tuned) vs 1.00 GiB (this job)"),
])
def test_caps_that_differ_never_print_the_same(tuned_gib: float, now_gib: float, expected: str) -> None:
    def cpu(gib: float):
        return make_fingerprint(device_type="cpu", device_name="A", cap_bytes=[int(gib * GIB)] * 3)

    assert differences(cpu(tuned_gib), cpu(now_gib))[0] == f"rank 0 memory cap {expected}"


def test_sizes_that_differ_are_never_printed_the_same() -> None:
    from autobalance.store._fingerprint import _gib_pair

    for a, b in [(GIB, GIB + 1), (int(1.5 * GIB), int(1.54 * GIB)), (10**6, 10**6 + 1), (None, GIB), (0, 1)]:
        left, right = _gib_pair(a, b)
        assert left != right, (a, b, left)
    assert _gib_pair(GIB, GIB) == ("1.00 GiB", "1.00 GiB")
