"""Sparse runtime: predictors, neuron-aware FFN operators (kernels + torch references), tiers."""
