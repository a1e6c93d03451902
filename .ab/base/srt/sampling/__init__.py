"""Sampling parameters and the token sampler."""
