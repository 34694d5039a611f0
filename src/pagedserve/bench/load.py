"""`pagedserve bench load`: models of real size started from their files, ours beside llama.cpp.

The files have real shapes and random weights (load time, memory and decode speed do not depend
on the values) with SmolLM2's tokenizer: a Llama of TinyLlama's shape (1.1B parameters) or of
Llama 2 7B's, written as F16 by the gguf package and made Q4_K_M by llama.cpp's own quantizer,
and for 1.1B the same shape as a sharded bfloat16 safetensors checkpoint. They are made under
--work-dir, outside the repository.

Each run is a fresh process, as a user starts a server: the wall time from its start to its first
generated token, its peak resident memory (ru_maxrss), the bytes it wrote to disk (its cache) and
its single-stream decode rate (64 tokens after a prompt of 32). Ours runs with `pagedserve
serve`'s defaults, first with an empty cache, then again. The table goes to
docs/bench/<kind>/LOAD.md, which BENCHMARKS.md includes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from datetime import date
from pathlib import Path

import numpy as np

MIB = 2**20


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int


SHAPES = {
    "1.1b": Shape(layers=22, hidden=2048, intermediate=5632, heads=32, kv_heads=4),  # TinyLlama
    "7b": Shape(layers=32, hidden=4096, intermediate=11008, heads=32, kv_heads=32),  # Llama 2
}


def _matrices(shape: Shape, vocab: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """(GGUF name, transformers' name, numpy shape) of every tensor of the model, in file order."""
    kv = shape.hidden // shape.heads * shape.kv_heads
    tensors = [("token_embd.weight", "model.embed_tokens.weight", (vocab, shape.hidden))]
    per_layer = [
        ("attn_norm", "input_layernorm", (shape.hidden,)),
        ("attn_q", "self_attn.q_proj", (shape.hidden, shape.hidden)),
        ("attn_k", "self_attn.k_proj", (kv, shape.hidden)),
        ("attn_v", "self_attn.v_proj", (kv, shape.hidden)),
        ("attn_output", "self_attn.o_proj", (shape.hidden, shape.hidden)),
        ("ffn_norm", "post_attention_layernorm", (shape.hidden,)),
        ("ffn_gate", "mlp.gate_proj", (shape.intermediate, shape.hidden)),
        ("ffn_up", "mlp.up_proj", (shape.intermediate, shape.hidden)),
        ("ffn_down", "mlp.down_proj", (shape.hidden, shape.intermediate)),
    ]
    for layer in range(shape.layers):
        for gguf_name, hf_name, dims in per_layer:
            tensors.append(
                (f"blk.{layer}.{gguf_name}.weight", f"model.layers.{layer}.{hf_name}.weight", dims)
            )
    tensors.append(("output_norm.weight", "model.norm.weight", (shape.hidden,)))
    tensors.append(("output.weight", "lm_head.weight", (vocab, shape.hidden)))
    return tensors


def _values(dims: tuple[int, ...], rng: np.random.Generator, spread: float = 0.02) -> np.ndarray:
    """Random float32 weights: norms near 1, matrices of a trained model's spread."""
    if len(dims) == 1:
        return 1 + 0.1 * rng.standard_normal(dims, dtype=np.float32)
    return spread * rng.standard_normal(dims, dtype=np.float32)


def write_f16_gguf(out: Path, shape: Shape, seed: int = 0, spread: float = 0.02) -> Path:
    """A Llama GGUF file of shape, F16 matrices (of random values of that spread) and F32 norms,
    with the default model's tokenizer, written one tensor at a time."""
    import gguf

    from pagedserve.model.source import default_gguf_path

    source = gguf.GGUFReader(default_gguf_path())
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    writer = gguf.GGUFWriter(out, "llama")
    for field in source.fields.values():
        if field.name.startswith("tokenizer."):
            value_type = field.types[0]
            sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    writer.add_name(f"random-llama-{out.stem}")
    writer.add_context_length(2048)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.hidden // shape.heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    tensors = _matrices(shape, vocab)
    for name, _, dims in tensors:
        dtype = np.float16 if len(dims) == 2 else np.float32
        nbytes = int(np.prod(dims)) * np.dtype(dtype).itemsize
        writer.add_tensor_info(name, dims, np.dtype(dtype), nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _, _, dims in tensors:
        values = _values(dims, rng, spread)
        writer.write_tensor_data(values.astype(np.float16) if len(dims) == 2 else values)
    writer.close()
    return out


def write_bf16_safetensors(out_dir: Path, shape: Shape, seed: int = 0) -> Path:
    """The same shape as a transformers Llama checkpoint of bfloat16 shards (about 1 GB each),
    with the default model's tokenizer files."""
    import shutil

    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from pagedserve.model.source import resolve_model_dir

    tokenizer_dir = resolve_model_dir(None)
    config = json.loads((tokenizer_dir / "config.json").read_text())
    vocab = config["vocab_size"]
    out_dir.mkdir(parents=True, exist_ok=True)
    LlamaConfig(
        vocab_size=vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=2048,
        bos_token_id=config.get("bos_token_id"),
        eos_token_id=config.get("eos_token_id"),
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    rng = np.random.default_rng(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    for _, hf_name, dims in _matrices(shape, vocab):
        if sum(t.nbytes for t in shards[-1].values()) > 2**30:
            shards.append({})
        shards[-1][hf_name] = torch.from_numpy(_values(dims, rng)).to(torch.bfloat16)
    weight_map = {}
    for index, shard in enumerate(shards, 1):
        file_name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file_name))
    index_file = out_dir / "model.safetensors.index.json"
    index_file.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out_dir


# The tokens each run's KV cache holds: llama.cpp's n_ctx, our blocks of 16 tokens.
CONTEXT = 2048
# One run, in a child process: argv model, the parent's clock at its start, threads (ours: then
# the packed weight dtype); prints JSON.
_OURS = (
    f"CONTEXT = {CONTEXT}\n"
    + """
import json, resource, sys, time
model, started, threads = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
packed_weight_dtype = sys.argv[4]
import torch
torch.set_num_threads(threads)
from pagedserve import LLM, SamplingParams
llm = LLM(model, max_model_len=CONTEXT, num_kv_blocks=CONTEXT // 16,
          packed_weight_dtype=packed_weight_dtype)
prompt = {"prompt_token_ids": list(range(1000, 1032))}
def timed(tokens):
    begun = time.time()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    return time.time() - begun
timed(1)
first = time.time()
one, sixty_five = timed(1), timed(65)
from pagedserve.bench.kquants import held_bytes
print(json.dumps({"first_token_s": first - started, "decode_tok_s": 64 / (sixty_five - one),
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "read_bytes": held_bytes(llm, logits=True)}))
"""
)

_LLAMA_CPP = (
    f"CONTEXT = {CONTEXT}\n"
    + """
import json, resource, sys, time
model, started, threads = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
from llama_cpp import Llama
llm = Llama(model_path=model, n_ctx=CONTEXT, n_threads=threads, n_threads_batch=threads,
            verbose=False)
prompt = list(range(1000, 1032))
times = []
for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
    times.append(time.time())
    if len(times) == 65:
        break
print(json.dumps({"first_token_s": times[0] - started, "decode_tok_s": 64 / (times[-1] - times[0]),
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""
)


@dataclass(frozen=True)
class LoadRun:
    label: str
    file_bytes: int
    first_token_s: float
    peak_rss: int
    written: int
    decode_tok_s: float
    read_bytes: int | None  # the weights one decode step reads (ours: the packed maps)


def _disk_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def measure(
    label: str, script: str, model: Path, cache: Path, threads: int, packed: str = "auto"
) -> LoadRun:
    """One run of script (_OURS, with packed as its packed weight dtype, or _LLAMA_CPP)."""
    cache.mkdir(parents=True, exist_ok=True)
    before = _disk_bytes(cache)
    env = {**os.environ, "PAGEDSERVE_CACHE": str(cache), "OMP_NUM_THREADS": str(threads)}
    started = time.time()
    result = subprocess.run(
        [sys.executable, "-c", script, str(model), repr(started), str(threads), packed],
        env=env,
        capture_output=True,
        text=True,
    )
    if result.returncode:
        raise RuntimeError(f"{label} failed:\n{result.stderr[-4000:]}")
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    size = _disk_bytes(model) if model.is_dir() else model.stat().st_size
    return LoadRun(
        label,
        size,
        figures["first_token_s"],
        figures["peak_rss"],
        _disk_bytes(cache) - before,
        figures["decode_tok_s"],
        figures.get("read_bytes"),
    )


# llama.cpp and our later starts run this many times, taking turns, each judged by its best run:
# a start takes seconds, and one busy spell on the shared machine could set a ratio alone.
REPEATS = 3


def _read_through(model: Path) -> None:
    """Reads the model's files once, so that every run finds them in the page cache."""
    for path in sorted(model.rglob("*")) if model.is_dir() else [model]:
        if path.is_file():
            with path.open("rb") as handle:
                while handle.read(64 << 20):
                    pass


def _best_of(runs: list[LoadRun]) -> LoadRun:
    """One row for the runs of one setting: the fastest start and decode, the largest peak and
    bytes written."""
    fastest = min(runs, key=lambda run: run.first_token_s)
    return replace(
        fastest,
        decode_tok_s=max(run.decode_tok_s for run in runs),
        peak_rss=max(run.peak_rss for run in runs),
        written=max(run.written for run in runs),
    )


def run_load(out_dir: Path, work_dir: Path, sizes: list[str], threads: int) -> Path:
    """Makes the files of each size under work_dir (kept for later runs), measures ours and
    llama.cpp on them, and writes out_dir/LOAD.md."""
    import torch

    from pagedserve.bench.ceilings import bandwidth_gbs
    from pagedserve.bench.kquants import quantize_q4_k_m
    from pagedserve.bench.llama_cpp_peer import NAME, llama_cpp_installed
    from pagedserve.model.cpu_features import CpuFeatures

    torch.set_num_threads(threads)
    bandwidth = bandwidth_gbs(torch.device("cpu"))
    work_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[LoadRun]] = {}
    for size in sizes:
        q4_k_m = work_dir / f"random-llama-{size}.Q4_K_M.gguf"
        if not q4_k_m.is_file():
            f16 = write_f16_gguf(work_dir / f"random-llama-{size}.F16.gguf", SHAPES[size])
            quantize_q4_k_m(f16, q4_k_m)
            f16.unlink()
        cache = work_dir / f"cache-{size}"
        if cache.exists():
            import shutil

            shutil.rmtree(cache)
        rows = runs.setdefault(size, [])
        _read_through(q4_k_m)
        first = measure("ours, Q4_K_M, first start", _OURS, q4_k_m, cache, threads)
        # q4_k_q8: the file's maps in integers against 8-bit inputs, as llama.cpp computes them.
        turns = [("ours, Q4_K_M, again", _OURS, "auto")]
        turns.append(("ours, Q4_K_M, again, --packed-weight-dtype q4_k_q8", _OURS, "q4_k_q8"))
        if llama_cpp_installed():
            turns.insert(0, (f"{NAME}, Q4_K_M", _LLAMA_CPP, "auto"))
        rounds = [
            [
                measure(label, script, q4_k_m, cache, threads, packed)
                for label, script, packed in turns
            ]
            for _ in range(REPEATS)
        ]
        best = [_best_of(list(runs_of_one)) for runs_of_one in zip(*rounds, strict=True)]
        rows.extend([*best[:-2], first, *best[-2:]])
        if size == "1.1b":
            bf16 = work_dir / f"random-llama-{size}-bf16"
            if not (bf16 / "model.safetensors.index.json").is_file():
                write_bf16_safetensors(bf16, SHAPES[size])
            _read_through(bf16)
            rows.append(measure("ours, bfloat16 safetensors", _OURS, bf16, cache, threads))

    def bound(run: LoadRun) -> str:
        if not run.read_bytes:
            return "-"
        tokens_s = bandwidth * 1e9 / run.read_bytes
        return f"{run.decode_tok_s / tokens_s:.0%} of {tokens_s:.1f} tokens/s"

    out_dir.mkdir(parents=True, exist_ok=True)
    host = CpuFeatures.host()
    lines = [
        f"## Loading real sizes on {host.kind} ({date.today().isoformat()})",
        "",
        f"`pagedserve bench load` on {host.describe()}, {threads} threads, one fresh process a "
        "run, the page cache warm (each file was read just before); llama.cpp and our later "
        f"starts ran {REPEATS} times, taking turns, each row their fastest start and decode. "
        "Random weights of real shapes with SmolLM2's 49,152-token vocabulary, made Q4_K_M by "
        "llama.cpp's quantizer: TinyLlama's shape (1.1B) and Llama 2 7B's. Start to first token: "
        "from the process's start, imports included, to its first token of a 32-token prompt "
        "(in brackets: against llama.cpp's fastest on the same file); decode: the 64 tokens after "
        "it (in brackets: against llama.cpp's). `--packed-weight-dtype q4_k_q8` computes the "
        "file's maps as llama.cpp does, against inputs rounded to 8 bits; our other rows "
        "compute the file's weights exactly, in float32. "
        f"Each holds a KV cache of {CONTEXT} tokens (ours: blocks of 16 float32 tokens). "
        f"Bound: the machine's measured memory bandwidth ({bandwidth:.1f} GB/s) over the weight "
        "bytes one decode step reads (ours: the packed linear maps as held). llama.cpp: "
        "llama-cpp-python as `make bench` builds it (this host's instructions, AMX left out).",
        "",
        "| model, run | file | start to first token | peak RSS | written to disk "
        "| single-stream decode | of the bandwidth bound |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for size, rows in runs.items():
        peer = next((run for run in rows if run.label.startswith(NAME)), None)
        for run in rows:
            start, decode = f"{run.first_token_s:.1f} s", f"{run.decode_tok_s:.1f} tokens/s"
            if peer is not None and run is not peer and run.file_bytes == peer.file_bytes:
                start += f" ({run.first_token_s / peer.first_token_s:.2f}x)"
                decode += f" ({run.decode_tok_s / peer.decode_tok_s:.2f}x)"
            lines.append(
                f"| {size}: {run.label} | {run.file_bytes / MIB:,.0f} MiB "
                f"| {start} | {run.peak_rss / MIB:,.0f} MiB "
                f"| {run.written / MIB:,.1f} MiB | {decode} | {bound(run)} |"
            )
    path = out_dir / "LOAD.md"
    path.write_text("\n".join(lines) + "\n")
    return path
