"""Errors of model loading, shared by the generic loader and every architecture."""

from __future__ import annotations


class UnsupportedModelError(ValueError):
    """The checkpoint's config names no architecture deepinfer serves, or is malformed."""


class CheckpointError(ValueError):
    """The checkpoint is malformed: an unreadable file, a missing, unexpected, mis-shaped or mis-typed
    tensor, or a quantisation its config.json does not declare. The message names the tensor and file."""
