"""The one exception type of checkpoint conversion and loading."""


class ConversionError(ValueError):
    """A checkpoint that cannot be converted or loaded: unsupported, inconsistent or corrupt.

    A ValueError, so that callers that already catch bad arguments catch this too. The message
    names the file or tensor, the value found and what was expected.
    """
