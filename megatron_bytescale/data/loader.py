"""What both loaders share: the stepping API. The entry point that picks one,
``make_loader("local" | "ray", ...)``, is in ``loader_factory`` (it imports both loaders,
which import this module)."""

from __future__ import annotations

from ..errors import ConfigError


class StepLoader:
    """The stepping API of both loaders; a subclass provides ``batch(rank)`` (this step, for
    ``rank``, without advancing) and ``advance()``, and sets ``self.rank`` (or None)."""

    rank: int | None = None

    def next_step(self, rank: int | None = None):
        batch = self.batch(rank)
        self.advance()
        return batch

    def __iter__(self):
        while True:
            yield self.next_step()

    def _rank(self, rank: int | None) -> int:
        rank = self.rank if rank is None else rank
        if rank is None:
            raise ConfigError("which rank? pass rank= to the loader or to batch()/next_step()")
        return rank
