"""Supervised fine-tuning: example data (formats, templates, trained-token masks), padded and packed batches,
LoRA (PEFT's semantics and format), adapter-only checkpoints, and every command taking a LoRA directory."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import VARIANTS, reversal_rows, same_run, write_jsonl

from gptkit.adapters import adapters, adapters_disabled, add_lora, fingerprint, merge_lora
from gptkit.chat import ChatTemplate, eos_text, load_chat_template
from gptkit.cli import main
from gptkit.config import ModelConfig
from gptkit.data import EXAMPLE_FILES, ExampleBatches, Examples, example_rows, load_examples, read_meta
from gptkit.errors import GptkitError, InputError
from gptkit.finetune.catalogue import check_parts
from gptkit.formats.hf import hf_block_modules
from gptkit.formats.lora import is_lora_dir, write_lora_dir, write_peft_dir
from gptkit.formats.modeldir import save_model_dir
from gptkit.loading import load
from gptkit.loss import IGNORE_INDEX
from gptkit.model import GPT
from gptkit.prepare.rows import ExampleEncoder, row_format
from gptkit.run_sources import from_sources
from gptkit.tokenizer import EOT, BPETokenizer, ByteTokenizer, load_tokenizer
from gptkit.train import train
from gptkit.weights import model_state

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ message['content'] }}<|im_end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "Colour of the sky?"},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "And of grass?"},
    {"role": "assistant", "content": "Green."},
]


def chatml_dir(path: Path) -> Path:
    """A byte-level BPE tokenizer with ChatML specials and a ChatML template, saved as Hugging Face saves one."""
    path.mkdir(parents=True, exist_ok=True)
    text = "The quick brown fox jumps over the lazy dog. Colour of the sky? Blue. And of grass? Green. " * 20
    tokenizer = BPETokenizer.train([text], 300, specials=(EOT, "<|im_start|>", "<|im_end|>"))
    (path / "tokenizer.json").write_text(tokenizer.hf.to_str())
    config = {"chat_template": CHATML, "eos_token": "<|im_end|>", "tokenizer_class": "PreTrainedTokenizerFast"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


# ---------------------------------------------------------------- rendering and masks


def test_conversation_tokens_and_mask_equal_transformers_apply_chat_template(tmp_path):
    transformers = pytest.importorskip("transformers")
    directory = chatml_dir(tmp_path / "tok")
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    want = hf.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    tokenizer = load_tokenizer(directory)
    template = load_chat_template(directory, eos_text(tokenizer))
    example = ExampleEncoder(tokenizer, template).encode({"messages": CONVERSATION}, "messages", "x")
    assert example.ids.tolist() == list(want["input_ids"])
    assert example.trained.astype(int).tolist() == list(want["assistant_masks"])
    assert tokenizer.decode(example.ids[example.trained].tolist()) == "Blue.<|im_end|>Green.<|im_end|>"


@pytest.mark.parametrize("kind", ["default", "chatml"])
def test_each_reply_follows_exactly_the_prompt_serving_encodes(kind, tmp_path):
    """Training sees, before each reply, the very tokens the server feeds the model for that turn."""
    if kind == "chatml":
        tokenizer = load_tokenizer(chatml_dir(tmp_path))
        template = load_chat_template(tmp_path, eos_text(tokenizer))
    else:
        tokenizer, template = ByteTokenizer(), ChatTemplate(eos_token=EOT)
    example = ExampleEncoder(tokenizer, template).encode({"messages": CONVERSATION}, "messages", "x")
    ids, trained = example.ids.tolist(), example.trained.tolist()
    starts = [i for i in range(1, len(ids)) if trained[i] and not trained[i - 1]]
    assert len(starts) == 2
    for turn, start in zip((2, 4), starts):
        prompt = tokenizer.encode(template.render(CONVERSATION[:turn]))  # as /v1/chat/completions encodes it
        assert ids[:start] == prompt
        reply = ids[start : start + trained[start:].index(False) if False in trained[start:] else len(ids)]
        assert reply[-1] in tokenizer.eos_ids and reply.count(reply[-1]) == 1  # ends at one end-of-text token
        assert tokenizer.decode(reply[:-1]).strip() == CONVERSATION[turn]["content"]
    if kind == "default":
        text = template.render(CONVERSATION, add_generation_prompt=False)
        assert text.startswith(
            "system: You answer in one word.\n\nuser: Colour of the sky?\n\nassistant: Blue.<|endoftext|>"
        )


def test_formats_and_what_each_trains(tmp_path):
    tokenizer, template = ByteTokenizer(), ChatTemplate(eos_token=EOT)
    encoder = ExampleEncoder(tokenizer, template)

    def trained_text(record):
        example = encoder.encode(record, row_format(record), "x")
        return tokenizer.decode(example.ids.tolist()), tokenizer.decode(example.ids[example.trained].tolist())

    assert trained_text({"prompt": "2+2=", "completion": "4"}) == ("2+2=4<|endoftext|>", "4<|endoftext|>")
    whole, reply = trained_text({"instruction": "Add.", "input": "2 and 2", "output": "4"})
    assert whole == "user: Add.\n\n2 and 2\n\nassistant: 4<|endoftext|>\n\n" and reply == " 4<|endoftext|>"
    assert trained_text({"text": "hello"}) == ("hello<|endoftext|>", "hello<|endoftext|>")
    record = {
        "prompt": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Yo"},
            {"role": "user", "content": "Bye"},
        ],
        "completion": [{"role": "assistant", "content": "Ciao"}],
    }
    whole, reply = trained_text(record)
    assert reply == " Ciao<|endoftext|>" and "Yo<|endoftext|>" in whole  # an earlier reply is context only
    everything = ExampleEncoder(tokenizer, template, loss_on="all").encode(record, "prompt_completion", "x")
    assert everything.trained.all()


def test_malformed_rows_are_one_line_errors_naming_file_and_line(tmp_path, capsys):
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    cases = {
        "not json": ([good, "{oops"], "line 2 is not valid JSON"),
        "unknown role": (
            [good, {"messages": [{"role": "wizard", "content": "x"}]}],
            "line 2: message 1 has unknown role 'wizard'",
        ),
        "no trained token": ([good, {"messages": [{"role": "user", "content": "x"}]}], "line 2 has no trained token"),
        "another format": ([good, {"prompt": "p", "completion": "c"}], "line 2 is not a messages row"),
        "mixed prompt": (
            [{"prompt": "p", "completion": [{"role": "assistant", "content": "c"}]}],
            'line 1: "prompt" and "completion" must both',
        ),
        "no content": (
            [{"messages": [{"role": "user"}, {"role": "assistant", "content": "c"}]}],
            "line 1: message 1 (user) needs a string",
        ),
        "unknown keys": ([{"question": "q"}], 'line 1 has no string field "text" (nor is it a supervised example'),
    }
    for name, (rows, message) in cases.items():
        path = write_jsonl(tmp_path / f"{name.replace(' ', '_')}.jsonl", rows)
        assert main(["prepare", "--input", str(path), "--tokenizer", "byte", "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress bar, if it showed
        assert err.startswith("gptkit prepare: error: ") and str(path) in err and message in err, (name, err)
    text = tmp_path / "plain.txt"
    text.write_text("some text")
    chat = write_jsonl(tmp_path / "chat.jsonl", [good])
    assert (
        main(
            [
                "prepare",
                "--input",
                str(chat),
                "--input",
                str(text),
                "--tokenizer",
                "byte",
                "--out",
                str(tmp_path / "out"),
            ]
        )
        == 2
    )
    assert "plain text" in capsys.readouterr().err


def test_prepare_examples_split_truncation_and_files(tmp_path, capsys):
    rows = reversal_rows(40) + [
        {"messages": [{"role": "user", "content": "x" * 80}, {"role": "assistant", "content": "y"}]},
        {"messages": [{"role": "user", "content": "z"}, {"role": "assistant", "content": "w" * 80}]},
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    out = tmp_path / "data"
    assert main(["prepare", "--input", str(path), "--tokenizer", "byte", "--out", str(out), "--max-length", "48"]) == 0
    meta = read_meta(out)
    # The long prompt leaves nothing trained once cut to 48 tokens (dropped); the long reply is cut (truncated).
    assert (meta.kind, meta.dropped, meta.truncated, meta.max_length) == ("examples", 1, 1, 48)
    assert (meta.train_examples, meta.val_examples) == (37, 4)  # round(41 * 0.1) held out
    assert "41 examples" in capsys.readouterr().out
    train_split, val_split = load_examples(out, "train", meta), load_examples(out, "val", meta)
    assert train_split.lengths().max() <= 48 and int(train_split.targets().sum()) == meta.train_targets
    assert int(val_split.targets().sum()) == meta.val_targets
    tokenizer = ByteTokenizer()
    texts = {
        tokenizer.decode(train_split.ids[a:b].tolist()) for a, b in zip(train_split.offsets, train_split.offsets[1:])
    }
    assert "user: Reverse: apple\n\nassistant: elppa<|endoftext|>\n\n" in texts  # the template's whole text
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [
            "gptkit_tokenizer.json",
            "meta.json",
            *(n for f in EXAMPLE_FILES.values() for k, n in f.items() if k != "labels"),
        ]
    )
    again = tmp_path / "again"
    assert (
        main(
            [
                "prepare",
                "--input",
                str(path),
                "--tokenizer",
                "byte",
                "--out",
                str(again),
                "--max-length",
                "48",
                "--overlong",
                "drop",
            ]
        )
        == 0
    )
    assert (read_meta(again).dropped, read_meta(again).truncated) == (2, 0)
    assert np.array_equal(
        np.fromfile(out / "val.bin", np.uint16), np.fromfile(tmp_path / "data" / "val.bin", np.uint16)
    )


# ---------------------------------------------------------------- batches and the loss


def _examples(lengths: list[int], vocab: int = 50, seed: int = 0) -> Examples:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, sum(lengths)).astype(np.uint16)
    trained = (rng.random(sum(lengths)) < 0.6).astype(np.uint8)
    return Examples(ids, trained, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))


@torch.no_grad()
def _nll(model: GPT, examples: Examples, rows: list[list[int]], packed: bool) -> tuple[float, int]:
    batch = example_rows(examples, rows, model.config.block_size, packed)
    x, y, docs = batch.x, batch.y, batch.document_ids
    count = int((y != IGNORE_INDEX).sum())
    return float(model(x, targets=y, document_ids=docs)) * count, count


def test_packed_and_padded_losses_agree(variant_config):
    examples = _examples([5, 9, 3, 12, 7, 4, 16, 2, 8])
    model = GPT(variant_config).eval()
    padded = _nll(model, examples, [[i] for i in range(len(examples))], packed=False)
    packed = _nll(model, examples, [[0, 1], [2, 3], [4, 5], [6], [7, 8]], packed=True)
    assert padded[1] == packed[1] == int(examples.targets().sum())
    assert abs(padded[0] - packed[0]) / padded[1] < 1e-5


def test_document_ids_give_each_document_its_own_forward(variant_config):
    model = GPT(variant_config).eval()
    docs = [torch.randint(0, 50, (n,)) for n in (6, 4, 5)]
    row = torch.cat(docs)[None]
    document_ids = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])[None]
    packed = model(row, document_ids=document_ids)[0]
    separate = torch.cat([model(d[None])[0] for d in docs])
    torch.testing.assert_close(packed, separate, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_the_loss_ignores_exactly_the_untrained_tokens():
    examples = _examples([6, 11, 4])
    model = GPT(ModelConfig(**VARIANTS["gpt2"])).eval()
    batch = example_rows(examples, [[0], [1], [2]], 16, packed=False)
    x, y = batch.x, batch.y
    logprobs = model(x).log_softmax(-1)
    picked = [(-logprobs[r, t, y[r, t]]).item() for r in range(3) for t in range(x.size(1)) if y[r, t] != IGNORE_INDEX]
    assert len(picked) == int(examples.targets().sum())
    assert model(x, targets=y).item() == pytest.approx(sum(picked) / len(picked), rel=1e-5)


def test_example_batches_cover_every_example_per_epoch_and_resume():
    examples = _examples([3, 5, 2, 7, 4, 6, 3, 8, 2, 5])
    for packed in (False, True):
        batches = ExampleBatches(examples, block_size=16, batch_size=2, seed=3, packed=packed, group=2)
        rows = batches._items_of(0)
        assert sorted(i for row in rows for i in row) == list(range(10))
        assert all(sum(int(examples.lengths()[i]) - 1 for i in row) <= 16 for row in rows)
        first = [batches.next_batch() for _ in range(6)]
        assert first[0].step_units == first[0].units + first[1].units == first[1].step_units
        again = ExampleBatches(examples, block_size=16, batch_size=2, seed=99, packed=packed, group=2)
        again.load_state_dict({"seed": 3, "step": 4})
        assert torch.equal(again.next_batch().x, first[4].x)
    with pytest.raises(InputError, match="--max-length 5"):
        ExampleBatches(examples, block_size=4, batch_size=2, seed=0, packed=False)


# ---------------------------------------------------------------- LoRA


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa"])
def test_lora_starts_as_the_base_and_merges_exactly(name, device):
    config = ModelConfig(**VARIANTS[name])
    model = GPT(config).eval().to(device)
    ids = torch.randint(0, 50, (2, 12), device=device)
    base = model(ids)
    add_lora(model, rank=4, alpha=8.0, dropout=0.0, targets="all")
    assert torch.equal(model(ids), base)  # B starts at zero
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{a}.{p}" for a in adapters(model) for p in ("lora_A", "lora_B")}
    assert len(adapters(model)) == 4 * config.n_layer
    with torch.no_grad():
        for adapter in adapters(model).values():
            adapter.lora_B.normal_(0, 0.2)
    adapted = model(ids)
    assert (adapted - base).abs().max() > 1e-2
    with adapters_disabled(model):
        assert torch.equal(model(ids), base)
    merged = merge_lora(model)
    assert not adapters(merged)
    torch.testing.assert_close(merged(ids), adapted, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("precision", ["bfloat16", "int8"])
def test_adapters_train_over_a_bfloat16_or_int8_base(precision, device):
    from gptkit.formats.lora import with_precision

    model = with_precision(GPT(ModelConfig(**VARIANTS["gpt2"])).to(device), precision)
    add_lora(model, rank=4, alpha=8.0, dropout=0.0, targets="all")
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 50, (4, 16), device=device)
    first = None
    for _ in range(15):
        loss = model(ids[:, :-1], targets=ids[:, 1:])
        first = first if first is not None else loss.item()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert loss.item() < first - 0.3
    assert all(a.lora_A.dtype == torch.float32 for a in adapters(model).values())
    stored = {a.base.weight.dtype for a in adapters(model).values()}
    assert stored == {torch.bfloat16 if precision == "bfloat16" else torch.int8}


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa"])
def test_peft_loads_the_exported_adapters_with_gptkits_logits(name, tmp_path):
    pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    config = ModelConfig(**(VARIANTS[name] | {"vocab_size": 257, "block_size": 32}))
    base_dir = save_model_dir(GPT(config), tmp_path / "base", tokenizer=ByteTokenizer())
    assert main(["convert", "--to-hf", str(base_dir), "--out", str(tmp_path / "base_hf")]) == 0
    model, _ = load(base_dir)
    add_lora(model, rank=3, alpha=5.0, dropout=0.0, targets="all")
    with torch.no_grad():
        for adapter in adapters(model).values():
            adapter.lora_B.normal_(0, 0.2)
    settings = {
        "base": str(base_dir.resolve()),
        "base_fingerprint": fingerprint(model_state(load(base_dir)[0])),
        "rank": 3,
        "alpha": 5.0,
        "dropout": 0.0,
        "targets": "all",
        "base_precision": "float32",
    }
    adapters_dir = write_lora_dir(model, tmp_path / "lora", settings)
    write_peft_dir(adapters_dir, tmp_path / "adapter", *hf_block_modules(config))
    hf = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tmp_path / "base_hf"), tmp_path / "adapter"
    )
    ids = torch.randint(0, 257, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(ids).logits, model.eval()(ids), atol=1e-4, rtol=1e-4)
        merged, _ = load(adapters_dir)
        torch.testing.assert_close(merged(ids), model(ids), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- training runs


def _run_config(data: Path, out: Path, base: Path | None, **finetune) -> object:
    train_settings = dict(
        data_dir=str(data),
        out_dir=str(out),
        max_steps=6,
        batch_size=4,
        eval_interval=3,
        eval_iters=2,
        log_interval=1,
        checkpoint_interval=3,
        device="cpu",
        plot=False,
        sample_every=0,  # samples: tests/observe/test_observe_training.py (most of such a run's time)
    )
    train_settings.update(finetune.pop("train", {}))
    model = (
        {"init_from": str(base)} if base is not None else {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 64}
    )
    model.update(finetune.pop("model", {}))
    optim = {"warmup_steps": 1, "lr": 3e-3, "decay_steps": 6}  # a shorter run keeps the schedule: resume is exact
    return from_sources(None, {"model": model, "optim": optim, "train": train_settings, "finetune": finetune})


def _losses(run: Path) -> dict[int, float]:
    return {
        r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r
    }


def test_grad_accumulation_weighs_micro_batches_by_their_trained_tokens(sft, tmp_path):
    base, data = sft
    no_dropout = {"dropout": 0.0}  # the same examples then give the same losses however they are grouped
    one = train(_run_config(data, tmp_path / "one", base, model=no_dropout, train={"batch_size": 4}), progress=False)
    two = train(
        _run_config(data, tmp_path / "two", base, model=no_dropout, train={"batch_size": 2, "grad_accum": 2}),
        progress=False,
    )
    a, b = _losses(one.run_dir), _losses(two.run_dir)
    assert a.keys() == b.keys() and max(abs(a[s] - b[s]) for s in a) < 1e-5


@pytest.mark.parametrize("packing", [False, True])
def test_lora_run_checkpoints_adapters_only_and_resumes_exactly(packing, sft, tmp_path, device):
    base, data = sft
    lora = dict(
        method="lora",
        lora_rank=4,
        lora_dropout=0.1,
        packing=packing,  # dropout: the RNG must resume too
        train={"device": device.type},
    )
    whole = train(_run_config(data, tmp_path / "whole", base, **lora), progress=False)
    checkpoint = whole.checkpoint
    assert is_lora_dir(checkpoint) and not (checkpoint / "model.safetensors").exists()
    assert (checkpoint / "adapters.safetensors").stat().st_size < 20_000
    three = {**lora, "train": {"max_steps": 3, "device": device.type}}
    part = train(_run_config(data, tmp_path / "part", base, **three), progress=False)
    resumed = train(_run_config(data, part.run_dir, base, **lora), resume=True, progress=False)
    torch.testing.assert_close(_losses(resumed.run_dir), _losses(whole.run_dir), **same_run(device))
    got, want = (load(c)[0].state_dict() for c in (resumed.checkpoint, checkpoint))
    torch.testing.assert_close(got, want, **same_run(device))
    assert _losses(whole.run_dir)[6] < _losses(whole.run_dir)[1]


def test_a_lora_checkpoint_is_used_like_a_model_directory(sft, tmp_path, capsys):
    base, data = sft
    run = train(_run_config(data, tmp_path / "run", base, method="lora", train={"max_steps": 3}), progress=False)
    lora = run.checkpoint
    merged, tokenizer = load(lora)
    prompt = "user: Reverse: apple\n\nassistant:"
    assert main(["generate", str(lora), "--prompt", prompt, "--max-new-tokens", "6", "--temperature", "0"]) == 0
    text = capsys.readouterr().out
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        for _ in range(6):
            nxt = int(merged(torch.tensor([ids]))[0, -1].argmax())
            if nxt == tokenizer.eos_id:
                break
            ids.append(nxt)
    assert text.rstrip("\n") == tokenizer.decode(ids)[len(prompt) :]
    assert main(["convert", "--merge", str(lora), "--out", str(tmp_path / "merged")]) == 0
    plain, _ = load(tmp_path / "merged")
    sample = torch.randint(0, 257, (1, 10))
    assert torch.equal(plain(sample), merged(sample))
    assert main(["eval", str(lora), "--data", str(data), "--json", "--quiet"]) == 0
    scored = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert scored["tokens"] == read_meta(data).val_targets
    assert main(["inspect", str(lora), "--prompt", "user: hi", "--out", str(tmp_path / "inspect")]) == 0


def test_a_changed_or_missing_base_is_a_one_line_error(sft, tmp_path, capsys):
    import shutil

    base, data = sft
    own_base = tmp_path / "base"
    shutil.copytree(base, own_base)
    run = train(_run_config(data, tmp_path / "run", own_base, method="lora", train={"max_steps": 3}), progress=False)
    model, _ = load(own_base)
    with torch.no_grad():
        model.tok_emb.weight[0, 0] += 1.0
    save_model_dir(model, own_base, tokenizer=ByteTokenizer())
    assert main(["generate", str(run.checkpoint), "--prompt", "a", "--max-new-tokens", "2"]) == 2
    assert "has changed since the adapters were trained" in capsys.readouterr().err
    shutil.rmtree(own_base)
    assert main(["generate", str(run.checkpoint), "--prompt", "a", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "is missing" in err and err.count("\n") == 1


def test_examples_rendered_with_another_template_are_refused(sft, tmp_path):
    base, data = sft
    templated = tmp_path / "templated"
    import shutil

    shutil.copytree(base, templated)
    (templated / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    with pytest.raises(GptkitError, match="rendered with the default chat template than the model's"):
        train(_run_config(data, tmp_path / "run", templated), progress=False)
    with pytest.raises(GptkitError, match="model.init_from"):
        check_parts(_run_config(data, tmp_path / "run2", None, method="lora"))
