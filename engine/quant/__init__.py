"""Quantized weights: checkpoint formats (spec, layouts), the in-memory form (weights), the layers that hold it
(modules), its GEMM paths (paths) and `tianmen quantize` (quantize)."""
