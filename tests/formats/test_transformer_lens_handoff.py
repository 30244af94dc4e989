"""A model trained in gptkit opens in TransformerLens through its HF export, with gptkit's logits, and TransformerLens's
tools work on it: the logit lens (each layer's residual stream through the final norm and the head) ends at the
model's own logits, and an activation patch changes the output as gptkit's own forward on the patched input does.

transformer-lens (4.x) is optional (`pip install transformer-lens`): without it these tests skip.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import VARIANTS

from gptkit.config import ModelConfig
from gptkit.formats.modeldir import save_model_dir
from gptkit.loading import export_hf
from gptkit.model import GPT
from gptkit.tokenizer import EOT, ByteTokenizer

pytest.importorskip("transformer_lens", reason="transformer-lens is not installed: `pip install transformer-lens`")
from transformer_lens.model_bridge import TransformerBridge  # noqa: E402

pytestmark = pytest.mark.slow  # importing transformer_lens alone takes ~15 s here
# Measured: 3.6e-7 (GPT-2) and 2.4e-7 (Llama) at most between gptkit's fp32 logits and TransformerLens's, which runs
# transformers' eager attention; 1e-5 leaves room for another CPU's kernels.
LOGIT_TOLERANCE = 1e-5
TEXT = "Hello there, general Kenobi"


def trained_model(variant: str, tokenizer: ByteTokenizer) -> GPT:
    """A tiny model of the variant after a few AdamW steps on TEXT, so that its weights are not an init's."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(**dict(VARIANTS[variant], vocab_size=tokenizer.vocab_size, block_size=32)))
    ids = torch.tensor([tokenizer.encode(TEXT)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(10):
        loss = model(ids[:, :-1], targets=ids[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


@pytest.mark.parametrize("variant", ["gpt2", "llama-gqa"])
def test_transformer_lens_opens_the_export_with_gptkits_logits(variant: str, tmp_path: Path) -> None:
    tokenizer = ByteTokenizer([EOT])
    model = trained_model(variant, tokenizer)
    hf_dir = export_hf(save_model_dir(model, tmp_path / "model", tokenizer=tokenizer), tmp_path / "hf")
    bridge = TransformerBridge.boot_transformers(str(hf_dir), device="cpu")
    ids = torch.tensor([tokenizer.encode(TEXT)])
    with torch.no_grad():
        ours = model(ids)  # (1, T, V)
        logits, cache = bridge.run_with_cache(ids)
    torch.testing.assert_close(logits, ours, atol=LOGIT_TOLERANCE, rtol=0)
    # The logit lens at the last layer is the model's output: the final norm and the head, applied by hand.
    last = cache[f"blocks.{model.config.n_layer - 1}.hook_out"]  # (1, T, d)
    with torch.no_grad():
        lens = bridge.unembed(bridge.ln_final(last))
    torch.testing.assert_close(lens, ours, atol=LOGIT_TOLERANCE, rtol=0)


def test_an_activation_patch_in_transformer_lens_matches_gptkit_on_the_patched_input(tmp_path: Path) -> None:
    tokenizer = ByteTokenizer([EOT])
    model = trained_model("gpt2", tokenizer)
    hf_dir = export_hf(save_model_dir(model, tmp_path / "model", tokenizer=tokenizer), tmp_path / "hf")
    bridge = TransformerBridge.boot_transformers(str(hf_dir), device="cpu")
    clean = torch.tensor([tokenizer.encode("Hello there")])
    corrupt = torch.tensor([tokenizer.encode("Jello there")])
    _, clean_cache = bridge.run_with_cache(clean)

    def patch_first_position(resid: torch.Tensor, hook: object) -> torch.Tensor:
        resid[:, 0] = clean_cache["blocks.0.hook_resid_pre"][:, 0]  # (1, d): the clean first token's embedding
        return resid

    with torch.no_grad():
        patched = bridge.run_with_hooks(corrupt, fwd_hooks=[("blocks.0.hook_resid_pre", patch_first_position)])
        # Patching the whole embedding of the only differing token is running the clean input.
        torch.testing.assert_close(patched, model(clean), atol=LOGIT_TOLERANCE, rtol=0)
        assert (bridge(corrupt) - model(clean)).abs().max() > 1e-2  # the corrupted input alone differs
