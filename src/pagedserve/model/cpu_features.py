"""What this CPU offers: its model, family and model numbers, and the instruction sets the
kernels and the dtype choice care about, read from /proc/cpuinfo (empty elsewhere)."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

# (name in the start-up log and BENCHMARKS.md, /proc/cpuinfo flags that must all be present)
_INSTRUCTION_SETS = (
    ("AVX2", ("avx2", "fma", "f16c")),
    ("AVX-512", ("avx512f", "avx512bw", "avx512vl", "avx512dq")),
    ("AVX-512 VNNI", ("avx512_vnni",)),
    ("AVX-512 BF16", ("avx512_bf16",)),
    ("AMX", ("amx_tile", "amx_bf16")),
)


@dataclass(frozen=True)
class CpuFeatures:
    model_name: str
    family: int | None
    model: int | None
    flags: frozenset[str]

    @classmethod
    def parse(cls, cpuinfo: str) -> CpuFeatures:
        """From /proc/cpuinfo's text: the first processor's fields."""
        fields: dict[str, str] = {}
        for line in cpuinfo.splitlines():
            if not line.strip():
                if fields:
                    break
                continue
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
        return cls(
            model_name=fields.get("model name", "unknown CPU"),
            family=_as_int(fields.get("cpu family")),
            model=_as_int(fields.get("model")),
            flags=frozenset(fields.get("flags", "").split()),
        )

    @staticmethod
    @functools.cache
    def host() -> CpuFeatures:
        try:
            return CpuFeatures.parse(Path("/proc/cpuinfo").read_text())
        except OSError:
            return CpuFeatures("unknown CPU", None, None, frozenset())

    @property
    def instruction_sets(self) -> tuple[str, ...]:
        return tuple(
            name for name, needed in _INSTRUCTION_SETS if all(f in self.flags for f in needed)
        )

    @property
    def native_bfloat16(self) -> bool:
        """Multiplies bfloat16 in hardware (AVX-512 BF16 or AMX) rather than emulating it."""
        return bool({"AVX-512 BF16", "AMX"} & set(self.instruction_sets))

    @property
    def kind(self) -> str:
        """A name for CPUs of this model, family and model number with these instruction sets,
        e.g. "amd-epyc-f25m17-avx512-vnni-bf16": the benchmarks keep one set of results per kind.
        The numbers tell apart cores a virtual machine names alike ("AMD EPYC" is Zen 1 at
        family 23 model 1, Zen 3 at family 25 model 1)."""
        name = "-".join(re.findall(r"[a-z0-9]+", self.model_name.lower())) or "cpu"
        if self.family is not None and self.model is not None:
            name += f"-f{self.family}m{self.model}"
        sets = self.instruction_sets
        if "AVX-512" not in sets:
            return f"{name}-{'avx2' if 'AVX2' in sets else 'generic'}"
        extras = {"AVX-512 VNNI": "vnni", "AVX-512 BF16": "bf16", "AMX": "amx"}
        return "-".join([name, "avx512", *(extras[s] for s in sets if s in extras)])

    def describe(self) -> str:
        """E.g. "AMD EPYC (family 25, model 17; AVX2, AVX-512, AVX-512 VNNI, AVX-512 BF16)"."""
        numbers = f"family {self.family}, model {self.model}; " if self.family is not None else ""
        return f"{self.model_name} ({numbers}{', '.join(self.instruction_sets) or 'no SIMD'})"


def _as_int(value: str | None) -> int | None:
    return int(value) if value is not None and value.isdigit() else None
