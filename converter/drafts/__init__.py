"""Drafts at work: the reference host loop, speculative decoding, the loop model and the draft
comparison.
"""
