"""IQ4_NL/IQ4_XS, TQ1_0/TQ2_0, MXFP4 and Q1_0 (ggml-quants.c), and the CUDA kernels of these and of Q2_K/Q3_K.
"""
