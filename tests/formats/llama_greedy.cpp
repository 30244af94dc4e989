// llama-greedy: llama.cpp's library decoding a GGUF file greedily from a prompt of token ids, so the runtime tests
// compare token ids with gptkit's rather than text (a random tiny model's text does not round-trip through a
// tokenizer). Usage: llama-greedy MODEL.gguf N_NEW LOGITS ID [ID ...]: prints the N_NEW generated ids on one line
// and, unless LOGITS is "-", writes each step's logits to that file (N_NEW rows of n_vocab float32).
// `make llama-cpp` builds it against the llama.cpp that Makefile pins.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "llama.h"

// Only llama.cpp's errors reach stderr: its progress lines would bury a failure's reason.
static void errors_only(enum ggml_log_level level, const char * text, void *) {
    if (level == GGML_LOG_LEVEL_ERROR) {
        fputs(text, stderr);
    }
}

// The first index of the largest logit: torch.argmax's choice, so an exact tie breaks the same way on both sides.
static llama_token argmax(const float * logits, int n_vocab) {
    llama_token best = 0;
    for (int i = 1; i < n_vocab; i++) {
        if (logits[i] > logits[best]) {
            best = i;
        }
    }
    return best;
}

int main(int argc, char ** argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s MODEL.gguf N_NEW LOGITS ID [ID ...]\n", argv[0]);
        return 2;
    }
    const int n_new = atoi(argv[2]);
    FILE * logits_out = strcmp(argv[3], "-") == 0 ? nullptr : fopen(argv[3], "wb");
    if (strcmp(argv[3], "-") != 0 && logits_out == nullptr) {
        fprintf(stderr, "llama-greedy: cannot write %s\n", argv[3]);
        return 1;
    }
    std::vector<llama_token> prompt;
    for (int i = 4; i < argc; i++) {
        prompt.push_back(atoi(argv[i]));
    }
    llama_log_set(errors_only, nullptr);
    llama_backend_init();
    llama_model * model = llama_model_load_from_file(argv[1], llama_model_default_params());
    if (model == nullptr) {
        fprintf(stderr, "llama-greedy: llama.cpp could not load %s\n", argv[1]);
        return 1;
    }
    llama_context_params params = llama_context_default_params();
    params.n_ctx = prompt.size() + n_new;
    params.n_batch = prompt.size();
    // An f32 cache and plain attention: llama.cpp's defaults (an f16 cache, flash attention in f16) would round
    // keys and values where gptkit keeps fp32, and the comparison is of the computation, not of the cache format.
    params.type_k = GGML_TYPE_F32;
    params.type_v = GGML_TYPE_F32;
    params.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    // One thread: the test models are tiny, and `make test` runs two test workers on two cores, where a second
    // thread of ggml's (which spin-waits) would fight the other worker for its core.
    params.n_threads = 1;
    params.n_threads_batch = 1;
    llama_context * ctx = llama_init_from_model(model, params);
    if (ctx == nullptr) {
        fprintf(stderr, "llama-greedy: llama.cpp could not make a context for %s\n", argv[1]);
        return 1;
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    llama_batch batch = llama_batch_get_one(prompt.data(), prompt.size());
    llama_token next = 0;
    for (int step = 0; step < n_new; step++) {
        if (llama_decode(ctx, batch) != 0) {
            fprintf(stderr, "llama-greedy: llama_decode failed at step %d\n", step);
            return 1;
        }
        const float * logits = llama_get_logits_ith(ctx, -1);
        if (logits_out != nullptr) {
            fwrite(logits, sizeof(float), n_vocab, logits_out);
        }
        next = argmax(logits, n_vocab);
        printf(step ? " %d" : "%d", next);
        batch = llama_batch_get_one(&next, 1);
    }
    printf("\n");
    if (logits_out != nullptr) {
        fclose(logits_out);
    }
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
