"""llama.cpp's GGUF file: a gptkit model written as one (`convert --to-gguf`) and read back from one.

GGUF (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md) holds key-value metadata (architecture,
hyperparameters, tokenizer) and named tensors; the `gguf` package maintained with llama.cpp reads and writes
it. gptkit writes and reads the llama.cpp architectures whose graph computes what a gptkit model computes (archs.py
lists each one's fixed switches): gpt2, llama (Mistral too: llama.cpp's converter writes it as llama, without its
window), qwen2, qwen3, smollm3, granite, phi3, gptneox, olmo2, gemma2 and gemma3, with their keys for head sizes,
partial rotary, windows and their layer pattern, soft-caps, scales and RoPE scaling (linear, YaRN (rope.py), or Llama
3's rule as the rope_freqs tensor of per-frequency divisors); and the mixtures of experts llama (Mixtral), qwen2moe (with its
shared expert), qwen3moe and olmoe: each layer's experts as three (E, out, in) stacks (ffn_gate_exps, ffn_up_exps,
ffn_down_exps) beside the router ffn_gate_inp, which stays float32 in a quantised file, as llama.cpp's converter keeps
it. Whether the top-k weights are renormalised is fixed per architecture in llama.cpp's graphs (llama and qwen3moe
do, qwen2moe and olmoe do not); a model that differs, or that keeps some layers dense, is refused. Writing refuses a config an architecture would compute otherwise,
naming the field; reading refuses any tensor or metadata key it does not map, naming it. In llama, smollm3 and
granite llama.cpp rotates interleaved pairs (x_{2i}, x_{2i+1}) where gptkit, like Hugging Face, rotates
(x_i, x_{i+d/2}); the rows of the q and k weights are reordered per head so that both compute the same scores, as
llama.cpp's own converter reorders Hugging Face's.

The tokenizer goes in as llama.cpp's byte-level BPE ("gpt2" model), written and read by its vocab module.
A token that vocabulary adds (a char tokenizer's end-of-text token) gets a zero row in the embedding and the output,
so that its logit is 0 and the model's own tokens keep their logits. Reading accepts the gpt2 and llama
architectures with any tensor type the `gguf` package can dequantise.

GELU: every llama.cpp architecture computes it as the tanh approximation (ggml_gelu, whatever the architecture;
its exact erf form, ggml_gelu_erf, serves only the multimodal encoders), so a model with exact GELU is written with
the change in its logits measured and stated, or refused when that change is large (gelu.py).

Q4_0 is gptkit's int4 (gptkit.quantization.Int4Linear holds the same blocks): writing an int4 model as q4_0 repacks
its bits, and reading a Q4_0 file keeps every layer whose weights are all Q4_0 as an Int4Linear (decoded by
gptkit's int4 kernels), and every expert stack whose tensors are all Q4_0 as an Int4Experts (never a float copy);
other tensors are dequantised, Q8_0 too (its scale per block of 32 has no place in gptkit's int8 scale per row). A quantised model keeps its own LM head (output.weight) and
writes its embedding tables in f32, as gptkit holds them, so that llama.cpp computes what gptkit computes.

The package by direction: archs (the architectures, tensor names), hparams (metadata <-> config), write, read,
header (a file opened with its layout checked), q4_0 (the int4 blocks) and vocab (the tokenizer).
"""

from gptkit.formats.gguf.header import is_gguf_file, open_gguf
from gptkit.formats.gguf.hparams import architecture
from gptkit.formats.gguf.q4_0 import q4_0_blocks, q4_0_parts
from gptkit.formats.gguf.read import gguf_chat_template, gguf_tokenizer, load_gguf
from gptkit.formats.gguf.vocab import GGUFError
from gptkit.formats.gguf.write import FILE_TYPES, export_gguf, gguf_tensors

__all__ = [
    "FILE_TYPES",
    "GGUFError",
    "architecture",
    "export_gguf",
    "gguf_chat_template",
    "gguf_tensors",
    "gguf_tokenizer",
    "is_gguf_file",
    "load_gguf",
    "open_gguf",
    "q4_0_blocks",
    "q4_0_parts",
]
