// Offline throughput in llama.cpp for the bench's mixed-length requests (bench/test_throughput.py).
//
// llama.cpp ships no offline tool for requests of differing prompt and output lengths, so this one
// drives libllama the way a continuous-batching engine does: every step, one token for each
// running sequence, then prompt chunks of waiting ones while the step's token budget lasts;
// greedy (argmax) sampling; a sequence's KV is dropped when it has its tokens, and its slot goes to
// the next request. scripts/peers/llamacpp_build.sh compiles it against the build's libllama.
//
//   llama-bench-mixed MODEL.gguf REQUESTS.txt THREADS MAX_MODEL_LEN MAX_SEQS TOKEN_BUDGET ROUNDS
//
// REQUESTS.txt: one request a line, "OUTPUT_LEN PROMPT_TOKEN_ID...". Prints one JSON line a round:
// {"elapsed_s": ..., "tokens_generated": ..., "steps": ...}; the model loads before the first timer.

#include "llama.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

struct Request {
    std::vector<llama_token> prompt;
    int output_len = 0;
};

struct Running {
    const Request * req;
    llama_seq_id seq;
    int prefilled = 0;    // prompt tokens already in the KV cache
    int generated = 0;
    llama_token last = 0;
    int logits_row = -1;  // row of this step's batch whose logits give the next token
};

static std::vector<Request> read_requests(const char * path) {
    std::vector<Request> out;
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) {
        std::istringstream fields(line);
        Request r;
        if (!(fields >> r.output_len)) continue;
        llama_token t;
        while (fields >> t) r.prompt.push_back(t);
        out.push_back(std::move(r));
    }
    return out;
}

static void add(llama_batch & b, llama_token t, llama_pos pos, llama_seq_id seq, bool logits) {
    b.token[b.n_tokens] = t;
    b.pos[b.n_tokens] = pos;
    b.n_seq_id[b.n_tokens] = 1;
    b.seq_id[b.n_tokens][0] = seq;
    b.logits[b.n_tokens] = logits;
    b.n_tokens++;
}

int main(int argc, char ** argv) {
    if (argc != 8) {
        fprintf(stderr, "usage: %s MODEL.gguf REQUESTS.txt THREADS MAX_MODEL_LEN MAX_SEQS TOKEN_BUDGET ROUNDS\n", argv[0]);
        return 2;
    }
    const std::vector<Request> requests = read_requests(argv[2]);
    const int threads = atoi(argv[3]), max_model_len = atoi(argv[4]), max_seqs = atoi(argv[5]);
    const int budget = atoi(argv[6]), rounds = atoi(argv[7]);
    if (requests.empty() || max_seqs < 1 || budget < max_seqs) {
        fprintf(stderr, "no requests, or a token budget below MAX_SEQS\n");
        return 2;
    }

    llama_backend_init();
    llama_model * model = llama_model_load_from_file(argv[1], llama_model_default_params());
    if (!model) return 1;
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t) (max_seqs * max_model_len);
    cp.n_batch = (uint32_t) budget;
    cp.n_seq_max = (uint32_t) max_seqs;
    cp.kv_unified = false;  // each sequence its own KV stream: none shares a prefix here
    cp.n_threads = threads;
    cp.n_threads_batch = threads;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) return 1;
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    llama_memory_t mem = llama_get_memory(ctx);
    llama_batch batch = llama_batch_init(budget, 0, 1);

    for (int round = 0; round < rounds; ++round) {
        llama_memory_clear(mem, true);
        std::vector<llama_seq_id> free_seqs;
        for (int s = max_seqs - 1; s >= 0; --s) free_seqs.push_back(s);
        std::vector<Running> running;
        size_t next = 0;
        long generated = 0, steps = 0;
        const auto start = std::chrono::steady_clock::now();
        while (next < requests.size() || !running.empty()) {
            while (next < requests.size() && !free_seqs.empty()) {
                running.push_back({&requests[next++], free_seqs.back()});
                free_seqs.pop_back();
            }
            batch.n_tokens = 0;
            // Decode first: one token for every sequence whose prompt is in.
            for (Running & r : running) {
                r.logits_row = -1;
                if (r.prefilled == (int) r.req->prompt.size()) {
                    r.logits_row = batch.n_tokens;
                    add(batch, r.last, r.prefilled + r.generated - 1, r.seq, true);
                }
            }
            // Then prompt chunks, in arrival order, while the budget lasts.
            for (Running & r : running) {
                const int left = (int) r.req->prompt.size() - r.prefilled;
                const int take = std::min(left, budget - batch.n_tokens);
                if (left == 0 || take <= 0) continue;
                for (int i = 0; i < take; ++i) {
                    const bool last = r.prefilled + i + 1 == (int) r.req->prompt.size();
                    if (last) r.logits_row = batch.n_tokens;
                    add(batch, r.req->prompt[r.prefilled + i], r.prefilled + i, r.seq, last);
                }
                r.prefilled += take;
            }
            if (llama_decode(ctx, batch) != 0) {
                fprintf(stderr, "llama_decode failed\n");
                return 1;
            }
            ++steps;
            std::vector<Running> still;
            for (Running & r : running) {
                if (r.logits_row >= 0) {
                    const float * logits = llama_get_logits_ith(ctx, r.logits_row);
                    r.last = (llama_token) (std::max_element(logits, logits + n_vocab) - logits);
                    ++r.generated;
                    ++generated;
                }
                if (r.generated == r.req->output_len) {
                    llama_memory_seq_rm(mem, r.seq, -1, -1);
                    free_seqs.push_back(r.seq);
                } else {
                    still.push_back(r);
                }
            }
            running.swap(still);
        }
        const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        printf("{\"elapsed_s\": %.6f, \"tokens_generated\": %ld, \"steps\": %ld}\n", elapsed, generated, steps);
        fflush(stdout);
    }
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
