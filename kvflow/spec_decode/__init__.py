"""Speculative decoding: proposers (n-gram prompt lookup, a draft model) and the exact rejection
sampler that keeps the target model's output distribution."""
