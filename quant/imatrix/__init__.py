"""Importance matrices: the two file formats as stored (:mod:`.files`), the file as llama-quantize uses it
(:mod:`.reader`) and llama-imatrix's accumulators and file writers (:mod:`.collector`).
"""
