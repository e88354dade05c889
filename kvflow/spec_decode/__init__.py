"""Speculative decoding: proposers (n-gram prompt lookup, a draft model) that the engine consults after
each step; the exact rejection sampler that keeps the target's distribution is in kvflow/sample/."""
