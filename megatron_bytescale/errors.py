"""User-facing errors: each message names the problem and the fix."""


class BytescaleError(ValueError):
    """Bad input or configuration. The CLI prints these without a traceback."""


class PlanError(BytescaleError):
    """A plan breaks one of its invariants (see ``Plan.validate``)."""


class ConfigError(BytescaleError):
    """A config, profile, flag combination or data file is malformed or inconsistent."""
