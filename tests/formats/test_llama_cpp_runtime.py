"""llama.cpp itself runs gptkit's GGUF files (issue 54 item 5): for each family gptkit writes, llama.cpp's greedy
tokens from a prompt of token ids equal gptkit's from the same file, and its logits at every step agree.

The llama.cpp side is llama-greedy (tests/formats/llama_greedy.cpp, built by `make llama-cpp` against the pinned
llama.cpp): ids in, argmax ids and each step's logits out, so nothing passes through a tokenizer.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from gptkit.decoding.api import generate_ids
from gptkit.formats.gguf import GGUFError, export_gguf, load_gguf
from gptkit.model import GPT
from gptkit.tokenizer import ByteTokenizer
from tests.formats.test_gguf_families import CONFIGS, LLAMA, random_model
from tests.formats.test_gguf_moe import CONFIGS as MOE_CONFIGS
from tests.formats.test_gguf_moe import random_model as random_moe_model
from tests.formats.test_gguf_write import tiny_gemma3_preset

gguf = pytest.importorskip("gguf")
REPO = Path(__file__).resolve().parents[2]
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119]  # fixed ids of the byte vocabulary ("Hello, w")
NEW = 24  # prompt + new tokens = 32, the configs' block_size: past gemma's window of 4 and Llama 3's original 8

# Mistral is llama.cpp's llama with a decoupled head size and no window (its converter drops Mistral v0.1's).
# GPT-NeoX untied, as Pythia is (a tied one, its head written as a copy of the embedding: see below).
FAMILIES = {
    **CONFIGS,
    "mistral": ("llama", dict(LLAMA, head_dim=12, rope_theta=1e6)),
    "gptneox": ("gptneox", dict(CONFIGS["gptneox"][1], tie_embeddings=False)),
}
# Mixtral's architecture is llama's with experts; OLMoE's k norm spans the whole width in llama.cpp, so its heads
# are all query heads' own (no grouped-query attention, as in OLMoE; grouped ones are refused: see below).
MOE = {"llama-moe" if arch == "llama" else arch: fields for arch, fields in MOE_CONFIGS.items()}
# Where llama.cpp rounds more: its GELU (GPT-NeoX's, and Gemma's GeGLU) reads a table of f16 values. Measured here
# (AVX2): at most 1.7e-6 for the others, 5.4e-3 for gemma3, 1.7e-3 for gemma2, 3.3e-4 for gptneox.
F32_ATOL = 1e-5
GELU_ATOL = 1e-2
ATOL = {"gemma2": GELU_ATOL, "gemma3": GELU_ATOL, "gptneox": GELU_ATOL}
PATTERN = list(b"Hello, world! ")  # what the quantised cases' model is trained to continue; PROMPT begins it


def llama_cpp_binary(name: str) -> Path:
    """A llama.cpp tool in $LLAMA_CPP (a llama.cpp build/bin folder) or where `make llama-cpp` builds it, or a skip
    saying how to get it."""
    folder = Path(os.environ.get("LLAMA_CPP") or REPO / ".cache/llama.cpp/build/bin")
    binary = folder / name
    if not binary.is_file():
        pytest.skip(
            f"no {name} in {folder}: build llama.cpp with `make llama-cpp` (or set LLAMA_CPP to its bin folder)"
        )
    return binary


def amx_cpu() -> bool:
    """Whether this CPU has Intel AMX, where a native llama.cpp build crashes in quantised prompt processing (its own
    files too; its one-token decode is fine)."""
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.is_file() and "amx_int8" in cpuinfo.read_text()


def llama_cpp_greedy(path: Path, prompt: list[int], new: int, logits_file: Path) -> tuple[list[int], np.ndarray]:
    """llama.cpp's greedy ids after prompt, and its logits at each of those steps (new rows of its vocabulary)."""
    command = [str(llama_cpp_binary("llama-greedy")), str(path), str(new), str(logits_file), *map(str, prompt)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    ids = [int(token) for token in done.stdout.split()]
    return ids, np.fromfile(logits_file, dtype=np.float32).reshape(new, -1)


def gptkit_greedy(path: Path, prompt: list[int], new: int) -> tuple[list[int], torch.Tensor]:
    """gptkit's greedy ids from the file read back, and its logits at each step (teacher-forced over those ids)."""
    model, _ = load_gguf(path)
    ids = generate_ids(model, prompt, max_new_tokens=new, temperature=0.0)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids]))[0, len(prompt) - 1 : -1]  # (new, vocab)
    return ids, logits


def trained(model: GPT, steps: int = 20) -> GPT:
    """model after a few Adam steps on a repeating text, so that each step's best logit stands clear of the next.

    An untrained model's best two logits can lie closer than the rounding of bf16 or 8-bit activations, and then
    the last bits of a sum pick the token; a model that has learnt the text continues it decisively."""
    text = torch.tensor(PATTERN * 4)
    batch = torch.stack([text[i : i + 33] for i in range(len(PATTERN))])  # (14, 33): every phase of the text
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def check_same_decode(model: GPT, file_type: str, tmp_path: Path, atol: float) -> None:
    """llama.cpp and gptkit decode the file greedily alike, with logits within atol at every step.

    The f32 cases' models are random: their seeds give gaps between the best two logits of at least 1.8e-4 where
    the two programs differ by 1e-5 or less (gemma3: 1.3e-2 against 5.4e-3), so a near-tie cannot pick the token."""
    path = export_gguf(model, tmp_path / f"m-{file_type}.gguf", ByteTokenizer(), file_type)
    ours, our_logits = gptkit_greedy(path, PROMPT, NEW)
    theirs, their_logits = llama_cpp_greedy(path, PROMPT, NEW, tmp_path / "logits.f32")
    vocab = our_logits.shape[-1]
    assert not their_logits[:, vocab:].any()  # the token the file adds (end of text) has a zero row: logit 0
    np.testing.assert_allclose(their_logits[:, :vocab], our_logits.numpy(), atol=atol, rtol=0)
    top = our_logits.topk(2, dim=-1).values  # (NEW, 2)
    assert theirs == ours, f"the smallest gap between gptkit's best two logits: {(top[:, 0] - top[:, 1]).min():.2g}"


@pytest.mark.parametrize("family", FAMILIES)
def test_llama_cpp_decodes_gptkits_file_of_each_family_as_gptkit_does(family, tmp_path):
    llama_cpp_binary("llama-greedy")
    arch, fields = FAMILIES[family]
    model = random_model(fields, proj_bias=arch != "qwen2")  # Qwen2's output projection has no bias
    check_same_decode(model, "f32", tmp_path, ATOL.get(family, F32_ATOL))


@pytest.mark.parametrize("family", MOE)
def test_llama_cpp_decodes_gptkits_file_of_each_mixture_of_experts_as_gptkit_does(family, tmp_path):
    llama_cpp_binary("llama-greedy")
    check_same_decode(random_moe_model(MOE[family]), "f32", tmp_path, F32_ATOL)


# gptkit multiplies the file's dequantised weights in fp32; llama.cpp also rounds each activation vector to bf16,
# or to 8 bits per block of 32 (q8_0 and q4_0 products), before multiplying. Measured here (AVX2), logits up to
# about 12: at most 0.032 (bf16), 0.10 (q8_0), 0.13 (q4_0); the trained model's gaps are at least 3.7.
QUANTISED_ATOL = {"bf16": 0.1, "q8_0": 0.3, "q4_0": 0.4}


@pytest.mark.parametrize("file_type", QUANTISED_ATOL)
def test_llama_cpp_decodes_a_bf16_q8_0_and_q4_0_file_as_gptkit_does(file_type, tmp_path):
    llama_cpp_binary("llama-greedy")
    if file_type != "bf16" and amx_cpu():
        pytest.skip("this CPU has AMX, where llama.cpp's native build crashes in quantised prompt processing")
    model = trained(random_model(FAMILIES["gemma2"][1]))
    check_same_decode(model, file_type, tmp_path, QUANTISED_ATOL[file_type])


# The architectures whose llama.cpp graph requires output.weight: a tied model's head is written as a copy.
TIED = {
    "gptneox": lambda: random_model(dict(CONFIGS["gptneox"][1], tie_embeddings=True)),
    "olmo2": lambda: random_model(dict(CONFIGS["olmo2"][1], tie_embeddings=True)),
    "olmoe": lambda: random_moe_model(dict(MOE["olmoe"], tie_embeddings=True)),
    "qwen2moe": lambda: random_moe_model(dict(MOE["qwen2moe"], tie_embeddings=True)),
}


@pytest.mark.parametrize("family", TIED)
def test_llama_cpp_loads_gptkits_file_of_a_tied_model_where_its_graph_requires_output(family, tmp_path):
    llama_cpp_binary("llama-greedy")
    check_same_decode(TIED[family](), "f32", tmp_path, ATOL.get(family, F32_ATOL))


def test_gptkit_refuses_a_grouped_query_olmoe_that_llama_cpp_cannot_load(tmp_path):
    # llama.cpp's olmoe creates attn_k_norm as {n_embd} and multiplies the keys (n_kv_head * head_dim wide) by it
    model = random_moe_model(dict(MOE_CONFIGS["olmoe"], n_kv_head=2))
    with pytest.raises(GGUFError, match="n_kv_head 2 cannot be written as GGUF: llama.cpp's olmoe norms the keys"):
        export_gguf(model, tmp_path / "m.gguf", ByteTokenizer(), "f32")


def test_llama_cpp_decodes_a_tiny_gemma3_preset_with_its_attn_scale_as_gptkit_does(tmp_path):
    llama_cpp_binary("llama-greedy")
    fields = tiny_gemma3_preset()
    assert fields["attn_scale"] == 256**-0.5 and fields["head_dim"] == 256
    check_same_decode(random_model(fields), "f32", tmp_path, GELU_ATOL)
