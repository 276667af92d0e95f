"""The balance scheduler (design 2.6): which rank runs which unit of work, in which order."""

from .scheduler import BALANCE_MODES, DEFAULT_BUCKETS, Assignment, Unit, UnitColumns, make_buckets, schedule

__all__ = ["BALANCE_MODES", "DEFAULT_BUCKETS", "Assignment", "Unit", "UnitColumns", "make_buckets", "schedule"]
