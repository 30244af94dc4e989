"""How far a JSON constraint pulls a chat model's first token off its distribution, with and without the
template's lead (the whitespace its replies begin with) allowed before the JSON.

For each prompt, rendered with the model's chat template as `gptkit serve` renders it, prints the log-probability
the model gives its own most likely first token, and the best first token the constraint allows: forcing `{`
(no lead) and allowing the lead first (what the server does now).

    .venv/bin/python benchmarks/lead_logprob.py MODEL_DIR "Describe Romeo as JSON." "What is 2 plus 2?"
"""

from __future__ import annotations

import argparse
import json

import torch

from gptkit.chat import reply_lead
from gptkit.decoding.grammar import ANY_OBJECT, Grammar
from gptkit.loading import chat_template, load


def first_token_logprobs(model_dir: str, prompt: str, schema: str) -> dict[str, object]:
    """The model's best first token and the best each constraint allows, with their log-probabilities."""
    model, tokenizer = load(model_dir)
    template = chat_template(model_dir, tokenizer)
    ids = tokenizer.encode(template.render([{"role": "user", "content": prompt}], tools=None))
    with torch.no_grad():
        logprobs = model(torch.tensor([ids]))[0, -1].float().log_softmax(-1)
    lead = reply_lead(template.render)  # as `gptkit serve` finds it
    out: dict[str, object] = {"prompt": prompt, "lead": lead}
    best = int(logprobs.argmax())
    out["unconstrained"] = (tokenizer.decode([best]), round(float(logprobs[best]), 3))
    vocab = model.config.vocab_size
    for name, grammar_lead in (("forced {", ""), ("lead allowed", lead)):
        masked = Grammar(tokenizer, schema, vocab, grammar_lead).start().mask(logprobs)
        token = int(masked.argmax())
        out[name] = (tokenizer.decode([token]), round(float(logprobs[token]), 3))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("prompts", nargs="+")
    parser.add_argument("--schema", default=ANY_OBJECT, help="JSON schema text (default: any object, JSON mode)")
    args = parser.parse_args()
    for prompt in args.prompts:
        print(json.dumps(first_token_logprobs(args.model_dir, prompt, args.schema), ensure_ascii=False))


if __name__ == "__main__":
    main()
