"""The one order-book schema every source lands in, and the partition definition.

LOBSTER's message + orderbook files, and our synthetic generator, both become one
Arrow table per (product, date): one row per event, message columns first, then
the book after that event, level by level. Prices stay integers in LOBSTER's unit
(dollars x 10^4) so digests are exact; features convert to floats.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass

import pyarrow as pa

PRICE_SCALE = 10_000  # LOBSTER prices are dollars x 10^4
DUMMY_ASK = 9_999_999_999  # LOBSTER fills empty ask levels with this price, size 0
DUMMY_BID = -9_999_999_999  # ... and empty bid levels with this one

# LOBSTER event types
SUBMIT, CANCEL, DELETE, EXEC_VISIBLE, EXEC_HIDDEN, CROSS, HALT = 1, 2, 3, 4, 5, 6, 7
EVENT_TYPES = frozenset({SUBMIT, CANCEL, DELETE, EXEC_VISIBLE, EXEC_HIDDEN, CROSS, HALT})

MESSAGE_FIELDS: list[pa.Field] = [
    pa.field("time", pa.float64()),  # seconds after midnight
    pa.field("event_type", pa.int8()),
    pa.field("order_id", pa.int64()),
    pa.field("size", pa.int64()),
    pa.field("price", pa.int64()),  # dollars x 10^4
    pa.field("direction", pa.int8()),  # +1 buy order, -1 sell order
]


def book_fields(levels: int) -> list[pa.Field]:
    """ask_price_1, ask_size_1, bid_price_1, bid_size_1, ... like LOBSTER's column order.

    Empty levels (LOBSTER's +-9999999999 dummies) are null prices with size 0.
    """
    fields = []
    for i in range(1, levels + 1):
        fields += [
            pa.field(f"ask_price_{i}", pa.int64()),
            pa.field(f"ask_size_{i}", pa.int64()),
            pa.field(f"bid_price_{i}", pa.int64()),
            pa.field(f"bid_size_{i}", pa.int64()),
        ]
    return fields


def book_schema(levels: int) -> pa.Schema:
    """Schema of one order-book partition with `levels` levels per side.

    `halted` is true for events inside a trading halt (between a type-7 halt
    message and the matching resume), so features and replay can skip them.
    """
    if levels < 1:
        raise ValueError(f"levels must be >= 1, got {levels}")
    return pa.schema(MESSAGE_FIELDS + book_fields(levels) + [pa.field("halted", pa.bool_())])


def levels_of(schema: pa.Schema) -> int:
    """Number of book levels in an order-book table's schema."""
    return sum(1 for name in schema.names if name.startswith("ask_price_"))


_PRODUCT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,31}$")


@dataclass(frozen=True, slots=True, order=True)
class Partition:
    """One immutable input partition: a product on a trading date."""

    product: str
    date: dt.date

    def __post_init__(self) -> None:
        if not _PRODUCT_RE.match(self.product):
            raise ValueError(
                f"product {self.product!r} is not a valid product name "
                "(letters, digits, '.', '_', '-'; at most 32 characters)"
            )
        if not isinstance(self.date, dt.date):
            raise ValueError(f"date must be a datetime.date, got {self.date!r}")

    @property
    def path(self) -> str:
        """Hive-style relative folder: product=X/date=YYYY-MM-DD."""
        return f"product={self.product}/date={self.date.isoformat()}"

    def __str__(self) -> str:
        return f"{self.product}/{self.date.isoformat()}"

    @classmethod
    def trusted(cls, product: str, date: dt.date) -> Partition:
        """A partition read back from our own catalog: validated when it was written."""
        p = object.__new__(cls)
        object.__setattr__(p, "product", product)
        object.__setattr__(p, "date", date)
        return p
