"""The one exception type of checkpoint conversion and loading."""


class ConversionError(ValueError):
    """A checkpoint that cannot be converted or loaded: unsupported, inconsistent or corrupt.

    A ValueError, so that callers that already catch bad arguments catch this too. The message
    names the file or tensor, the value found and what was expected.
    """


def run_reporting_errors(prog: str, call, errors: tuple = (ConversionError, OSError)):
    """(call(), 0), or (None, 1) after printing ``PROG: error: MESSAGE`` to stderr when ``call``
    raises one of ``errors``: how the command lines (marlin-convert, marlin-quantize,
    marlin-eval) turn bad input into exit status 1 with a one-line message, not a traceback."""
    import sys

    try:
        return call(), 0
    except errors as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return None, 1
