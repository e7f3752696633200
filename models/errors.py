"""Errors raised while resolving and loading models, each with a message a user can act on."""


class ModelLoadError(Exception):
    """Base class: the model could not be loaded. ``str(err)`` is a one-line explanation."""


class WeightsNotFoundError(ModelLoadError):
    """No weights were found for a preset; the message lists the paths searched."""


class WeightsFormatError(ModelLoadError):
    """A weights file exists but cannot be read or does not match the architecture."""
