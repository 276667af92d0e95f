"""User-facing errors: each message names the problem and the fix."""


class BytescaleError(ValueError):
    """Bad input or configuration. The CLI prints these without a traceback."""


class PlanError(BytescaleError):
    """A plan breaks one of its invariants (see ``Plan.validate``)."""


class ConfigError(BytescaleError):
    """A config, profile, flag combination or data file is malformed or inconsistent."""


class WorkerError(RuntimeError):
    """A rank of a local world raised, died or stalled; the message names the rank (and carries
    its traceback when it raised). The CLI prints it without the launcher's own traceback."""


def excerpt(text: str, limit: int = 40) -> str:
    """``text`` quoted for an error message, cut to ``limit`` characters (a bad line in a file
    may be megabytes long; the message stays one short line)."""
    text = str(text)
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text):,} characters)"
