"""Which dtype --amp means on a device: fp32 on the CPU under auto, bf16 where the device computes in it."""

from __future__ import annotations

import pytest
import torch

from multigpu import precision
from multigpu.precision import cpu_bf16_units, resolve_dtype


def test_auto_is_fp32_on_the_cpu_and_says_so_in_one_line(monkeypatch):
    monkeypatch.setattr(precision, "cpu_bf16_units", lambda: True)
    said: list[str] = []
    assert resolve_dtype("auto", torch.device("cpu"), said.append) is None
    assert said == ["--amp auto: fp32 on the CPU (--amp bf16 autocasts there)"]
    assert resolve_dtype("bf16", torch.device("cpu"), said.append) is torch.bfloat16 and len(said) == 1


EMULATED = (
    "--amp bf16: this CPU has no bf16 units (AVX512-BF16, AMX or Arm's BF16), so bf16 is emulated here, "
    "often several times slower than fp32; --amp auto (fp32 on the CPU) or off runs at fp32 speed"
)


@pytest.mark.parametrize(
    "units, notes", [(False, [EMULATED]), (True, []), (None, [])], ids=["none: emulated", "there", "unknown"]
)
def test_bf16_on_a_cpu_without_bf16_units_says_it_is_emulated_and_slow(monkeypatch, units, notes):
    """QUICK_REFERENCE's bf16 command took 509 s at 54 samples/s where fp32 ran at 220-760: a CPU without bf16
    units emulates it."""
    monkeypatch.setattr(precision, "cpu_bf16_units", lambda: units)
    said: list[str] = []
    assert resolve_dtype("bf16", torch.device("cpu"), said.append) is torch.bfloat16
    assert said == notes
    assert resolve_dtype("fp16", torch.device("cpu"), said.append) is torch.bfloat16  # fp16 is bf16 there
    assert said[len(notes) + 1 :] == notes


@pytest.mark.parametrize(
    "line, units",
    [
        ("flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_tile", True),  # Intel Cooper Lake and later
        ("flags\t\t: fpu sse2 avx2 amx_bf16 amx_tile", True),
        ("flags\t\t: fpu sse2 avx2 avx512f avx512bw", False),  # AVX-512 alone emulates bf16
        ("Features\t: fp asimd bf16 i8mm", True),  # Arm
        ("Features\t: fp asimd", False),
    ],
    ids=["avx512_bf16", "amx", "avx512 only", "arm bf16", "arm without"],
)
def test_a_cpus_bf16_units_are_read_from_its_flags(tmp_path, line, units):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\n{line}\n\nprocessor\t: 1\n{line}\n")
    assert cpu_bf16_units(str(cpuinfo)) is units
    assert cpu_bf16_units(str(tmp_path / "absent")) is None


@pytest.mark.parametrize(
    "capability, expected",
    [((7, 0), torch.float16), ((7, 5), torch.float16), ((8, 0), torch.bfloat16), ((9, 0), torch.bfloat16)],
)
def test_auto_on_a_gpu_is_bf16_from_ampere_on_and_fp16_before(monkeypatch, capability, expected):
    """The GPU's compute capability decides, not torch.cuda.is_bf16_supported(), which also says yes where bf16
    is only emulated (V100, T4); --amp bf16 on such a GPU falls back to fp16 with one line."""
    asked: list[torch.device] = []
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(
        torch.cuda, "get_device_capability", lambda device: asked.append(device) or capability
    )
    monkeypatch.setattr(
        torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True
    )  # emulation counts there
    said: list[str] = []
    gpu = torch.device("cuda", 1)
    assert resolve_dtype("auto", gpu, said.append) is expected and said == [] and asked == [gpu]
    assert resolve_dtype("bf16", gpu, said.append) is expected
    assert said == (
        []
        if expected is torch.bfloat16
        else ["--amp bf16 is not supported by this GPU; using fp16 with a GradScaler instead"]
    )
