"""Run inside vLLM's venv (make vllm) by tests/formats/test_vllm_handoff.py: load one HF export in vLLM's offline
engine, decode token prompts greedily and render a chat with the export's template; write what vLLM did as JSON.

usage: python vllm_run.py JOB.json RESULT.json, where JOB.json holds model (an HF directory), prompts (lists of
token ids), max_tokens, messages (a chat) and expert_parallel (a bool). It imports nothing from gptkit.
"""

from __future__ import annotations

import json
import sys

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt


def main(job_path: str, result_path: str) -> None:
    """Decode the job's prompts and chat in vLLM and write token ids, their logprobs and the chat's prompt ids."""
    with open(job_path, encoding="utf-8") as file:
        job = json.load(file)
    # float32 so that the logprobs compare with gptkit's fp32 ones; eager, since compiling takes minutes on 2 cores
    llm = LLM(
        model=job["model"],
        dtype="float32",
        enforce_eager=True,
        max_model_len=job["max_model_len"],
        seed=0,
        enable_expert_parallel=job["expert_parallel"],
    )
    # logprobs=1: the chosen token's logprob comes with the top one; ignore_eos: every prompt runs max_tokens
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], logprobs=1, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]], params)
    decoded = []
    for output in outputs:
        completion = output.outputs[0]
        chosen = [step[token].logprob for token, step in zip(completion.token_ids, completion.logprobs)]
        decoded.append({"tokens": list(completion.token_ids), "logprobs": chosen})
    chat = llm.chat(job["messages"], SamplingParams(temperature=0.0, max_tokens=1))
    result = {"decoded": decoded, "chat_prompt_ids": list(chat[0].prompt_token_ids)}
    with open(result_path, "w", encoding="utf-8") as file:
        json.dump(result, file)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
