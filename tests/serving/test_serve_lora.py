"""Many LoRA adapters, one server, one batch: each request decodes through the adapter its `model` names, exactly
as the merged model would, whatever else shares its batch; adapters listed, loaded and unloaded at run time."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import httpx
import openai
import pytest
import torch

from gptkit.adapters import adapters, add_lora, fingerprint
from gptkit.config import ModelConfig
from gptkit.errors import GptkitError
from gptkit.formats.lora import read_lora_config, write_lora_dir
from gptkit.formats.modeldir import save_model_dir
from gptkit.loading import load
from gptkit.model import GPT
from gptkit.multi_lora import rows_using, serve_adapter
from gptkit.serving.server import ServeOptions, build_app
from gptkit.tensors import load_tensors
from gptkit.tokenizer import ByteTokenizer
from gptkit.weights import model_state
from tests.serving.servers import live_server

KEY = "secret"
PROMPTS = ["Hello", "The cat", "abc", "Once upon"]


def _base(root: Path) -> Path:
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=257, block_size=256, n_layer=2, n_head=2, n_embd=32))
    return save_model_dir(model, root / "base", tokenizer=ByteTokenizer())


def _lora(base_dir: Path, out: Path, seed: int, targets: str, rank: int) -> Path:
    """A LoRA directory over base_dir with random (non-zero) adapters."""
    model, _ = load(base_dir)
    settings = {
        "base": str(base_dir.resolve()),
        "base_fingerprint": fingerprint(model_state(model)),
        "rank": rank,
        "alpha": 2.0 * rank,
        "dropout": 0.0,
        "targets": targets,
        "base_precision": "float32",
    }
    add_lora(model, rank, 2.0 * rank, 0.0, targets)
    torch.manual_seed(seed)
    with torch.no_grad():
        for adapter in adapters(model).values():
            adapter.lora_B.normal_(0, 0.5)
    return write_lora_dir(model, out, settings)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    base = _base(root)
    return {
        "base": base,
        "a": _lora(base, root / "a", 1, "all", 4),
        "b": _lora(base, root / "b", 2, "attention", 2),
        "c": _lora(base, root / "c", 3, "mlp", 3),
    }


@pytest.fixture(scope="module")
def server(dirs):
    # (c, beside the base, is left for the run-time loading test.)
    options = ServeOptions(max_batch_size=8, api_key=KEY, lora=(f"a={dirs['a']}", f"b={dirs['b']}"), lora_beside=False)
    app = build_app(dirs["base"], options)
    with live_server(app) as url:
        yield url, app.state.gptkit


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_an_adapter_set_row_computes_what_its_merged_model_computes(dirs):
    # Rows of one batch through three different models (base, a, b): each row's logits are its merged model's.
    model, _ = load(dirs["base"])
    for index, name in ((1, "a"), (2, "b")):
        serve_adapter(
            model, index, load_tensors(dirs[name] / "adapters.safetensors"), read_lora_config(dirs[name]), name
        )
    ids = torch.randint(0, 257, (4, 12))
    choice = [2, 0, 1, 2]
    with torch.no_grad(), rows_using(model, choice):
        together = model(ids)
    for row, index in enumerate(choice):
        merged = load(dirs[{0: "base", 1: "a", 2: "b"}[index]])[0]
        with torch.no_grad():
            # 1e-5: the update added to the base's output instead of folded into its weight (measured: 2e-6)
            torch.testing.assert_close(together[row], merged(ids[row : row + 1])[0], atol=1e-5, rtol=1e-5)


def merged_greedy(model_dir: Path, prompt: str, tokens: int = 10) -> str:
    """The merged model's greedy continuation, computed without a server or a cache (ending at end-of-text)."""
    tokenizer, model = ByteTokenizer(), load(model_dir)[0]
    ids, out = tokenizer.encode(prompt), []
    with torch.no_grad():
        for _ in range(tokens):
            token = int(model(torch.tensor([ids + out]))[0, -1].argmax())
            if token == tokenizer.eos_id:
                break
            out.append(token)
    return tokenizer.decode(out)


def _greedy(client, model: str, prompt: str) -> tuple[str, list[float]]:
    reply = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0, logprobs=0)
    return reply.choices[0].text, reply.choices[0].logprobs.token_logprobs


def test_requests_for_different_adapters_share_batches_and_match_their_merged_models(client, server, dirs):
    jobs = [(model, prompt) for prompt in PROMPTS for model in ("base", "a", "b")]
    steps_before = server[1].engine.steps
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: _greedy(client, *job), jobs))
    # Fewer decode steps than the requests' tokens: requests of different adapters decoded together.
    assert server[1].engine.steps - steps_before < len(jobs) * 10 / 2
    assert server[1].engine.max_rows_seen >= 3
    for (name, prompt), (text, _) in zip(jobs, got):
        assert text == merged_greedy(dirs[name], prompt), (name, prompt)
    assert _greedy(client, "a", "Hello")[0] != _greedy(client, "base", "Hello")[0]  # the adapters change the output


def test_a_prompt_cached_for_one_adapter_is_not_reused_for_another(client, server, dirs):
    # 150 bytes: two whole 64-token blocks go into the prefix cache under the first request's adapter.
    prompt = "The quick brown fox jumps over the lazy dog. " * 3 + "Then"
    hits = server[1].engine.stats()["prefix_cache"]["hit_tokens"]
    texts = {name: _greedy(client, name, prompt)[0] for name in ("base", "a", "base", "a")}
    assert server[1].engine.stats()["prefix_cache"]["hit_tokens"] == hits + 2 * 128  # each reused its own blocks
    for name in ("base", "a"):
        assert texts[name] == merged_greedy(dirs[name], prompt), name


def test_models_lists_each_adapter_with_its_base_as_parent(client):
    cards = {card.id: card for card in client.models.list()}
    assert cards["a"].parent == cards["b"].parent == "base" and cards["base"].parent is None
    with pytest.raises(openai.NotFoundError, match="'base', 'a', 'b'"):
        client.completions.create(model="nope", prompt="x", max_tokens=1)


def test_adapters_load_and_unload_at_run_time_behind_the_key(client, server, dirs):
    url = server[0]
    refused = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(dirs["c"])})
    assert refused.status_code == 401  # no key
    headers = {"Authorization": f"Bearer {KEY}"}
    loaded = httpx.post(
        f"{url}/v1/load_lora_adapter", headers=headers, json={"lora_name": "c", "lora_path": str(dirs["c"])}
    )
    assert loaded.status_code == 200, loaded.text
    assert _greedy(client, "c", "Hello")[0] == merged_greedy(dirs["c"], "Hello")
    assert httpx.post(f"{url}/v1/unload_lora_adapter", headers=headers, json={"lora_name": "c"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="c", prompt="x", max_tokens=1)
    wrong = httpx.post(
        f"{url}/v1/load_lora_adapter", headers=headers, json={"lora_name": "d", "lora_path": str(dirs["base"])}
    )
    assert wrong.status_code == 400 and "not a LoRA directory" in wrong.json()["error"]["message"]


def test_runtime_loading_needs_a_key(dirs):
    app = build_app(dirs["base"], ServeOptions())
    with live_server(app) as url:
        reply = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(dirs["a"])})
    assert reply.status_code == 403 and "--api-key" in reply.json()["error"]["message"]


def test_an_adapter_trained_on_another_base_is_refused_in_one_line(dirs, tmp_path):
    torch.manual_seed(5)
    other = save_model_dir(
        GPT(ModelConfig(vocab_size=257, block_size=256, n_layer=2, n_head=2, n_embd=32)),
        tmp_path / "other",
        tokenizer=ByteTokenizer(),
    )
    with pytest.raises(GptkitError, match="trained on another base"):
        build_app(other, ServeOptions(lora=(f"a={dirs['a']}",)))
    with pytest.raises(GptkitError, match="NAME=DIR"):
        build_app(dirs["base"], ServeOptions(lora=(str(dirs["a"]),)))


def test_adapters_beside_the_base_are_served_under_their_names_when_asked(dirs, tmp_path, caplog):
    # In the base's folder: a (also given by --lora), b and c (trained on it), "x y" (a copy of a whose name no
    # request could send) and other/ (trained on another base): b and c are served beside --lora's, the last two
    # are skipped in one line each, and nothing is searched for without --lora-beside.
    import shutil

    root = dirs["base"].parent
    shutil.copytree(dirs["a"], root / "x y")
    torch.manual_seed(5)
    other_base = save_model_dir(
        GPT(ModelConfig(vocab_size=257, block_size=256, n_layer=2, n_head=2, n_embd=32)),
        tmp_path / "other-base",
        tokenizer=ByteTokenizer(),
    )
    _lora(other_base, root / "other", 4, "all", 2)
    try:
        with caplog.at_level("INFO", logger="gptkit"):
            options = ServeOptions(lora=(f"mine={dirs['a']}",), lora_beside=True)
            state = build_app(dirs["base"], options).state.gptkit
        served = {name: Path(adapter.path).name for name, adapter in state.adapters.adapters.items()}
        assert served == {"mine": "a", "b": "b", "c": "c"}  # a: already served as mine
        skipped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("not serving")]
        assert len(skipped) == 2 and "trained on another base" in " ".join(skipped), skipped
        assert build_app(dirs["base"], ServeOptions()).state.gptkit.adapters is None
    finally:
        shutil.rmtree(root / "x y")
        shutil.rmtree(root / "other")


def test_the_search_beside_a_symlinked_base_looks_in_its_own_folder_and_skips_what_it_cannot_read(
    dirs, tmp_path, monkeypatch, caplog
):
    from gptkit.serving.lora_registry import adapters_beside

    models = tmp_path / "models"
    models.mkdir()
    (models / "base").symlink_to(dirs["base"])
    (models / "alice").symlink_to(dirs["a"])
    (models / "private").mkdir()
    assert adapters_beside(models / "base") == {"alice": models / "alice"}  # not the real base's neighbours
    assert adapters_beside("gpt2") == {} and adapters_beside(tmp_path / "missing") == {}
    is_dir = Path.is_dir

    def unreadable(path: Path) -> bool:
        if path.name == "private":
            raise PermissionError(13, "Permission denied", str(path))
        return is_dir(path)

    monkeypatch.setattr(Path, "is_dir", unreadable)
    with caplog.at_level("INFO", logger="gptkit"):
        assert adapters_beside(models / "base") == {"alice": models / "alice"}
    assert any("Permission denied" in r.getMessage() for r in caplog.records)
