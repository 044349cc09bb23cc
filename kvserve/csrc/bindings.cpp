// The extension's Python bindings: every C++ file's functions, bound here and nowhere else.
#include <torch/extension.h>
#include <pybind11/stl.h>

#include "cpu_ops.h"
#include "decoder.h"
#include "moe_routing.h"
#include "step_team.h"
#include "amx_linear.h"
#include "block_repack.h"
#include "dense_linear.h"
#include "quant_linear.h"
#include "screen_linear.h"
#include "w8a8_linear.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("advise_huge_pages", &advise_huge_pages);
  m.def("rms_norm", &rms_norm);
  m.def("rope_qk_", &rope_qk_);
  m.def("write_kv_cache", &write_kv_cache);
  m.def("paged_attention", &paged_attention);
  m.def("attention_kernel_route", &attention_kernel_route);
  m.def("set_attention_kernel_route", &set_attention_kernel_route);
  m.def("amx_attention_self_test_machinery", &amx_attention_self_test_machinery);
  m.def("set_portable_int8_attention", &set_portable_int8_attention);
  m.def("act_and_mul", &act_and_mul);
  m.def("top_k_rows", &top_k_rows);
  m.def("top_k_rows_select", &top_k_rows_select);
  m.def("screened_logits_out", &screened_logits_out);
  m.def("screened_argmax_out", &screened_argmax_out);
  m.def("sample_rows", &sample_rows);
  m.def("row_logsumexp", &row_logsumexp);
  m.def("top_p_floor", &top_p_floor);
  m.def("apply_token_bitmask", &apply_token_bitmask);
  m.def("softmax_top_k", &softmax_top_k);
  m.def("q4_linear", &q4_linear);
  m.def("q5_linear", &q5_linear);
  m.def("tiled_nibble_linear", &tiled_nibble_linear);
  m.def("tiled_nibble_int8_linear", &tiled_nibble_int8_linear);
  m.def("int8_prompt_kernels", &int8_prompt_kernels);
  m.def("q8_linear", &q8_linear);
  m.def("q8_linear_out", &q8_linear_out);
  m.def("q8_0_quantize", &q8_0_quantize);
  // (the GIL released: the engine loads its tokenizer in Python meanwhile)
  m.def("gguf_nibble_tiles", &gguf_nibble_tiles, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("gguf_byte_blocks", &gguf_byte_blocks, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("gguf_q6_k_tiles", &gguf_q6_k_tiles, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("q8_0_reproduces", &q8_0_reproduces);
  // Step teams (step_team.h).
  m.def("set_step_teams", &kvserve::set_step_teams,
        "One parallel region per fused decoder step (kvserve::run_in_step_team) or one per kernel call");
  m.def("step_teams_enabled", &kvserve::step_teams_enabled);
  m.def("step_team_empty_call_seconds", &kvserve::step_team_empty_call_seconds,
        "benchmarks: an empty parallel call's cost");
  m.def("step_teams_formed", &kvserve::step_teams_formed, "tests: how many step teams have formed in this process");
  m.def("step_team_probe", &kvserve::step_team_probe, "tests: the thread of each index in a team and in at::parallel_for",
        pybind11::arg("n"), pybind11::arg("grain"), pybind11::arg("throw_on") = -1, pybind11::arg("throw_after") = false,
        pybind11::arg("nested") = false, pybind11::arg("require_team") = true,
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("set_portable_quant_kernels", &set_portable_quant_kernels);
  m.def("quant_kernel_isa", &quant_kernel_isa);
  m.def("nibble_activation_format", &nibble_activation_format);
  m.def("q4_screen_linear", &q4_screen_linear);
  m.def("q4_screen_linear_out", &q4_screen_linear_out);
  m.def("q4_screen_pack", &q4_screen_pack);
  m.def("set_portable_screen_kernel", &set_portable_screen_kernel);
  m.def("bf16_linear", &bf16_linear);
  m.def("bf16_linear_out", &bf16_linear_out);
  m.def("pack_bf16_weight", &pack_bf16_weight);
  m.def("fp32_linear", &fp32_linear);
  m.def("table_rows", &table_rows, pybind11::arg("w"), pybind11::arg("w_scales"), pybind11::arg("ids"));
  m.def("gathered_rows_dot", &gathered_rows_dot, pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("idx"),
        pybind11::arg("w_scales") = pybind11::none());
  m.def("set_portable_dense_kernels", &set_portable_dense_kernels);
  m.def("bf16_kernel_route", &bf16_kernel_route);
  m.def("w8a8_linear", &w8a8_linear, pybind11::arg("x"), pybind11::arg("wp"), pybind11::arg("affine"), pybind11::arg("n"),
        pybind11::arg("bias"), pybind11::arg("largest_codes") = pybind11::none());
  m.def("w8a8_linear_out", &w8a8_linear_out, pybind11::arg("out"), pybind11::arg("x"), pybind11::arg("wp"),
        pybind11::arg("affine"), pybind11::arg("bias"), pybind11::arg("largest_codes") = pybind11::none());
  m.def("w8a8_activations", &w8a8_activations);
  m.def("w8a8_kernel_route", &w8a8_kernel_route);
  m.def("set_portable_w8a8_kernel", &set_portable_w8a8_kernel);
  m.def("set_bf16_kernel_route", &set_bf16_kernel_route);
  m.def("amx_bf16_available", &amx_bf16_available);
  m.def("amx_bf16_status", &amx_bf16_status);
  m.def("amx_self_test_machinery", &amx_self_test_machinery);
  // The fused decoder (decoder.cpp).
  m.def("set_expert_parallel_rows", &set_expert_parallel_rows);
  m.def("expert_parallel_rows", &expert_parallel_rows);
  pybind11::class_<FusedDecoderLayers>(m, "FusedDecoderLayers")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, double, int64_t, const std::vector<pybind11::dict>&>())
      .def("forward_tokens", &FusedDecoderLayers::forward_tokens)
      .def("decode_round", &FusedDecoderLayers::decode_round)
      .def("__len__", &FusedDecoderLayers::num_layers)
      .def_property_readonly("runs_in_step_team", &FusedDecoderLayers::team_safe);
}
