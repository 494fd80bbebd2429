"""llama-quantize's behaviour as data and rules (tools/quantize/quantize.cpp, src/llama-quant.cpp):
presets, the per-tensor plan (and PowerInfer's), the type mixture, options and the file pipeline.
"""
