"""Importance matrices: the file as llama-quantize reads it (:mod:`.reader`) and llama-imatrix's
accumulators and file writers (:mod:`.collector`).
"""
