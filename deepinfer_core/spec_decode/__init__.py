"""Speculative decoding with the checkpoint's MTP layer: drafting, verification, rollback, scheduling."""
