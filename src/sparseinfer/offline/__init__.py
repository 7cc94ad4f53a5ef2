"""Offline pipeline: profile activations, train predictors, solve placement, export a sparse GGUF."""
