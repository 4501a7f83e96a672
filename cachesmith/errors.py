"""Error types. Every message names the field or file at fault and the limit it broke."""
from __future__ import annotations


class CachesmithError(Exception):
    """Base of every error cachesmith raises on purpose."""


class InputError(CachesmithError, ValueError):
    """A request, prompt or argument is invalid (empty, too long, out of range)."""


class ConfigError(CachesmithError, ValueError):
    """A configuration dataclass was given an invalid value."""


class ModelAssetError(CachesmithError, RuntimeError):
    """A model directory is missing, incomplete, corrupt or of an unsupported architecture."""
