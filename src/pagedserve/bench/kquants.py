"""The model's GGUF file requantized to Q4_K_M by llama.cpp's own quantizer, measured beside the
file it came from and beside llama.cpp on it (issue 30): the bytes the packed maps hold against
the file's, single-stream decode, and all of W1 seated.

llama.cpp quantizes from float weights, so the file is first written with every quantized tensor
dequantized to F16 (gguf's reader and writer); llama-cpp-python's llama_model_quantize then makes
Q4_K_M of it, as `llama-quantize` would."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import partial
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf.gguf_reader import ReaderTensor

from pagedserve import LLM
from pagedserve.bench.datasets import BenchRequest
from pagedserve.bench.llama_cpp_peer import gguf_weight_bytes, run_llama_cpp, run_llama_cpp_batched
from pagedserve.bench.offline import run_engine, with_fresh_llm
from pagedserve.bench.records import KQuants, fastest_of_rounds
from pagedserve.model.layers import Linear
from pagedserve.model.source import GGUF_LINEAR_MAPS


def q4_k_m_of(gguf_path: Path, out_dir: Path) -> Path:
    """out_dir/<stem>.Q4_K_M.gguf, made from gguf_path through an F16 copy."""
    f16 = out_dir / f"{gguf_path.stem}.F16.gguf"
    _write_f16(gguf_path, f16)
    out = out_dir / f"{gguf_path.stem.split('.')[0]}.Q4_K_M.gguf"
    quantize_q4_k_m(f16, out)
    f16.unlink()
    return out


def quantize_q4_k_m(f16: Path, out: Path) -> None:
    """out: f16 (a GGUF file of float weights) made Q4_K_M by llama.cpp, as `llama-quantize`."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.nthread = torch.get_num_threads()
    if llama_cpp.llama_model_quantize(str(f16).encode(), str(out).encode(), ctypes.byref(params)):
        raise RuntimeError(f"llama.cpp could not quantize {f16} to Q4_K_M")


def _write_f16(source: Path, out: Path) -> None:
    def as_f16(tensor) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
        data, stored = tensor.data, tensor.tensor_type
        if stored in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            return data, stored
        return gguf.quants.dequantize(data, stored).astype(
            np.float16
        ), gguf.GGMLQuantizationType.F16

    rewrite_gguf(source, out, as_f16)


def rewrite_gguf(
    source: Path,
    out: Path,
    convert: Callable[[ReaderTensor], tuple[np.ndarray, gguf.GGMLQuantizationType]],
) -> None:
    """Writes source's metadata to out as it is, and each of its tensors as convert returns it
    (data and type)."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(out, reader.fields["general.architecture"].contents())
    copy_metadata(
        reader, writer, lambda name: name != "general.architecture" and not name.startswith("GGUF.")
    )
    for tensor in reader.tensors:
        data, stored = convert(tensor)
        writer.add_tensor(tensor.name, data, raw_dtype=stored)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def copy_metadata(
    reader: gguf.GGUFReader, writer: gguf.GGUFWriter, keep: Callable[[str], bool]
) -> None:
    """Writes the fields of reader's file whose names keep accepts to writer, as they are."""
    for field in reader.fields.values():
        if keep(field.name):
            value_type = field.types[0]
            sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)


def map_bytes(gguf_path: Path) -> int:
    """What the file stores for the transformer blocks' linear maps."""
    return sum(
        int(tensor.n_bytes)
        for tensor in gguf.GGUFReader(gguf_path).tensors
        if tensor.name.startswith("blk.") and tensor.name.split(".")[2] in GGUF_LINEAR_MAPS
    )


def held_bytes(llm: LLM, logits: bool = False) -> int:
    """What the packed linear maps hold (logits: the output projection's too)."""
    return sum(
        module.panels.numel() * module.panels.element_size()
        for name, module in llm.engine.runner.model.named_modules()
        if isinstance(module, Linear) and (logits or name != "lm_head")
    )


def run_k_quants(
    engine_args: dict,
    source: Path,
    out_dir: Path,
    single: BenchRequest,
    w1: list[BenchRequest],
    rounds: int,
) -> KQuants:
    """Ours on source (auto's format of it) and on its Q4_K_M, the single-stream request round
    after round, taking turns; then llama.cpp on the Q4_K_M file; then W1 all seated on both."""
    q4_k_m = q4_k_m_of(source, out_dir)
    args = {**engine_args, "packed_weight_dtype": "auto", "max_num_seqs": 1}

    def alone(llm: LLM, name: str):
        run = run_engine(llm, [single])
        formats = llm.engine.runner.packed_weight_dtypes
        label = f"ours on {name} ({formats.linear_maps}; logits {formats.logits})"
        return run.summary(name=label, step_bytes=held_bytes(llm, logits=True)), held_bytes(llm)

    turns = [
        [
            with_fresh_llm(args, partial(alone, name=path.name), model=str(path))
            for path in (source, q4_k_m)
        ]
        for _ in range(rounds)
    ]
    ours = [fastest_of_rounds([turn[i][0] for turn in turns]) for i in (0, 1)]
    threads, file_bytes = torch.get_num_threads(), gguf_weight_bytes(q4_k_m)
    llama = [
        run_llama_cpp(single, q4_k_m, threads).summary(step_bytes=file_bytes) for _ in range(rounds)
    ]
    seated = {**args, "max_num_seqs": len(w1), "model": str(q4_k_m)}
    ours_w1 = with_fresh_llm(seated, partial(run_engine, requests=w1)).summary(
        name=f"ours on {q4_k_m.name}"
    )
    llama_w1 = run_llama_cpp_batched(w1, q4_k_m, threads).summary()
    return KQuants(
        source=source.name,
        gguf=q4_k_m.name,
        file_map_bytes=map_bytes(q4_k_m),
        held_map_bytes=turns[0][1][1],
        single_stream=[*ours, fastest_of_rounds(llama)],
        w1_all_seated=[ours_w1, llama_w1],
    )
