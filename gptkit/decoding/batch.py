"""The batch engine: requests share one preallocated KV cache, one row each, and decode one token per step together.

add() prefills new requests into free rows (each prompt in chunks of step.PREFILL_CHUNK tokens, the whole chunks of
the prompts admitted together run several rows a forward where that leaves every bit unchanged, prefill_waves:
identical prompts and shared prefixes run once, and blocks a prefix cache holds are copied in rather than computed)
and picks their first tokens;
step() decodes one token for every request in one forward pass; a request that finishes leaves its row at once.
Rows in use are always 0..k-1: when a row frees up, the last row's keys and values move into it, so an eager step
runs the model on exactly k rows and attends over only the positions in use. A compiled step runs
a fixed shape instead (rows rounded up to a power of two, the whole cache length), so that it compiles once per
row bucket: the rows past k ride along with a dummy token written where nothing reads it. On a CPU, rows decode
through the fused step (gptkit.decoding.fused) where it covers the model and the batch (fused.covers: up to
fused.MAX_ROWS, more where measured faster), one native call a step; the first engine after a background build of
gptkit's kernels switches to it at its next step.

Shared prefixes (gptkit.decoding.shared_prefix): where the fused step decodes, a row admitted with whole chunks in
common with a row already in the batch (bit for bit) reads them from that row's cache, so that one copy of a shared
system prompt is read each step rather than one per row.

Lookup (gptkit.decoding.lookup): a row whose request asks for lookup (request.lookup_k) and whose tokens repeat an
earlier n-gram proposes the tokens that followed it, and verify.take checks them. Where the step is the fused one, the
proposed tokens ride in it as rows of their own at the next positions of the request's cache row (lookup_rows);
elsewhere, after the step, one extra forward pass per row checks them. A row without a match decodes exactly as
without lookup.

Context: a model with learned positions sees at most its last block_size tokens (once a row is full, each further
token re-prefills that row's last block_size tokens, exactly as an uncached model cropped to block_size would see
them). Other models continue past block_size: the cache grows (doubling) up to max_context positions.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import Tensor

from gptkit.decoding import fused, lookup_rows
from gptkit.decoding.grammar import Grammar
from gptkit.decoding.lookup import Lookup
from gptkit.decoding.lookup_rows import StepRows
from gptkit.decoding.prefill_waves import Prompt, prefill_last_chunks, prefill_whole_chunks, rows_per_forward
from gptkit.decoding.prefix_cache import PrefixCache, block_layout, model_fingerprint, namespace_for
from gptkit.decoding.request import Decode, Request, TokenLogprob, seeded
from gptkit.decoding.sampling import SamplingParams, row_seed, sample
from gptkit.decoding.shared_prefix import SharedPrefixes
from gptkit.decoding.step import (
    PREFILL_CHUNK,
    base,
    check_prompts,
    compiled,
    decode_one_token,
    device_dtype,
    extend,
    inference,
    new_cache,
    prefill_chunks,
    sync,
    window,
)
from gptkit.decoding.verify import SpeculativeStats, room, take
from gptkit.errors import InputError
from gptkit.model import GPT
from gptkit.multi_lora import rows_using
from gptkit.native import library


class BatchEngine:
    """Rows of one KVCache for up to batch_size requests; add, step, cancel. Not thread-safe (one driver)."""

    def __init__(
        self,
        model: GPT,
        batch_size: int,
        max_len: int,
        compile: bool = False,
        max_context: int | None = None,
        buckets: bool = False,
        kv_dtype: torch.dtype | None = None,
        prefix_cache: PrefixCache | None = None,
        adapter: str = "",
        lookup_k: int = 0,
    ) -> None:
        """kv_dtype: what the cache stores, the model's dtype (None) or torch.int8 (gptkit.kv_cache). prefix_cache:
        where prompts' blocks of keys and values are kept and found again (the model's weights must not change while
        it is used); adapter: a name that keeps this model's blocks apart from another adapter's on the same base.
        lookup_k: the most tokens a request's lookup may propose per pass here (0: no lookup; the record of what
        was proposed and accepted: self.speculative)."""
        if batch_size < 1:
            raise InputError(f"a batch needs at least one row, got {batch_size}")
        self.model = model
        self.device, _ = device_dtype(model)
        self.vocab_size = base(model).config.vocab_size
        self.window = window(model)
        if self.window is not None:
            max_len = min(max_len, self.window)
        self.max_context = max(max_context or max_len, max_len)  # positions a row's cache may grow to
        self.lookup_k = lookup_k
        self.speculative = SpeculativeStats()
        # A verify pass writes up to k + 1 tokens it may take back: a sliding-window layer's ring keeps that many
        # spare slots, so that they never overwrite a key still in the window (gptkit.kv_cache).
        self.cache = new_cache(model, batch_size, max_len, kv_dtype, spare=lookup_k + 1 if lookup_k else 0)
        self.compile = compile
        self.buckets = buckets  # compiled: run the fewest rows of a power of two (else always batch_size rows)
        self.decode_step = compiled(model) if compile else decode_one_token
        self.fused = None if compile else self._fused_step()
        self.fused_later = self.fused is None and not compile and library.building()
        self.prefix_cache, self.adapter = prefix_cache, adapter
        self.fingerprint = model_fingerprint(base(model)) if prefix_cache is not None else ""
        self.rows: list[Request] = []  # cache row i belongs to rows[i]
        # Rows whose prompts begin alike read that prefix from one cache row in the fused step (not in a ring).
        self.shared = SharedPrefixes()
        self.shares_prefixes = all(w is None for w in self.cache.windows)
        self.steps = 0  # decode steps run
        self.max_rows_seen = 0  # the most rows one decode step ran

    @property
    def batch_size(self) -> int:
        """Rows the cache holds."""
        return self.cache.batch_size

    @property
    def max_len(self) -> int:
        """Cache positions per row now (a model without a position limit may grow it up to max_context)."""
        return self.cache.max_len

    @property
    def free_rows(self) -> int:
        """Rows without a request."""
        return self.batch_size - len(self.rows)

    def row_buckets(self) -> list[int]:
        """The row counts a compiled step runs: batch_size, and with buckets the powers of two below it."""
        sizes = [1 << i for i in range(self.batch_size.bit_length()) if 1 << i < self.batch_size]
        return (sizes if self.buckets else []) + [self.batch_size]

    def _bucket(self, rows: int) -> int:
        return next(b for b in self.row_buckets() if b >= rows)

    @torch.no_grad()
    def warm_up(self) -> float:
        """Run the decode step once on each shape it will see (compiling them), and the probe that decides prefill
        waves (prefill_waves.rows_per_forward: about a second for GPT-2 small, which the first admission would
        otherwise wait for); returns the seconds taken.

        The dummy tokens go to the last cache position of each row, which a row overwrites before attending to it.
        """
        start = time.perf_counter()
        with inference(self.model):
            rows_per_forward(self.model)
            for rows in self.row_buckets() if self.compile else [self.batch_size]:
                self.decode_step(
                    self.model,
                    torch.zeros(rows, 1, dtype=torch.long, device=self.device),
                    self.cache.view(rows, self.max_len),
                    torch.full((rows,), self.max_len - 1, device=self.device),
                )
        sync(self.device)
        return time.perf_counter() - start

    # ----- admitting and releasing requests -----

    @torch.no_grad()
    def add(self, requests: Sequence[Request]) -> list[Request]:
        """Prefill requests into free rows and pick their first tokens; returns those that already finished.

        Requests with the same prompt share one prefill. Each request draws from its own generator (seeded with
        request.seed); the rest of the engine never reads another request's state.
        """
        if len(requests) > self.free_rows:
            raise InputError(
                f"{len(requests)} requests do not fit: only {self.free_rows} of {self.batch_size} batch rows are free"
            )
        check_prompts(self.model, [r.prompt for r in requests])
        for request in requests:
            outside = [token for token, _ in request.params.logit_bias if token >= self.vocab_size]
            if outside:
                raise InputError(f"logit_bias names token {outside[0]}, outside the vocabulary [0, {self.vocab_size})")
        # Longest first: the prompts due a chunk at each position then hold consecutive rows, which one forward
        # prefills together (prefill_waves).
        requests = sorted(requests, key=lambda r: -len(r.prompt))
        seqs: list[list[int]] = []
        keys: list[tuple[int, tuple[int, ...]]] = []  # (adapter, prompt): what one prefill serves
        sources: list[int] = []
        for request in requests:
            seq = request.prompt[-self.window :] if self.window else request.prompt
            if len(seq) > self.max_len:
                self._grow(len(seq), "a prompt of")
            key = (request.adapter, tuple(seq))
            if key not in keys:
                keys.append(key)
                seqs.append(seq)
            sources.append(keys.index(key))
        first = len(self.rows)
        rows = {source: first + i for i, source in reversed(list(enumerate(sources)))}  # each seq's first row
        owners = {source: requests[i] for i, source in reversed(list(enumerate(sources)))}
        with inference(self.model):
            logits = self._prefill([Prompt(rows[i], seq, 0, owners[i].adapter) for i, seq in enumerate(seqs)], owners)
            for i, source in enumerate(sources):
                if first + i != rows[source]:  # a prompt that runs once: its other rows copy the first
                    self.cache.move_row(first + i, rows[source], len(seqs[source]))
        for request, source in zip(requests, sources):
            request.generator = request.generator or seeded(self.device, request.seed)
            request.position = len(seqs[source])
            if request.params.repetition_penalty not in (None, 1.0):
                request.seen = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
                request.seen[torch.tensor(request.tokens, device=self.device)] = True
            if request.params.frequency_penalty or request.params.presence_penalty:
                request.counts = torch.zeros(self.vocab_size, device=self.device)  # filled by accept()
            self.rows.append(request)
        if self.shares_prefixes and self.fused is not None:
            self.shared.admit(requests, self.rows, self.cache)
        self._choose(list(requests), logits[torch.tensor(sources, device=self.device)])
        return self._retire()

    def _prefill(self, prompts: list[Prompt], owners: dict[int, Request]) -> Tensor:
        """Fill each prompt's row, cached blocks copied and the rest computed (whole chunks in waves across prompts,
        then the last chunks, those of one length together); logits (len(prompts), V) at each prompt's end.
        owners[i]: prompt i's request."""
        cache = self.prefix_cache
        namespaces = [self.namespace(owners[i].adapter_name) if cache is not None else "" for i in range(len(prompts))]
        found = [self._copy_cached(p, namespace) for p, namespace in zip(prompts, namespaces)]
        for prompt, count in zip(prompts, found):
            prompt.start = count * PREFILL_CHUNK
        blocks: list[list[list[Tensor]]] = [[] for _ in prompts]

        def keep(i: int, b: int) -> None:
            # Read as soon as computed: a windowed layer's ring may overwrite the block later in the prompt.
            blocks[i].append(self.cache.read_span(prompts[i].row, b * PREFILL_CHUNK, (b + 1) * PREFILL_CHUNK))

        on_block = keep if self.prefix_cache is not None else None
        prefill_whole_chunks(self.model, self.cache, prompts, on_block)
        logits = prefill_last_chunks(self.model, self.cache, prompts, on_block)
        if cache is not None:
            for i, prompt in enumerate(prompts):
                cache.insert(namespaces[i], prompt.seq, found[i], blocks[i])
        return logits

    def _copy_cached(self, prompt: Prompt, namespace: str) -> int:
        """Copy the prefix cache's blocks that begin prompt's tokens into its row; returns how many."""
        if self.prefix_cache is None:
            return 0
        # A block read from disk must fit this cache (block_layout).
        cached = self.prefix_cache.match(namespace, prompt.seq, block_layout(self.cache))
        for b, block in enumerate(cached):
            self.cache.write_span(prompt.row, b * PREFILL_CHUNK, block)
        return len(cached)

    def namespace(self, adapter: str = "") -> str:
        """What names this engine's blocks in a prefix cache: its model (and a request's adapter), KV dtype and
        kernels now."""
        return namespace_for(self.fingerprint, self.cache.kv_dtype, self.adapter + adapter)

    def model_changed(self) -> None:
        """Choose the decode step again after the model's layers changed (an adapter served or removed: the first
        one wraps layers in AdapterSet layers, which the fused step must see)."""
        self.fused = None if self.compile else self._fused_step()

    def _fused_step(self) -> fused.FusedStep | None:
        """The fused step for this model, unless a ring holds spare slots (which the native step does not read)."""
        spare_rings = self.cache.spare and any(w is not None for w in self.cache.windows)
        return None if spare_rings else fused.step_for(self.model)

    def cancel(self, request: Request) -> None:
        """Free a request's row (finished or not); a request not in the batch is ignored."""
        if request in self.rows:
            self._release(self.rows.index(request))

    def _release(self, row: int) -> None:
        """Free a row; the last row moves into it so that rows 0..k-1 stay in use."""
        self.shared.leave(self.rows[row])
        last = len(self.rows) - 1
        if row != last:
            moved = self.rows[last]
            self.cache.move_row(row, last, min(moved.position, self.max_len))
            self.rows[row] = moved
        self.rows.pop()

    def _retire(self) -> list[Request]:
        """Release every finished request's row; returns them."""
        finished = [r for r in self.rows if r.done]
        for request in finished:
            self._release(self.rows.index(request))
        return finished

    def _grow(self, need: int, what: str) -> None:
        if need > self.max_context:
            raise InputError(f"{what} {need} tokens does not fit the {self.max_context} positions a request may use")
        self.cache.grow(min(max(2 * self.max_len, need), self.max_context))

    # ----- one step -----

    @torch.no_grad()
    def step(self) -> list[Request]:
        """Decode one token for every request; returns the requests that finished (their rows are free now)."""
        for request in self.rows:
            if request.position >= self.max_len and self.window is None:
                if self.max_len < self.max_context:
                    self._grow(request.position + 1, "a sequence of")
                else:
                    request.finish("length")  # the context is full
        finished = self._retire()
        if not self.rows:
            return finished
        k = len(self.rows)
        windowed = [i for i, r in enumerate(self.rows) if r.position >= self.max_len]
        for i in windowed:  # its step writes a dummy at position 0, then its row is written anew
            self.shared.rewrite(self.rows[i])
        positions = [r.position if i not in windowed else 0 for i, r in enumerate(self.rows)]
        # Through the fused step the proposals ride in the step itself; elsewhere an eager pass per row checks them.
        joined = self.lookup_k > 0 and self._fused_applies(k)
        if joined:
            rows = lookup_rows.plan(self.rows, positions, self.lookup_k, self.max_len, fused.row_limit(k))
        else:
            rows = StepRows([r.last_token for r in self.rows], positions, list(range(k)), list(range(k)))
        with inference(self.model):
            logits = self._decode_rows(rows)
            if windowed:
                # A full learned-position row: recompute its last `window` tokens at positions 0.. (after the
                # batched step, which wrote a dummy token into this row).
                for i in windowed:
                    with rows_using(self.model, [self.rows[i].adapter]):
                        last = prefill_chunks(self.model, self.cache, i, self.rows[i].tokens[-self.max_len :])
                        logits[rows.first[i]] = last
        plain = rows.plain()
        for i in plain:
            self.rows[i].position = self.max_len if i in windowed else self.rows[i].position + 1
        self.steps += 1
        self.max_rows_seen = max(self.max_rows_seen, k)
        self._choose(
            [self.rows[i] for i in plain], logits[[rows.first[i] for i in plain]] if rows.proposals else logits
        )
        self._take(rows, logits)
        if self.lookup_k and not joined:
            self._look_up()
        return finished + self._retire()

    def _decode_rows(self, rows: StepRows) -> Tensor:
        """Logits (rows, V) of one step: rows 0..k-1 one each, or (fused) with proposals riding in their requests'
        cache rows."""
        if not rows.proposals:
            with rows_using(self.model, [r.adapter for r in self.rows]):
                return self._decode(rows.tokens, rows.positions)
        ids = torch.tensor(rows.tokens)[:, None]
        view = self.cache.view(len(self.rows), self.max_len)
        shared = self.shared.pairs(self.rows, rows.slots)
        with rows_using(self.model, [self.rows[slot].adapter for slot in rows.slots]):
            return self.fused(self.model, ids, view, torch.tensor(rows.positions), torch.tensor(rows.slots), shared)

    def _take(self, rows: StepRows, logits: Tensor) -> None:
        """Check each proposal that rode in the step on its request's rows of logits (verify.take)."""
        for i, proposal in rows.proposals.items():
            request, first = self.rows[i], rows.first[i]
            accepted = take(logits[first : first + len(proposal.tokens) + 1], proposal, request, self.speculative)
            request.position += accepted + 1  # the keys of the last token and the accepted ones are kept

    def _look_up(self) -> None:
        """Each row whose tokens repeat an earlier n-gram: one forward pass checks what followed it (lookup)."""
        for i, request in enumerate(self.rows):
            if not lookup_rows.checks(request):
                continue
            # The pass writes positions p .. p + n: they must fit the cache (a learned window slides past it,
            # token by token, in step()).
            n = min(room(request, min(request.lookup_k, self.lookup_k)), self.max_len - 1 - request.position)
            proposal = Lookup(request.lookup_k, request.lookup_ngram).propose(request, n) if n > 0 else None
            if proposal is None or not proposal.tokens:
                continue
            p = request.position
            ids = torch.tensor([[request.last_token, *proposal.tokens]], device=self.device)
            with inference(self.model), rows_using(self.model, [request.adapter]):
                logits = extend(self.model, ids, self.cache.row(i, p + ids.size(1)), p)[0]
            accepted = take(logits, proposal, request, self.speculative)
            request.position = p + accepted + 1  # the keys of the last token and the accepted ones are kept

    def _decode(self, tokens: list[int], positions: list[int]) -> Tensor:
        """Logits (k, V) of one decode step over rows 0..k-1."""
        k = len(tokens)
        if self.compile:  # a fixed shape per row bucket; the extra rows write at a position nothing reads
            rows = self._bucket(k)
            pad = rows - k
            ids = torch.tensor(tokens + [0] * pad, device=self.device)[:, None]
            where = torch.tensor(positions + [self.max_len - 1] * pad, device=self.device)
            return self.decode_step(self.model, ids, self.cache.view(rows, self.max_len), where)[:k]
        ids = torch.tensor(tokens, device=self.device)[:, None]
        if self._fused_applies(k):
            shared = self.shared.pairs(self.rows, range(k))
            return self.fused(self.model, ids, self.cache.view(k, self.max_len), torch.tensor(positions), None, shared)
        view = self.cache.view(k, max(positions) + 1)
        if len(set(positions)) == 1:  # an int position: attention reads the filled positions without a mask
            return decode_one_token(self.model, ids, view, positions[0])
        return decode_one_token(self.model, ids, view, torch.tensor(positions, device=self.device))

    def _fused_applies(self, rows: int) -> bool:
        """Whether a step of `rows` rows decodes through the fused step (switched to once a background build of the
        kernels has ended)."""
        if self.compile:
            return False
        if self.fused_later and not library.building():
            self.fused, self.fused_later = self._fused_step(), False
        return self.fused is not None and fused.covers(rows)

    def _choose(self, requests: list[Request], logits: Tensor) -> None:
        """Pick each request's next token from its row of logits (one host sync for all), then record it."""
        if all(r.plain_greedy for r in requests):
            for request, token in zip(requests, logits.argmax(dim=-1).tolist()):
                request.accept(token)
            return
        logits = logits.float()
        chosen = []
        for i, request in enumerate(requests):
            row = logits[i]
            if request.constraint is not None:
                row = request.constraint.mask(row)
            seen = None if request.seen is None else request.seen[None]
            counts = None if request.counts is None else request.counts[None]
            chosen.append(sample(row[None], request.generator, request.params, seen, counts))
        tokens = torch.cat(chosen).tolist()
        wanted = [i for i, r in enumerate(requests) if r.top_logprobs is not None]
        infos: dict[int, TokenLogprob] = {}
        if wanted:
            logprobs = logits[wanted].log_softmax(dim=-1)
            for j, i in enumerate(wanted):
                infos[i] = _token_logprob(logprobs[j], tokens[i], requests[i].top_logprobs)
        for i, (request, token) in enumerate(zip(requests, tokens)):
            request.accept(token, infos.get(i))


def _token_logprob(logprobs: Tensor, token: int, top: int) -> TokenLogprob:
    """The token's log-probability and the `top` most likely alternatives."""
    alternatives = []
    if top > 0:
        values, ids = logprobs.topk(min(top, logprobs.numel()))
        alternatives = list(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token, float(logprobs[token]), alternatives)


def requests_for(
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    eos_ids: tuple[int, ...] = (),
    decode: Decode | None = None,
    grammar: Grammar | None = None,
    lookup: Lookup | None = None,
) -> list[Request]:
    """params.num_samples requests per prompt, prompt-major; request r of the call draws with params.seed + r;
    each follows its own start of grammar when one is given, and speculates by lookup when one is given."""
    return [
        Request(
            list(p),
            params,
            eos_ids,
            decode,
            seed=row_seed(params.seed, i * params.num_samples + j),
            constraint=grammar.start() if grammar is not None else None,
            lookup_k=lookup.k if lookup is not None else 0,
            lookup_ngram=lookup.ngram if lookup is not None else 0,
        )
        for i, p in enumerate(prompts)
        for j in range(params.num_samples)
    ]
