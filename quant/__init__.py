"""Quantization: KJV calibration text (calibration.py), AWQ/GPTQ through gptqmodel (quantize.py) and held-out
perplexity with weights dequantized by kernels.quant_formats (evaluate.py). Submodules import their heavy
dependencies (gptqmodel, transformers) lazily; import them directly."""
