"""Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 (ggml-quants.c quantize_row_q*_0_ref, quantize_q*_0/1): CPU, fused F16 input, CUDA.
"""
