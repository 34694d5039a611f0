"""The engine's C++ CPU kernels (csrc/: decode attention, packed linear maps, RMSNorm, SwiGLU,
rotary embedding with the cache write, a decode step's decoder layers in one call, and argmax
over rows), built on first use by torch.utils.cpp_extension and cached by it
(TORCH_EXTENSIONS_DIR, ~/.cache/torch_extensions by default), so only the first start on a
machine pays the build.

A build's directory is named by a hash of what it was built from: the sources, the compiler
flags, torch's version and place and the CPU's instruction sets, and the sources are compiled
from a copy kept in it. Two checkouts with the same sources share one build; checkouts with other
sources or another torch, or two kinds of CPU sharing a home directory, each keep their own build
instead of rebuilding over the other's; and no process loads a build made for instructions its
CPU lacks."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch

from pagedserve.model.cpu_features import CpuFeatures

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [
    _CSRC / name
    for name in (
        "paged_decode.cpp",
        "packed_linear.cpp",
        "integer_linear.cpp",
        "bf16_linear.cpp",
        "norm_activation.cpp",
        "rotary_cache.cpp",
        "decode_layers.cpp",
        "row_argmax.cpp",
        "ops.cpp",
    )
]

# at::vec picks its vector width from these macros: the instruction sets ATen dispatches to here,
# with the flags torch's inductor compiles its own CPU kernels with.
_VECTOR_FLAGS = {
    "AVX512": ["-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw"],
    "AVX2": ["-DCPU_CAPABILITY_AVX2", "-mavx2"],
}
_X86_FLAGS = ["-mfma", "-mf16c"]


@functools.cache
def cpu_kernels_available() -> bool:
    """Registers the torch.ops.pagedserve operators (every one declared in csrc/ops.cpp),
    building them if needed. False (with a warning) when they cannot be built here, in which case
    the model runs on torch's own operators."""
    _put_ninja_on_path()
    logger.info("loading the C++ CPU kernels (the first start on a machine builds them)")
    try:
        from torch.utils import cpp_extension  # imports setuptools, only needed here

        build_directory = build_directory_of(cpp_extension)
        with _build_lock(build_directory):
            cpp_extension.load(
                name="pagedserve_kernels",
                sources=[str(source) for source in _sources_in(build_directory)],
                extra_cflags=_cflags(),
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_directory),
                is_python_module=False,
            )
    except (ImportError, OSError, RuntimeError, subprocess.CalledProcessError) as error:
        logger.warning("C++ CPU kernels unavailable, using torch's operators: %s", error)
        return False
    return True


# Instructions beyond ATen's vector width that a kernel uses where this CPU has them (each has a
# path without them, with the same results).
_EXTRA_FLAGS = {"AVX-512 VNNI": ["-mavx512vnni"], "AVX-512 BF16": ["-mavx512bf16"]}


def _cflags() -> list[str]:
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in _VECTOR_FLAGS:
        return ["-O3", "-fopenmp"]
    flags = [*_VECTOR_FLAGS[capability], *_X86_FLAGS]
    if capability == "AVX512":
        for instructions in CpuFeatures.host().instruction_sets:
            flags += _EXTRA_FLAGS.get(instructions, [])
    return ["-O3", "-fopenmp", *flags]


def build_key(cpu: CpuFeatures | None = None) -> str:
    """A hash of everything a build depends on: csrc/'s files, the flags, torch's version and
    where it is installed (its headers and libraries), and the instruction sets of the CPU (this
    one by default)."""
    digest = hashlib.sha256()
    for path in _kernel_files():
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(" ".join(_cflags()).encode() + b"\0" + torch.__version__.encode() + b"\0")
    digest.update(str(Path(torch.__file__).parent).encode() + b"\0")
    digest.update(" ".join((cpu or CpuFeatures.host()).instruction_sets).encode())
    return digest.hexdigest()[:16]


def _kernel_files() -> list[Path]:
    return sorted(path for path in _CSRC.iterdir() if path.suffix in (".cpp", ".h"))


def _sources_in(build_directory: Path) -> list[Path]:
    """The sources to compile: csrc/'s files as copied into the build directory by its first
    load. ninja rebuilds whatever is compiled from another path, so two checkouts compiling
    their own identical copies would rebuild over each other; from this copy, which the
    directory's name says is theirs, they share a build."""
    copy = build_directory / "csrc"
    if not copy.is_dir():
        partial = build_directory / "csrc.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        for path in _kernel_files():
            shutil.copy2(path, partial / path.name)
        partial.rename(copy)
    return [copy / source.name for source in _SOURCES]


def build_directory_of(cpp_extension) -> Path:
    """Where the kernels are built: pagedserve_kernels-KEY under TORCH_EXTENSIONS_DIR, or under
    torch's default root for extensions."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return Path(root) / f"pagedserve_kernels-{build_key()}"


@contextlib.contextmanager
def _build_lock(build_directory: Path) -> Iterator[None]:
    """Held while the kernels load. torch marks a build in progress with a `lock` file that an
    interrupted build (Ctrl-C during the first start) leaves behind, and every later load then
    waits for it forever. Every load holds this lock, which the OS drops when its process ends,
    so a `lock` file found while holding it is left from such a build, and is removed."""
    build_directory.mkdir(parents=True, exist_ok=True)
    with open(build_directory / "pagedserve.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        leftover = build_directory / "lock"
        if leftover.exists():
            logger.warning("removing %s, left by an interrupted build", leftover)
            leftover.unlink()
        yield


def can_use_cpu_kernels(device: torch.device, dtype: torch.dtype) -> bool:
    """The packed products and the kernels that go with them are for float32 on CPU; elsewhere
    torch's own operators are used."""
    return device.type == "cpu" and dtype == torch.float32 and cpu_kernels_available()


def _put_ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH; the ninja package installs it beside this Python,
    which is not on PATH when the virtual environment is not activated."""
    if shutil.which("ninja") is None:
        scripts = sysconfig.get_path("scripts")
        os.environ["PATH"] = os.pathsep.join([scripts, os.environ.get("PATH", "")])
