// The fused CPU kernels, for the other translation units (decoder.cpp, bindings.cpp): by file,
// norm_rope.cpp (norms, rotary embedding, the gated activation), kv_write.cpp (the KV-cache write,
// huge pages for the pool), attention.cpp and attention_int8.cpp (paged attention and its
// routes), sampling.cpp (top-k, the screened LM head, sampling, structured outputs' bitmask).
#pragma once

#include <torch/extension.h>

#include <string>
#include <tuple>

// norm_rope.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, double offset);
void rms_norm_out(torch::Tensor out, const torch::Tensor& x, const torch::Tensor& weight, double eps, double offset);
void rope_qk_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t num_heads, int64_t num_kv_heads,
              int64_t head_dim, c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm,
              double eps, double norm_offset);
torch::Tensor act_and_mul(torch::Tensor x, int64_t act);
void act_and_mul_out(torch::Tensor out, const torch::Tensor& x, int64_t act);

// kv_write.cpp
void write_kv_cache(torch::Tensor k, torch::Tensor v, torch::Tensor kv_cache, c10::optional<torch::Tensor> kv_scales,
                    torch::Tensor slot_mapping);
bool advise_huge_pages(torch::Tensor t);

// attention.cpp (and attention_int8.cpp for an int8 cache)
void paged_attention(torch::Tensor out, torch::Tensor q, torch::Tensor kv_cache, c10::optional<torch::Tensor> kv_scales,
                     torch::Tensor block_tables,
                     torch::Tensor seq_lens, torch::Tensor seq_ids, torch::Tensor query_starts,
                     torch::Tensor query_lens, double scale, int64_t window, double softcap);
// The route attention over a bf16 cache takes here: "widened", "dot", "amx" or "amx-emulated".
std::string attention_kernel_route();
// "auto" (this CPU's default), "dot", "widened", "amx" (raises where the tiles cannot run) or
// "amx-emulated" (tests); fixed until the next call.
void set_attention_kernel_route(const std::string& route);
// Tests: the attention tiles' self-test machinery, with the child running the emulation.
bool amx_attention_self_test_machinery();
// Tests: the int8 cache's portable loops on a machine that has the vector ones (attention_int8.cpp).
void set_portable_int8_attention(bool portable);

// sampling.cpp
std::tuple<torch::Tensor, torch::Tensor> top_k_rows(torch::Tensor x, int64_t k);
std::tuple<torch::Tensor, torch::Tensor> top_k_rows_select(torch::Tensor x, int64_t k);
void screened_logits_out(torch::Tensor out, torch::Tensor x, torch::Tensor packed, torch::Tensor exact,
                         c10::optional<torch::Tensor> exact_scales, int64_t k);
void screened_argmax_out(torch::Tensor tokens, torch::Tensor scratch, torch::Tensor x, torch::Tensor packed,
                         torch::Tensor exact, c10::optional<torch::Tensor> exact_scales, int64_t k);
torch::Tensor sample_rows(torch::Tensor x, torch::Tensor inv_temperature, torch::Tensor log_min_p,
                          torch::Tensor uniforms);
torch::Tensor top_p_floor(torch::Tensor x, torch::Tensor inv_temperature, torch::Tensor top_p);
torch::Tensor row_logsumexp(torch::Tensor x, torch::Tensor inv_temperature);
torch::Tensor apply_token_bitmask(torch::Tensor x, torch::Tensor bitmask, torch::Tensor rows);
