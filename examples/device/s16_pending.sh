#!/usr/bin/env bash
# The first device run of what session 16 left off by default (docs/h200/s16/README.md), in one call (after
# `bash examples/device/slim.sh`, carrying .gpu/site_k.tar.xz .gpu/dist .gpu/tlcache.tar.xz; about 7 minutes on an
# H200 with a kernel cache packed by kernel_warm.py): the conformance tests of the FP8 stream MoE and of the two
# copy-free launches, examples/moe_fp8_bench.py, then the engine with each switch off and on, alternating, and a
# b256 kernel table with the copies gone. Everything lands in $OUT (summary.txt, conf.log, micro.tar, suites.tar).
R(){ STAGES=suites SUITES="$1" bash examples/device/s12_decode.sh > /dev/null 2>&1; }
CONF_CAP=240 STAGES=conf CONF="tests/test_fp8_gemm_gpu.py -k fused_moe;tests/test_kernels_cuda_gpu.py -k 'rope_writes or mla_q_absorb_real';tests/test_decode_fusion_ops_gpu.py -k 'f32_copy or moe_gate_real'" \
  bash examples/device/s12_decode.sh > /dev/null 2>&1
MICRO_CAP=200 STAGES=micro MICRO="python3 examples/moe_fp8_bench.py --shapes v2-lite,v3 --batches 5,16,64,256,512,2048 --variants 64,256 --out \$M/moe_fp8.json" \
  bash examples/device/s12_decode.sh > /dev/null 2>&1
CAP=150 R "fp8off|1,64,256|fp8||"; CAP=150 R "fp8on|1,64,256|fp8|DEEPINFER_FP8_MOE_STREAM=1|"
R "fp8off2|64,256|fp8||"; R "fp8on2|64,256|fp8|DEEPINFER_FP8_MOE_STREAM=1|"
R "castA1|64,256|bf16||"; R "castB1|64,256|bf16|DEEPINFER_NO_CAST_LAUNCHES=1|"
R "castA2|64,256|bf16||"; R "castB2|64,256|bf16|DEEPINFER_NO_CAST_LAUNCHES=1|"
R "prof256|256|bf16|PROFILE=1 DEEPINFER_NO_CAST_LAUNCHES=1|"
cat "$OUT/summary.txt"; tail -40 "$OUT/conf.log"
