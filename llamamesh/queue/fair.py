"""Fair share between the tenants of a pool: deficit round robin (DRR) over their work streams, a plan
without I/O of how many jobs a worker's lease asks of each tenant's stream. While several tenants
have jobs waiting, each gets workers in proportion to its weight, and a tenant that arrives behind
another's burst is served at its next turn rather than after the burst.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping


class FairShare:
    """The DRR state of one pool in one worker process: its tenants, their weights and deficits.

    - Tenants are visited in a fixed order (sorted names; the default tenant "" first), one turn
      each. A turn adds the tenant's quantum to its deficit: its weight over the smallest weight
      among the tenants that may have work, so the lightest takes one job a turn and a tenant of
      weight 3 three. The turn takes whole jobs out of the deficit; it ends when less than one is
      left, or carries over to the next lease when the lease ran out of slots mid-turn.
    - A tenant whose stream gave fewer jobs than it was asked is empty: its deficit drops to 0 (no
      credit piles up while it has nothing waiting) and the slots it left go to the others.

    Nothing of it is shared or durable: another worker, or a restart, starts its own rounds.
    """

    def __init__(self) -> None:
        self._weights: dict[str, float] = {"": 1.0}
        self._order: list[str] = [""]
        self._deficit: dict[str, float] = {}
        self._cursor = 0
        # When the tenants were last read (the caller's clock; None: never).
        self.read_at: float | None = None

    @property
    def tenants(self) -> list[str]:
        """Every tenant with a work stream in the pool, in visiting order."""
        return list(self._order)

    def weight(self, tenant: str) -> float:
        return self._weights.get(tenant, 1.0)

    def set_tenants(self, weights: Mapping[str, float], now: float | None = None) -> None:
        """The pool's tenants and their weights (the default tenant "" is always one, of weight 1.0
        unless given; weights that are not positive count as 1.0). The turn in progress goes on."""
        current = self._order[self._cursor] if self._order else ""
        self._weights = {"": 1.0, **{t: (w if w > 0 else 1.0) for t, w in weights.items()}}
        self._order = sorted(self._weights)
        self._deficit = {t: d for t, d in self._deficit.items() if t in self._weights}
        # Resume at the tenant whose turn it was, or at the one after it in name order.
        self._cursor = next((i for i, t in enumerate(self._order) if t >= current), 0)
        self.read_at = now

    def plan(self, slots: int, candidates: Collection[str]) -> dict[str, int]:
        """How many jobs to ask of each of ``candidates`` (tenants that may have jobs waiting) to
        fill ``slots``; the asks add up to ``slots`` exactly (none when no candidate is known)."""
        ready = [t for t in self._order if t in candidates]
        asks: dict[str, int] = {}
        if not ready or slots <= 0:
            return asks
        lightest = min(self._weights[t] for t in ready)
        while slots > 0:
            tenant = self._order[self._cursor]
            if tenant not in candidates:
                self._advance()
                continue
            deficit = self._deficit.get(tenant, 0.0)
            if deficit < 1.0:  # a new turn
                deficit += self._weights[tenant] / lightest
            take = min(int(deficit), slots)
            asks[tenant] = asks.get(tenant, 0) + take
            deficit -= take
            slots -= take
            self._deficit[tenant] = deficit
            if deficit < 1.0:  # its turn is over; else the next lease goes on with it
                self._advance()
        return asks

    def served(self, tenant: str, asked: int, got: int) -> None:
        """What a tenant's stream gave of what it was asked: fewer means it is empty, and an empty
        tenant keeps no deficit."""
        if got < asked:
            self._deficit[tenant] = 0.0

    def _advance(self) -> None:
        self._cursor = (self._cursor + 1) % len(self._order)
