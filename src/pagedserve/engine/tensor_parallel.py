"""The processes of a tensor-parallel engine: the driver (rank 0, the engine's own process, which
schedules, samples and answers) and N - 1 workers, each started with torch.multiprocessing and
holding its share of the model (model/parallel.py).

Each step the driver sends the step's inputs once (token ids, lengths, block tables, block
copies, the rows whose logits it needs: a few kilobytes, pickled); every rank then runs the same
forward pass, meeting the others in the embedding's and the layers' all-reduces, and computes
its share of those rows' logits, which the driver gathers (each rank holds a share of the
vocabulary) and alone samples from. Two channels carry those:
- "shm" (the default): one file in /dev/shm that every rank maps. An all-reduce is a copy into
  the rank's slot, a flag raised, a wait for the others' flags, and the slots added in rank order,
  so that every rank computes the same sum; a step's message is written there once for all. A
  few microseconds where a loopback TCP round trip costs a millisecond.
- "gloo": torch.distributed's ProcessGroupGloo, made from a TCPStore on 127.0.0.1 rather than the
  process-wide default group, so that a process may hold more than one engine.
A worker that exits is noticed at the next step (or while the others wait on it): the engine
stops with an error naming the rank, rather than waiting for ever.

On CPU each rank computes on its own cores: the host's cores split evenly between the ranks,
the driver taking the first share."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

logger = logging.getLogger(__name__)

# How long a rank waits for the others at start-up (each loads the model) and in a collective.
_TIMEOUT = datetime.timedelta(minutes=10)
# How often a rank waiting on the others checks that they are still there.
_LIVENESS_SECONDS = 0.5


class RankLostError(RuntimeError):
    """A worker rank exited: the engine cannot go on, through no fault of any request."""


class StepInputs(NamedTuple):
    """What every rank needs to run a step's forward pass."""

    block_copies: list[tuple[int, int]]
    input_ids: list[int]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    long_prompts: list[bool]
    # The hidden rows whose logits the driver computes, a list per compute_logits call in the
    # driver's order (prompt logprobs' parts, then the sampling rows): each is a collective.
    logits_rows: list[list[int]]


class Limits(NamedTuple):
    """The most a step holds, which sizes the shared memory: tokens (each a row of hidden_size
    floats in an all-reduce), sequences and their blocks (the step's message), and a rank's
    share of the vocabulary (one row of logits, gathered a slot at a time)."""

    tokens: int
    hidden_size: int
    sequences: int
    blocks_per_sequence: int
    vocab_share: int

    def slot(self) -> int:
        """The floats of a rank's slot: a step's hidden states, or one row of its logits."""
        return max(self.tokens * self.hidden_size, self.vocab_share)

    def message_bytes(self) -> int:
        """A pickled StepInputs at most: 8 bytes an int bounds pickle's. Its logits rows are
        the prompt rows (at most a row a token) and one a seat (n > 1 siblings take seats)."""
        ints = 3 * self.tokens + self.sequences * (2 * self.blocks_per_sequence + 5)
        return 8 * ints + 65536


def core_shares(
    size: int, cpu_binding: str, what: str = "tensor_parallel_size"
) -> list[list[int] | None]:
    """Each of size processes' cores (ranks, or replicas; `what` names the setting): the cores
    this process may run on, split evenly (cpu_binding "auto"), or None for every one ("none":
    they share them)."""
    if cpu_binding == "none":
        return [None] * size
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < size:
        raise ValueError(
            f"{what} {size} is more than this machine's {len(cores)} cores; "
            "use cpu_binding 'none' to share them"
        )
    share = len(cores) // size
    return [cores[rank * share : (rank + 1) * share] for rank in range(size)]


def _bind(cores: list[int] | None) -> None:
    if cores is not None:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))


class GlooChannel:
    def __init__(self, store: dist.TCPStore, rank: int, size: int):
        self.group = dist.ProcessGroupGloo(store, rank, size, _TIMEOUT)

    def all_reduce(self, x: torch.Tensor) -> None:
        self.group.allreduce([x]).wait()

    def gather(self, x: torch.Tensor, widths: list[int]) -> torch.Tensor | None:
        """See TensorParallel.gather: the ranks' columns padded to the widest for gloo's
        all-gather (which wants equal sizes), then cut back."""
        widest = max(widths)
        padded = torch.zeros(x.shape[0], widest, dtype=x.dtype)
        padded[:, : x.shape[1]] = x
        parts = [torch.empty_like(padded) for _ in widths]
        self.group.allgather([parts], [padded]).wait()
        if self.group.rank() != 0:
            return None
        return torch.cat([part[:, :width] for part, width in zip(parts, widths, strict=True)], 1)

    def send(self, message: object) -> None:
        data = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
        self.group.broadcast(torch.tensor([len(data)], dtype=torch.int64), 0).wait()
        self.group.broadcast(data, 0).wait()

    def receive(self) -> object:
        length = torch.zeros(1, dtype=torch.int64)
        self.group.broadcast(length, 0).wait()
        data = torch.empty(int(length), dtype=torch.uint8)
        self.group.broadcast(data, 0).wait()
        return pickle.loads(data.numpy().tobytes())


class SharedMemoryChannel:
    """The "shm" channel over one mapped file. Layout: a flag per rank (the number of the last
    all-reduce it has written), the message's number and length, its bytes, then two buffers of
    one slot per rank. All-reduce number g uses buffer g % 2: a rank writes buffer g % 2 again
    only at g + 2, after every rank raised its flag for g + 1, which each does only once it has
    read g's slots. The step's message is overwritten only by the next step's, which rank 0
    sends once this step's all-reduces are done, after every rank has read it. x86 keeps one
    core's stores in order, so a raised flag (or message number) means what it covers is
    written."""

    def __init__(self, path: Path, rank: int, size: int, limits: Limits, alive: Callable[[], None]):
        self.rank, self.size, self.alive = rank, size, alive
        self.slot = limits.slot()
        self.message_capacity = limits.message_bytes()
        header = 8 * (size + 2)
        data_offset, total = self.layout(size, limits)
        memory = torch.from_file(str(path), shared=True, size=total, dtype=torch.uint8)
        self.flags = memory[: 8 * size].view(torch.int64).numpy()
        self.message_header = memory[8 * size : header].view(torch.int64).numpy()
        self.message = memory[header : header + self.message_capacity].numpy()
        data = memory[data_offset:total].view(torch.float32)
        self.buffers = data.view(2, size, self.slot)
        self.calls = 0
        self.messages_seen = 0

    @staticmethod
    def layout(size: int, limits: Limits) -> tuple[int, int]:
        """(where the all-reduce buffers start, the file's bytes)."""
        header = 8 * (size + 2)
        data_offset = -(-(header + limits.message_bytes()) // 64) * 64
        return data_offset, data_offset + 4 * 2 * size * limits.slot()

    def all_reduce(self, x: torch.Tensor) -> None:
        flat = x.view(-1)
        n = flat.numel()
        if n > self.slot:
            raise ValueError(f"all-reduce of {n} values; the shared memory holds {self.slot}")
        slots = self._exchange(flat)[:, :n]
        flat.copy_(slots[0])
        for rank in range(1, self.size):
            flat.add_(slots[rank])

    def gather(self, x: torch.Tensor, widths: list[int]) -> torch.Tensor | None:
        """See TensorParallel.gather: as many rows at a time as the widest rank's fill a slot,
        each part an exchange that rank 0 alone reads."""
        rows = x.shape[0]
        at_once = self.slot // max(widths)  # Limits.slot holds one row at least
        whole = torch.empty(rows, sum(widths)) if self.rank == 0 else None
        for begin in range(0, rows, at_once):
            part = x[begin : begin + at_once]
            slots = self._exchange(part.reshape(-1))
            if whole is None:
                continue
            column = 0
            for rank, width in enumerate(widths):
                values = slots[rank, : part.shape[0] * width].view(part.shape[0], width)
                whole[begin : begin + part.shape[0], column : column + width] = values
                column += width
        return whole

    def _exchange(self, flat: torch.Tensor) -> torch.Tensor:
        """Writes flat to this rank's slot and waits for every rank's: the [size, slot] slots
        of this call, valid until this rank's next call."""
        self.calls += 1
        slots = self.buffers[self.calls % 2]
        slots[self.rank, : flat.numel()].copy_(flat)
        self.flags[self.rank] = self.calls
        self._wait(lambda: self.flags.min() >= self.calls, spin=True)
        return slots

    def send(self, message: object) -> None:
        data = pickle.dumps(message)
        if len(data) > self.message_capacity:
            raise ValueError(
                f"a step's message of {len(data)} bytes; room for {self.message_capacity}"
            )
        self.message[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        self.message_header[1] = len(data)
        self.message_header[0] += 1  # after the bytes: a reader sees them once it sees this

    def receive(self) -> object:
        self._wait(lambda: self.message_header[0] > self.messages_seen, spin=False)
        self.messages_seen += 1
        return pickle.loads(self.message[: int(self.message_header[1])].tobytes())

    def _wait(self, done: Callable[[], bool], spin: bool) -> None:
        """Until done(): spinning inside a step, where the others are a moment away; between
        steps sleeping more and more, up to a millisecond, so that an idle worker costs
        nothing. Checks every _LIVENESS_SECONDS that the others are still there."""
        checked = time.monotonic()
        idle = 0
        while not done():
            if spin:
                os.sched_yield()
            else:
                idle += 1
                time.sleep(min(1e-3, 1e-6 * idle))
            if time.monotonic() - checked > _LIVENESS_SECONDS:
                self.alive()
                checked = time.monotonic()


def _make_channel(
    backend: str,
    store: dist.TCPStore,
    path: Path,
    rank: int,
    size: int,
    limits: Limits,
    alive: Callable[[], None],
):
    if backend == "gloo":
        return GlooChannel(store, rank, size)
    return SharedMemoryChannel(path, rank, size, limits, alive)


class Workers:
    """Ranks 1 to size - 1, each a process running a ModelRunner's forward passes; the caller is
    rank 0, whose channel (all_reduce) model/parallel.TensorParallel calls. make_runner(parallel)
    builds a rank's ModelRunner; it must be picklable (spawn)."""

    def __init__(self, size: int, backend: str, cpu_binding: str, limits: Limits, make_runner):
        shares = core_shares(size, cpu_binding)
        self.store = dist.TCPStore(
            "127.0.0.1", 0, size, is_master=True, timeout=_TIMEOUT, wait_for_workers=False
        )
        # Unlinked once every rank has mapped it (wait_until_loaded): gone with the last of them.
        handle, name = tempfile.mkstemp(prefix="pagedserve-tp-", dir=_shared_memory_dir())
        os.close(handle)
        self.path = Path(name)
        if backend == "shm":
            os.truncate(self.path, SharedMemoryChannel.layout(size, limits)[1])
        context = mp.get_context("spawn")
        self.ready: mp.Queue = context.Queue()
        self.processes = [
            context.Process(
                target=_worker_main,
                args=(
                    rank,
                    size,
                    backend,
                    self.store.port,
                    self.path,
                    limits,
                    shares[rank],
                    make_runner,
                    self.ready,
                    os.getpid(),
                ),
                name=f"pagedserve-tp-rank{rank}",
                daemon=True,
            )
            for rank in range(1, size)
        ]
        for process in self.processes:
            process.start()
        self._saved = (os.sched_getaffinity(0), torch.get_num_threads())
        _bind(shares[0])
        self.closed = False
        self.channel = _make_channel(
            backend, self.store, self.path, 0, size, limits, self.check_alive
        )

    def wait_until_loaded(self) -> None:
        """Returns once every worker has loaded its share; raises if one failed or exited."""
        waiting = len(self.processes)
        while waiting:
            try:
                rank, error = self.ready.get(timeout=1.0)
            except queue.Empty:
                self.check_alive()
                continue
            if error is not None:
                self.close()
                raise RuntimeError(f"tensor-parallel rank {rank} failed to load: {error}")
            waiting -= 1
        self.path.unlink(missing_ok=True)

    def check_alive(self) -> None:
        for rank, process in enumerate(self.processes, start=1):
            if not process.is_alive():
                self.close()
                raise RankLostError(
                    f"tensor-parallel rank {rank} exited (exit code {process.exitcode}); "
                    "the engine cannot go on without it"
                )

    def send(self, step: StepInputs) -> None:
        self.check_alive()
        self.channel.send(step)

    def close(self) -> None:
        """Tells the workers to stop (where they still listen) and waits for them."""
        if self.closed:
            return
        self.closed = True
        if all(process.is_alive() for process in self.processes):
            with contextlib.suppress(RuntimeError):  # a worker gone meanwhile
                self.channel.send(None)
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
        self.path.unlink(missing_ok=True)
        affinity, threads = self._saved
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)


def _shared_memory_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


def _worker_main(
    rank: int,
    size: int,
    backend: str,
    port: int,
    path: Path,
    limits: Limits,
    cores: Sequence[int] | None,
    make_runner,
    ready,
    driver: int,
) -> None:
    from pagedserve.model.parallel import TensorParallel

    def driver_alive() -> None:
        if os.getppid() != driver:
            raise SystemExit(f"tensor-parallel rank {rank}: the driver has exited")

    _bind(list(cores) if cores is not None else None)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=_TIMEOUT)
    channel = _make_channel(backend, store, path, rank, size, limits, driver_alive)
    try:
        runner = make_runner(TensorParallel(rank, size, channel.all_reduce, channel.gather))
    except Exception as error:  # the driver says which rank failed, and why
        ready.put((rank, f"{type(error).__name__}: {error}"))
        logger.error("rank %d failed to load:\n%s", rank, traceback.format_exc())
        return
    ready.put((rank, None))
    while (step := channel.receive()) is not None:
        runner.follow(step)
