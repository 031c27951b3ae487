"""Decoding: sampling, the lossless speculative step and tree verification, and the drafters
(draft model, n-gram, suffix, EAGLE-3 head) behind one interface."""
