"""Beam search for one prompt with Hugging Face's semantics (length penalty, early stopping), on the decode step.

Candidates are scored by summed log-probability; a finished hypothesis by that sum / generated_length **
length_penalty. Each step keeps the 2 * num_beams best continuations so num_beams stay open even when some end.
The beams are rows of one KV cache, reordered after their parents each step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from gptkit.decoding.request import Decode, EosIds, FinishReason, end_ids, first_stop
from gptkit.decoding.sampling import EarlyStopping, SamplingParams, apply_repetition_penalty
from gptkit.decoding.step import (
    base,
    cache_len,
    check_prompts,
    compiled,
    decode_one_token,
    device_dtype,
    inference,
    new_cache,
    prefill_rows,
    window,
)
from gptkit.errors import ConfigError
from gptkit.model import GPT

_FINISHED = -1.0e9  # Hugging Face's beam search marks impossible candidates with this score offset


@torch.no_grad()
def beam_search(
    model: GPT,
    prompt: Sequence[int],
    params: SamplingParams,
    eos_id: EosIds = None,
    decode: Decode | None = None,
    compile: bool = False,
) -> list[tuple[list[int], FinishReason]]:
    """Hugging Face's beam search for one prompt: the best params.num_samples (new ids, finish reason), best first.

    Candidates are scored by summed log-probability; a finished hypothesis by that sum / generated_length **
    length_penalty. Each step keeps the 2 * num_beams best continuations so num_beams stay open even when some end.
    """
    check_prompts(model, [prompt])
    if params.stop and decode is None:
        raise ConfigError("stop strings need a decode function (a tokenizer) to find them in the output")
    eos_ids = end_ids(eos_id)
    n, keep, lp = params.num_beams, 2 * params.num_beams, params.length_penalty
    prompt_len = len(prompt)
    total_len = prompt_len + params.max_new_tokens
    window_len = cache_len(model, total_len, compile)
    step = compiled(model) if compile else decode_one_token
    slides = window(model) is not None and window_len < total_len
    device, _ = device_dtype(model)
    cache = new_cache(model, n, window_len)
    seqs = torch.full((n, total_len), 0, dtype=torch.long, device=device)
    seqs[:, :prompt_len] = torch.tensor(list(prompt), device=device)
    scores = torch.full((n,), _FINISHED, device=device)
    scores[0] = 0.0  # only the first beam is live at the start, so the beams do not all pick the same tokens
    done_seqs, done_scores = seqs.clone(), torch.full((n,), _FINISHED, device=device)
    done_lens = torch.zeros(n, dtype=torch.long, device=device)
    done_flags = torch.zeros(n, dtype=torch.bool, device=device)
    improvable = True
    seen = torch.zeros(n, base(model).config.vocab_size, dtype=torch.bool, device=device)
    seen[:, seqs[0, :prompt_len]] = True
    in_top = torch.arange(keep, device=device) < n

    with inference(model):
        start = list(prompt[-window_len:])
        logits = prefill_rows(model, cache, range(n), [start], [0] * n).expand(n, -1)
        cur = prompt_len
        while True:
            logprobs = logits.float().log_softmax(dim=-1)
            if params.repetition_penalty is not None and params.repetition_penalty != 1.0:
                logprobs = apply_repetition_penalty(logprobs, seen, params.repetition_penalty)
            vocab = logprobs.size(-1)
            top_scores, top_index = torch.topk((logprobs + scores[:, None]).view(-1), keep)
            parents, tokens = top_index // vocab, top_index % vocab
            cand = seqs[parents]
            cand[:, cur] = tokens
            ends = _candidate_ends(cand, tokens, prompt_len, cur, total_len, eos_ids, params.stop, decode)

            # the num_beams best candidates that go on
            live_scores = top_scores + ends.float() * _FINISHED
            chosen = torch.topk(live_scores, n).indices
            seqs, scores, parent_of = cand[chosen], live_scores[chosen], parents[chosen]

            # the candidates among the top num_beams that just ended join the finished hypotheses
            just_done = ends & in_top
            new_scores = top_scores / float(cur + 1 - prompt_len) ** lp
            if bool(done_flags.all()) and params.early_stopping is True:
                new_scores = new_scores + _FINISHED
            if not improvable:
                new_scores = new_scores + _FINISHED
            new_scores = new_scores + (~just_done).float() * _FINISHED
            best = torch.topk(torch.cat([done_scores, new_scores]), n).indices
            done_seqs = torch.cat([done_seqs, cand])[best]
            done_scores = torch.cat([done_scores, new_scores])[best]
            done_lens = torch.cat([done_lens, torch.full((keep,), cur + 1 - prompt_len, device=device)])[best]
            done_flags = torch.cat([done_flags, just_done])[best]

            cur += 1
            improvable = improvable and _can_improve(
                scores, done_scores, done_flags, cur, total_len, prompt_len, params.early_stopping, lp
            )
            if not improvable or bool(ends.all()) or (bool(done_flags.all()) and params.early_stopping is True):
                break
            seen = seen[parent_of]
            seen[torch.arange(n, device=device), seqs[:, cur - 1]] = True
            cache.reorder(parent_of)
            if slides and cur > window_len:
                logits = prefill_rows(model, cache, range(n), seqs[:, cur - window_len : cur].tolist(), range(n))
            else:
                positions = torch.full((n,), cur - 1, device=device)
                logits = step(model, seqs[:, cur - 1 : cur], cache, positions)

    results: list[tuple[list[int], FinishReason]] = []
    for row, length in zip(done_seqs[: params.num_samples].tolist(), done_lens[: params.num_samples].tolist()):
        new = row[prompt_len : prompt_len + length]
        if new and new[-1] in eos_ids:
            results.append((new[:-1], "eos"))
        elif params.stop and first_stop(decode(new), params.stop) >= 0:
            results.append((new, "stop"))
        else:
            results.append((new, "length"))
    return results


def _candidate_ends(
    cand: Tensor,
    tokens: Tensor,
    prompt_len: int,
    cur: int,
    total_len: int,
    eos_ids: tuple[int, ...],
    stops: Sequence[str],
    decode: Decode | None,
) -> Tensor:
    """Which candidates end here: at the end-of-text token, a stop string or the length limit."""
    if cur + 1 >= total_len:
        return torch.ones_like(tokens, dtype=torch.bool)
    ends = torch.isin(tokens, torch.tensor(eos_ids, dtype=tokens.dtype, device=tokens.device))
    if stops:
        rows = cand[:, prompt_len : cur + 1].tolist()
        hits = [first_stop(decode(r), stops) >= 0 for r in rows]
        ends = ends | torch.tensor(hits, device=tokens.device)
    return ends


def _can_improve(
    scores: Tensor,
    done_scores: Tensor,
    done_flags: Tensor,
    cur: int,
    total_len: int,
    prompt_len: int,
    early_stopping: EarlyStopping,
    length_penalty: float,
) -> bool:
    """Hugging Face's test: could the best open beam still beat the worst kept finished hypothesis?"""
    if early_stopping == "never" and length_penalty > 0.0:
        best_length = total_len - prompt_len
    else:
        best_length = cur - prompt_len
    best_possible = scores[0] / float(best_length) ** length_penalty
    worst_done = torch.where(done_flags, done_scores.min(), torch.full_like(done_scores, _FINISHED))
    return bool((best_possible > worst_done).any())
