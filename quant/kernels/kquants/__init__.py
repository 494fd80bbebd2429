"""Q2_K ... Q6_K (ggml-quants.c quantize_row_q*_K_ref, quantize_q*_K) and the k-quant subroutines
shared with the grid and low-bit families.
"""
