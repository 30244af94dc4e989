"""Prefilling the prompts a batch admits together: their whole chunks in waves, several rows per forward.

The chunks are step.prefill_chunks' (PREFILL_CHUNK tokens at positions that are multiples of it). Here every whole
chunk before each prompt's last one runs in a wave per position: the prompts due a chunk at that position run as one
forward of (rows, PREFILL_CHUNK) tokens, and prompts sharing every token up to the chunk's end (adapter included) run
it once, the others copying its keys and values. Then each prompt's last chunk, which computes its logits: prompts of
one length (SHORTEST_SHARED_LAST tokens or more in the last chunk) in consecutive rows together (every shape as alone), the
others alone (prefill_chunks from that chunk on).

The bits are those of prefilling each prompt alone only where a row's products do not depend on its neighbours: a row
of the forward meets other rows only in the products x @ W.T (norms, activations and attention are per row), and
whether a GEMM gives a row the same bits beside other rows depends on the CPU, the thread count and the shapes (MKL
and oneDNN choose kernels and thread splits by shape). So rows_per_forward asks wave_probe, which checks the model's
own block products on this machine with this process's threads, once per model; where they fail, or where a chunk
is known to meet its neighbours (a GPU, whose GEMM chooses its kernels by M; bf16 or quantised weights; mixtures of
experts, which group tokens by expert), each chunk runs alone as before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gptkit.decoding.step import PREFILL_CHUNK, base, device_dtype, prefill_chunks
from gptkit.decoding.wave_probe import SHORTEST_SHARED_LAST, rows_independent
from gptkit.kv_cache import KVCache
from gptkit.model import GPT
from gptkit.multi_lora import rows_using
from gptkit.quantization import is_quantized

# Rows per forward at most: 32 chunks of 64 are 2,048 tokens, past which a larger GEMM gains little and the
# activations (and attention scores) of one forward keep growing.
MAX_WAVE_ROWS = 32


@dataclass
class Prompt:
    """One prompt to prefill: its cache row, its tokens, the first position not yet in the row, its LoRA adapter."""

    row: int
    seq: Sequence[int]
    start: int
    adapter: int = 0

    @property
    def last(self) -> int:
        """Where the chunk holding the prompt's last token begins."""
        return (len(self.seq) - 1) // PREFILL_CHUNK * PREFILL_CHUNK


def rows_per_forward(model: GPT) -> int:
    """How many prompts' chunks may run in one forward for model: MAX_WAVE_ROWS where fp32 weights on a CPU, dense
    feed-forwards, pass wave_probe here (a row's bits do not depend on its neighbours), else 1."""
    device, dtype = device_dtype(model)
    candidate = device.type == "cpu" and dtype == torch.float32 and base(model).config.n_experts is None
    if not candidate or is_quantized(model):
        return 1
    return MAX_WAVE_ROWS if rows_independent(base(model), MAX_WAVE_ROWS) else 1


def prefill_whole_chunks(
    model: GPT,
    cache: KVCache,
    prompts: Sequence[Prompt],
    on_block: Callable[[int, int], None] | None = None,
) -> None:
    """Compute each prompt's whole chunks from its start up to its last chunk (not included) into its row, one wave
    per position; on_block(i, b) runs right after prompt i's chunk b is in its row (while a windowed ring holds it)."""
    widest = rows_per_forward(model) if len(prompts) > 1 else 1  # one prompt needs no probe
    begins = sorted({b for p in prompts for b in range(p.start, p.last, PREFILL_CHUNK)})
    for begin in begins:
        due = [i for i, p in enumerate(prompts) if p.start <= begin < p.last]
        end = begin + PREFILL_CHUNK
        groups: dict[tuple[int, tuple[int, ...]], list[int]] = {}
        for i in due:  # prompts equal up to this chunk's end share it
            groups.setdefault((prompts[i].adapter, tuple(prompts[i].seq[:end])), []).append(i)
        leaders = sorted((prompts[members[0]] for members in groups.values()), key=lambda p: p.row)
        for run in _runs(leaders, widest):
            _forward(model, cache, run, begin)
        for members in groups.values():
            if len(members) > 1:
                span = cache.read_span(prompts[members[0]].row, begin, end)
                for i in members[1:]:
                    cache.write_span(prompts[i].row, begin, span)
        if on_block is not None:
            for i in due:
                on_block(i, begin // PREFILL_CHUNK)


def _runs(prompts: list[Prompt], widest: int) -> list[list[Prompt]]:
    """prompts (by row) cut into runs of consecutive rows, at most widest each: what one forward's cache view holds."""
    runs: list[list[Prompt]] = []
    for prompt in prompts:
        if runs and len(runs[-1]) < widest and runs[-1][-1].row + 1 == prompt.row:
            runs[-1].append(prompt)
        else:
            runs.append([prompt])
    return runs


def _forward(model: GPT, cache: KVCache, run: list[Prompt], begin: int) -> None:
    """The chunk at begin of each prompt in run (consecutive rows) in one forward: keys and values only."""
    device, _ = device_dtype(model)
    ids = torch.tensor([list(p.seq[begin : begin + PREFILL_CHUNK]) for p in run], device=device)  # (R, CHUNK)
    with rows_using(model, [p.adapter for p in run]):
        base(model).hidden(ids, cache.rows(run[0].row, len(run), begin + PREFILL_CHUNK), begin)


def prefill_last_chunks(
    model: GPT,
    cache: KVCache,
    prompts: Sequence[Prompt],
    on_block: Callable[[int, int], None] | None = None,
) -> Tensor:
    """Each prompt's last chunk into its row (every earlier position already there); logits (len(prompts), V) at
    each prompt's last token. Prompts of one length in consecutive rows run as one forward, so that every shape a
    row meets is the one it meets alone; a chunk under SHORTEST_SHARED_LAST tokens runs alone (alone, its products
    may take another kernel than the rows together, whose sums are ordered otherwise)."""
    logits: list[Tensor] = [torch.empty(0)] * len(prompts)
    widest = rows_per_forward(model) if len(prompts) > 1 else 1
    for run in _same_length_runs(prompts, widest):
        if len(run) == 1:
            p = prompts[run[0]]
            last_block = None if on_block is None else functools.partial(on_block, run[0])
            with rows_using(model, [p.adapter]):
                logits[run[0]] = prefill_chunks(model, cache, p.row, p.seq, p.last, last_block)
            continue
        first, length, last = prompts[run[0]].row, len(prompts[run[0]].seq), prompts[run[0]].last
        device, _ = device_dtype(model)
        ids = torch.tensor([list(prompts[i].seq[last:]) for i in run], device=device)  # (R, T)
        with rows_using(model, [prompts[i].adapter for i in run]):
            x = base(model).hidden(ids, cache.rows(first, len(run), length), last)  # (R, T, d)
        at = torch.tensor([length - last - 1], device=device)
        for r, i in enumerate(run):
            with rows_using(model, [prompts[i].adapter]):  # the LM head as prefill_chunks runs it: one row
                logits[i] = base(model).logits(x[r : r + 1][torch.arange(1, device=device), at][:, None])[0, 0]
            if on_block is not None and length % PREFILL_CHUNK == 0:
                on_block(i, last // PREFILL_CHUNK)
    return torch.stack(logits)


def _same_length_runs(prompts: Sequence[Prompt], widest: int) -> list[list[int]]:
    """Indices of prompts by row, cut into runs of consecutive rows whose prompts have one length (at most widest,
    and alone where the last chunk is under SHORTEST_SHARED_LAST tokens)."""
    runs: list[list[int]] = []
    for i in sorted(range(len(prompts)), key=lambda i: prompts[i].row):
        p = prompts[i]
        if runs and len(runs[-1]) < widest and len(p.seq) - p.last >= SHORTEST_SHARED_LAST:
            q = prompts[runs[-1][-1]]
            if q.row + 1 == p.row and len(q.seq) == len(p.seq):
                runs[-1].append(i)
                continue
        runs.append([i])
    return runs
