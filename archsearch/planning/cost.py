"""Price per device-hour: the table in :mod:`archsearch.hardware`, or the user's override.

Cost is wall time x devices x price per device-hour. The table's prices are assumed on-demand
list prices (late 2026, see ``archsearch.hardware``); they vary a lot between providers, so
every cost carries the price used and where it came from, and ``price_per_hour`` overrides it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from archsearch.errors import ArchsearchError
from archsearch.hardware import Device


@dataclass(frozen=True)
class Price:
    """USD per device-hour (None when unknown) and where the number came from."""

    usd_per_hour: float | None
    source: str


def resolve_price(device: Device, price_per_hour: float | None = None) -> Price:
    """The user's price when given, else the device table's; None (with the reason) when neither.

    The CPU entry has no price: a CPU cost is reported only when the user gives one.
    """
    if price_per_hour is not None:
        if not (math.isfinite(price_per_hour) and price_per_hour >= 0):
            raise ArchsearchError("price_per_hour", f"must be a non-negative number, got {price_per_hour!r}")
        return Price(float(price_per_hour), "given by the user")
    if device.price_per_hour is None:
        return Price(None, f"no price in the device table for {device.name!r}; "
                           "pass --price USD_PER_DEVICE_HOUR for a cost")
    return Price(device.price_per_hour,
                 f"archsearch.hardware table: assumed on-demand list price for {device.name} "
                 "(late 2026; varies by provider)")


def training_cost(hours: float, n_devices: int, price: Price) -> float | None:
    """Wall hours x devices x USD per device-hour; None when the price is unknown."""
    if price.usd_per_hour is None:
        return None
    return hours * n_devices * price.usd_per_hour
