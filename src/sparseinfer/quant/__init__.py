"""Quantized weights for the dense parts (4-bit blocks, int8 head): see blocks.py, linear.py."""
