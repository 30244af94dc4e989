"""llama.cpp's GGUF file: a gptkit model written as one (`convert --to-gguf`) and read back from one.

GGUF (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md) holds key-value metadata (architecture,
hyperparameters, tokenizer) and named tensors; the `gguf` package maintained with llama.cpp reads and writes
it. Two of llama.cpp's architectures compute what a gptkit model computes, and only those are written:
- gpt2: learned positions, LayerNorm, GELU (tanh approximation), pre-norm blocks, fused q/k/v, multi-head;
- llama: RoPE (rotate-half pairs), RMSNorm, SwiGLU, pre-norm, grouped-query attention, no biases.
llama.cpp's llama rotates interleaved pairs (x_{2i}, x_{2i+1}) where gptkit, like Hugging Face's Llama, rotates
(x_i, x_{i+d/2}); the rows of the q and k weights are reordered per head so that both compute the same scores,
as llama.cpp's own converter reorders Hugging Face's.

The tokenizer goes in as llama.cpp's byte-level BPE ("gpt2" model), written and read by its vocab module.
A token that vocabulary adds (a char tokenizer's end-of-text token) gets a zero row in the embedding and the output,
so that its logit is 0 and the model's own tokens keep their logits. Reading accepts the gpt2 and llama
architectures with any tensor type the `gguf` package can dequantise.

GELU: every llama.cpp architecture computes it as the tanh approximation (ggml_gelu, whatever the architecture;
its exact erf form, ggml_gelu_erf, serves only the multimodal encoders), so a model with exact GELU is refused.

Q4_0 is gptkit's int4 (gptkit.quantization.Int4Linear holds the same blocks): writing an int4 model as q4_0 repacks
its bits, and reading a Q4_0 file keeps every layer whose weights are all Q4_0 as an Int4Linear (decoded by
gptkit's int4 kernels); other tensors are dequantised. A quantised model keeps its own LM head (output.weight) and
writes its embedding tables in f32, as gptkit holds them, so that llama.cpp computes what gptkit computes.

The package by direction: archs (which architecture computes a config, tensor names, the keys read), write, read,
header (a file opened with its layout checked), q4_0 (the int4 blocks) and vocab (the tokenizer).
"""

from gptkit.formats.gguf.archs import architecture
from gptkit.formats.gguf.header import is_gguf_file, open_gguf
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
