"""gptkit's own CPU kernels: few-row products that stream weights at memory speed, and the fused decode step.

Decoding reads every weight once per token, so its speed on a CPU is how fast the matmuls stream the weights; an
int8 model should decode about four times as fast as an fp32 one. PyTorch 2.13's few-row kernels fall short of
the memory's rate (measured over GPT-2-small matrices at batch 1: on a 2-core AVX-512 machine, fp32 F.linear 19-20
GB/s of ~30, bf16 9, torch._weight_int8pack_mm 7; on a 2-core AVX2 EPYC, fp32 5.3 GB/s of ~11, bf16 2.9).
csrc/ holds products for 1 to ops.GEMV_MAX_ROWS rows of fp32, bf16, int8 and q4 weights (gemv.cpp, over kernels.h)
and the whole decode step in one call, for any number of rows (step.cpp, driven by gptkit.decoding.fused). The
library is compiled for the widest instruction set of cpu.ISA_LEVELS this CPU has. Whether each product (fp32,
bf16, int8 weights) and the fused step (at one row, and at each batch size past GEMV_MAX_ROWS it is asked for) are
used is decided by timing them against PyTorch on this machine, once, and kept in a small JSON file beside the
built library. The same measurement decides whether bf16 inference over many rows (prefill, eval) runs in fp32,
which is faster where bf16 matmul has no hardware behind it.

Overrides: GPTKIT_CPU_KERNELS=0 keeps PyTorch's products (the kernels are not even built), =1 uses the kernels
without measuring; GPTKIT_BF16_UPCAST=1 or 0 forces the many-row bf16 choice.

The C++ sources are compiled once per machine and version (about a minute on 2 cores) into the cache that cache.py
describes (under $TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions, keyed by the sources, flags, compiler and
torch; a library is checked against its manifest before it is loaded). Decoding never waits for a build: the first
process that needs the library starts a builder process (which finishes even if this one ends first) and decodes
with PyTorch's products meanwhile, a background thread taking the library once it is there; one that finds another
process's build under way does the same without starting one; later processes load it at once. library.prepare()
waits for this process's own build (benchmarks, tests, a compiled step), never another's. If the build fails,
gptkit logs why once and keeps PyTorch's kernels.

The modules, from the bottom up (each imports only those above it in this list; this file imports none of them, so
that importing one loads only what it needs):
- cpu: the CPU's flags and name, and which instruction-set variant of the library it runs;
- contention: how busy other programs keep the machine (a choice timed under contention is marked so);
- cache: the on-disk cache of built libraries, the builder process, and choices.json's file;
- build: the sources and flags, starting a build, opening a built library;
- choices: the timed choices (the kernels against PyTorch, once per machine);
- library: whether the library is loaded in this process (load, prepare, building) and what it chose (choices,
  measured, capability);
- ops: the products (linear, int8_linear, q4_linear, dequantize_q4) and huge pages. The model's layers import it,
  so it imports library on the first CPU inference product, not when it is imported: building or training a model
  loads none of the modules above.
"""

# From this many rows on, a bf16 product may run faster in fp32 (weights converted on the fly) where bf16 matmul
# has no hardware support: whether it does is measured (choices()["bf16_upcast"]). Here, because ops (which applies
# it) must not import choices (which measures at this many rows) when it is imported.
BF16_UPCAST_MIN_ROWS = 128
