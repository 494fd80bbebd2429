"""The grid types IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S (ggml-quants.c quantize_iq*): CPU only.
"""
