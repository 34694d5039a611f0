"""The path the engine takes by default on each kind of CPU: the resolution with the CPU's
features given, and the path actually taken on this host."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch

import pagedserve.model.kernels
from pagedserve import LLM
from pagedserve.config import PACKED_WEIGHT_DTYPES
from pagedserve.engine.model_runner import resolve_dtype
from pagedserve.model.cpu_features import CpuFeatures
from pagedserve.model.kernels import build_directory_of, build_key, cpu_kernels_available
from pagedserve.model.linear_method import PACKED_FORMATS, choose_format

ZEN3_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c bmi2

processor\t: 1
model name\t: (second processor, not read)
"""
AVX512 = "avx512f avx512dq avx512bw avx512vl"
ZEN4 = CpuFeatures(
    "AMD EPYC 9B14",
    25,
    17,
    frozenset(f"avx avx2 fma f16c {AVX512} avx512_vnni avx512_bf16".split()),
)
SAPPHIRE_RAPIDS = CpuFeatures(
    "Intel Xeon", 6, 143, frozenset(f"avx2 fma f16c {AVX512} amx_tile amx_bf16".split())
)
ZEN3 = CpuFeatures.parse(ZEN3_CPUINFO)
CPU = torch.device("cpu")


def test_cpuinfo_is_read_for_the_first_processor():
    assert (ZEN3.model_name, ZEN3.family, ZEN3.model) == ("AMD EPYC 7B13", 25, 1)
    assert ZEN3.instruction_sets == ("AVX2",)
    assert not ZEN3.native_bfloat16
    assert ZEN4.instruction_sets == ("AVX2", "AVX-512", "AVX-512 VNNI", "AVX-512 BF16")
    assert ZEN4.describe() == (
        "AMD EPYC 9B14 (family 25, model 17; AVX2, AVX-512, AVX-512 VNNI, AVX-512 BF16)"
    )
    assert SAPPHIRE_RAPIDS.native_bfloat16


def test_each_kind_of_cpu_keeps_its_own_benchmark_results():
    """The name docs/bench/<kind>/ keeps a kind's results under: model, family and model
    numbers, and instruction sets."""
    assert ZEN3.kind == "amd-epyc-7b13-f25m1-avx2"
    assert ZEN4.kind == "amd-epyc-9b14-f25m17-avx512-vnni-bf16"
    assert SAPPHIRE_RAPIDS.kind == "intel-xeon-f6m143-avx512-amx"
    zen1 = CpuFeatures("AMD EPYC", 23, 1, frozenset(["avx", "avx2", "fma", "f16c"]))
    unnamed_zen3 = CpuFeatures.parse(ZEN3_CPUINFO.replace("AMD EPYC 7B13", "AMD EPYC"))
    assert zen1.kind == "amd-epyc-f23m1-avx2" and unnamed_zen3.kind == "amd-epyc-f25m1-avx2"
    assert CpuFeatures("unknown CPU", None, None, frozenset()).kind == "unknown-cpu-generic"


@pytest.mark.parametrize("cpu", [ZEN3, ZEN4, SAPPHIRE_RAPIDS], ids=["avx2", "avx512-bf16", "amx"])
def test_auto_keeps_the_kernels_float32_path_on_every_cpu_where_they_build(cpu):
    assert resolve_dtype("auto", CPU, cpu_kernels=True, cpu=cpu) == torch.float32


@pytest.mark.parametrize(
    ("cpu", "expected"),
    [(ZEN3, torch.float32), (ZEN4, torch.bfloat16), (SAPPHIRE_RAPIDS, torch.bfloat16)],
    ids=["avx2", "avx512-bf16", "amx"],
)
def test_without_the_kernels_auto_takes_bfloat16_only_where_the_cpu_multiplies_it(cpu, expected):
    assert resolve_dtype("auto", CPU, cpu_kernels=False, cpu=cpu) == expected


def test_an_explicit_dtype_and_cuda_are_as_before():
    assert resolve_dtype("bfloat16", CPU, cpu_kernels=True, cpu=ZEN3) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cuda"), cpu_kernels=False, cpu=ZEN3) == (
        torch.bfloat16
    )


def test_the_default_path_on_this_host_is_the_kernels_in_float32(tiny_checkpoint, caplog):
    host = CpuFeatures.host()
    with caplog.at_level(logging.INFO, logger="pagedserve.engine.model_runner"):
        runner = LLM(str(tiny_checkpoint("llama"))).engine.runner  # every setting its default
    print(f"this host: {host.describe()}; dtype {runner.dtype}, {runner.weights_summary()}")
    assert runner.dtype == torch.float32
    assert runner.packed_weight_dtypes is not None  # the C++ kernels' packed products
    assert f"CPU: {host.describe()}; path: C++ kernels in float32 (--dtype auto)" in caplog.text


def test_kernel_builds_are_kept_apart_by_the_cpu_they_were_built_for():
    from torch.utils import cpp_extension

    assert build_key(ZEN3) != build_key(ZEN4) != build_key(SAPPHIRE_RAPIDS)
    assert build_key(ZEN4) == build_key(ZEN4)
    directory = build_directory_of(cpp_extension)
    assert directory.name == f"pagedserve_kernels-{build_key(CpuFeatures.host())}"


@pytest.mark.parametrize(
    ("name", "linear_map_types", "logits_types", "expected"),
    [
        ("auto", {"Q4_1"}, {"Q8_0"}, ("q4_1", "q8_0")),  # the default model's GGUF file
        ("auto", {"Q8_0"}, {"Q8_0"}, ("q8_0", "q8_0")),
        ("auto", {"BF16"}, {"BF16"}, ("bfloat16", "bfloat16")),
        ("auto", {"Q4_1", "Q8_0"}, {"Q8_0"}, ("float32", "q8_0")),  # mixed: float32 holds any
        ("auto", {"F16"}, {"F32"}, ("float16", "float32")),
        ("q4_1_q8", {"BF16"}, {"BF16"}, ("q4_1_q8", "q8_0_q8")),  # Q4_1 formats keep Q8_0 logits
        ("int8", {"Q4_1"}, {"Q8_0"}, ("int8", "int8")),
    ],
)
def test_auto_packs_each_weight_in_the_format_that_stores_its_type(
    name, linear_map_types, logits_types, expected
):
    # A checkpoint whose maps all store linear_map_types, and its logits logits_types.
    maps = choose_format(name, linear_map_types, logits=False, from_blocks=False)
    logits = choose_format(name, logits_types, logits=True, from_blocks=False)
    assert (maps, logits) == expected


def test_every_packed_format_is_a_flag_choice_and_every_op_is_registered_in_one_file():
    assert ("auto", *PACKED_FORMATS) == PACKED_WEIGHT_DTYPES
    assert cpu_kernels_available()
    csrc = Path(pagedserve.model.kernels.__file__).parent / "csrc"
    registrations = {
        path.name: path.read_text().count("TORCH_LIBRARY") for path in csrc.glob("*.cpp")
    }
    assert {name: count for name, count in registrations.items() if count} == {"ops.cpp": 2}
    declared = set(re.findall(r'm\.def\(\s*"(\w+)\(', (csrc / "ops.cpp").read_text()))
    implemented = set(re.findall(r'm\.impl\("(\w+)"', (csrc / "ops.cpp").read_text()))
    assert declared == implemented
    for op in declared:
        assert hasattr(torch.ops.pagedserve, op)
