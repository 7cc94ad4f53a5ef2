"""Fused kernels for the non-matmul work of single-token decode (see decode.py)."""
