"""bench/gpu_programs.py's reading of XLA's optimized HLO: kernels by kind (a loop's body once per trip), copies,
arguments aliased to outputs, how an aliased array is written (in place or whole), and matrix products left to
loop kernels; on programs written here in XLA:GPU's text form (the compiling itself needs JAX's CUDA plugin,
in the benchmark's own environment)."""

from __future__ import annotations

from bench.gpu_programs import kernels, per_layer

HEAD = ("HloModule jit_step_fn, is_scheduled=true, input_output_alias={ {0}: (1, {}, may-alias) }, "
        "entry_computation_layout={(bf16[4096,1024]{1,0}, bf16[160,2,16,8,128]{4,3,2,1,0}, s32[1]{0})->"
        "(bf16[160,2,16,8,128]{4,3,2,1,0})}\n\n")

IN_PLACE = """%fused_dus (param_0.1: bf16[160,2,16,8,128], param_1.1: bf16[1,1,1,8,128], param_2.1: s32[1]) -> bf16[160,2,16,8,128] {
  %param_0.1 = bf16[160,2,16,8,128]{4,3,2,1,0} parameter(0)
  %param_1.1 = bf16[1,1,1,8,128]{4,3,2,1,0} parameter(1)
  ROOT %dynamic-update-slice.1 = bf16[160,2,16,8,128]{4,3,2,1,0} dynamic-update-slice(%param_0.1, %param_1.1, %c, %c, %c, %c, %c)
}

"""

WHOLE = """%fused_whole (param_0.2: bf16[160,2,16,8,128]) -> bf16[160,2,16,8,128] {
  %param_0.2 = bf16[160,2,16,8,128]{4,3,2,1,0} parameter(0)
  ROOT %multiply.1 = bf16[160,2,16,8,128]{4,3,2,1,0} multiply(%param_0.2, %param_0.2)
}

"""

# a K projection with one row as XLA:GPU rewrote it: a multiply and a reduce over the 4096 inputs, in a loop kernel
PRODUCT = """%fused_kproj (param_0.3: bf16[4096,1024], param_1.3: bf16[4096]) -> bf16[1024] {
  %param_0.3 = bf16[4096,1024]{1,0} parameter(0)
  %convert.1 = f32[4096,1024]{1,0} convert(%param_0.3), metadata={op_name="jit(step_fn)/dot_general"}
  %reduce.1 = f32[1024]{0} reduce(%convert.1, %zero), dimensions={0}, to_apply=%add, metadata={op_name="jit(step_fn)/dot_general"}
  ROOT %convert.2 = bf16[1024]{0} convert(%reduce.1)
}

"""

# a gemm's split-K partial sums (8 splits) reduced in the kernel that uses them: not a product
PARTIALS = """%fused_add (param_0.4: f32[8,1,4096]) -> bf16[1,4096] {
  %param_0.4 = f32[8,1,4096]{2,1,0} parameter(0)
  %reduce.2 = f32[1,4096]{1,0} reduce(%param_0.4, %zero), dimensions={0}, to_apply=%add, metadata={op_name="jit(step_fn)/dot_general"}
  ROOT %convert.3 = bf16[1,4096]{1,0} convert(%reduce.2)
}

%gemm_fusion_dot.1_computation (p0: bf16[1,4096], p1: bf16[4096,4096]) -> f32[8,1,4096] {
  ROOT %dot.1 = f32[8,1,4096]{2,1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (p: (s32[], bf16[1,4096])) -> (s32[], bf16[1,4096]) {
  %gemm_fusion_dot.2 = f32[8,1,4096]{2,1,0} fusion(%a, %b), kind=kCustom, calls=%gemm_fusion_dot.1_computation
  %loop_add_fusion.2 = bf16[1,4096]{1,0} fusion(%gemm_fusion_dot.2), kind=kLoop, calls=%fused_add
  ROOT %tuple.9 = (s32[], bf16[1,4096]{1,0}) tuple(%i, %loop_add_fusion.2)
}

"""


def program(entry: str, comps: str = IN_PLACE + WHOLE + PRODUCT + PARTIALS) -> str:
    return HEAD + comps + "ENTRY %main.1 (w: bf16[4096,1024], pool: bf16[160,2,16,8,128], pos: s32[1]) -> " \
        "(bf16[160,2,16,8,128]) {\n" + entry + "}\n"


def test_kernels_are_counted_by_kind_with_a_loops_body_once_per_trip():
    text = program("""  %w = bf16[4096,1024]{1,0} parameter(0)
  %pool = bf16[160,2,16,8,128]{4,3,2,1,0} parameter(1)
  %loop_dynamic_update_slice_fusion = bf16[160,2,16,8,128]{4,3,2,1,0} fusion(%pool, %u, %pos), kind=kLoop, calls=%fused_dus
  %pallas_call.1 = (f32[1,8,4,128]{3,2,1,0}, f32[1,8,4]{2,1,0}) custom-call(%q, %loop_dynamic_update_slice_fusion), custom_call_target="__gpu$xla.gpu.triton", api_version=API_VERSION_TYPED_FFI
  %cublas-gemm.1 = (bf16[1,1024]{1,0}, s8[0]{0}) custom-call(%x, %w), custom_call_target="__cublas$gemm"
  %while.1 = (s32[], bf16[1,4096]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %copy.1 = s32[1]{0} copy(%pos)
  ROOT %tuple.1 = (bf16[160,2,16,8,128]{4,3,2,1,0}) tuple(%loop_dynamic_update_slice_fusion)
""")
    k = kernels(text)
    assert k["by_kind"] == {"copy": 1, "fusion": 1 + 3, "gemm": 1 + 3, "pallas": 1}
    assert k["kernels"] == 10
    assert k["copies"] == [["s32[1]{0}", 4]]
    assert k["aliased"] == ["bf16[160,2,16,8,128]"]
    assert k["writes"] == {"in_place": 1, "whole": 0}
    assert k["dots_in_loop_kernels"] == 0  # split-K partial sums are not a product


def test_a_pool_written_whole_and_a_product_in_a_loop_kernel_are_found():
    text = program("""  %pool = bf16[160,2,16,8,128]{4,3,2,1,0} parameter(1)
  %loop_multiply_fusion = bf16[160,2,16,8,128]{4,3,2,1,0} fusion(%pool), kind=kLoop, calls=%fused_whole
  %loop_convert_fusion = bf16[1024]{0} fusion(%w, %x), kind=kLoop, calls=%fused_kproj
  %copy.2 = bf16[160,2,16,8,128]{4,3,2,1,0} copy(%loop_multiply_fusion)
  ROOT %tuple.1 = (bf16[160,2,16,8,128]{4,3,2,1,0}) tuple(%copy.2)
""")
    k = kernels(text)
    assert k["writes"] == {"in_place": 0, "whole": 1}
    assert k["dots_in_loop_kernels"] == 1
    assert k["copies"] == [["bf16[160,2,16,8,128]{4,3,2,1,0}", 160 * 2 * 16 * 8 * 128 * 2]]


def test_a_layers_kernels_are_the_two_layer_program_less_the_one_layer_one():
    one = {"kernels": 20, "by_kind": {"fusion": 14, "gemm": 5, "pallas": 1}}
    two = {"kernels": 33, "by_kind": {"fusion": 22, "gemm": 9, "pallas": 2}}
    assert per_layer(one, two, layers=32) == {"per_layer": 13, "per_layer_by_kind": {"fusion": 8, "gemm": 4,
                                                                                      "pallas": 1},
                                              "at_32_layers": 20 + 31 * 13}
