"""Privacy units: which dataset rows belong to the same protected individual.

By default every row is its own unit. With a unit column (a user id, a document id...) all rows
sharing a value form one unit: they are sampled together, go into the same micro-batch, and
their gradients are summed before clipping, so the guarantee covers the whole unit.
"""

from __future__ import annotations

from typing import Any, Hashable, List, Optional, Sequence

import numpy as np


class PrivacyUnits:
    """The rows of each unit (``rows_of(u)``) and the unit of each row (``unit_of_row``).

    Units are numbered 0..num_units-1 in order of first appearance in the dataset.
    """

    def __init__(self, unit_of_row: np.ndarray, column: Optional[str] = None) -> None:
        self.unit_of_row = np.asarray(unit_of_row, dtype=np.int64)
        self.column = column
        order = np.argsort(self.unit_of_row, kind="stable")
        counts = np.bincount(self.unit_of_row) if self.unit_of_row.size else np.zeros(0, dtype=np.int64)
        self._rows: List[np.ndarray] = np.split(order, np.cumsum(counts)[:-1]) if counts.size else []

    @classmethod
    def one_per_row(cls, num_rows: int) -> "PrivacyUnits":
        return cls(np.arange(num_rows))

    @classmethod
    def from_values(cls, values: Sequence[Hashable], column: Optional[str] = None) -> "PrivacyUnits":
        """Units from one value per row; rows with equal values share a unit."""
        index: dict = {}
        try:
            unit_of_row = np.fromiter((index.setdefault(v, len(index)) for v in values), dtype=np.int64)
        except TypeError as error:
            raise ValueError(
                f"privacy unit column {column!r} must hold hashable values (ids such as ints or strings): {error}"
            ) from None
        return cls(unit_of_row, column)

    @classmethod
    def from_dataset(cls, dataset: Any, column: Optional[str]) -> "PrivacyUnits":
        """Units of ``dataset`` from ``column`` (a datasets.Dataset column or a key of each item)."""
        if column is None:
            return cls.one_per_row(len(dataset))
        column_names = getattr(dataset, "column_names", None)
        if column_names is not None:
            if column not in column_names:
                raise ValueError(
                    f"privacy_unit_column={column!r} is not a column of the (prepared) training dataset; its columns "
                    f"are {sorted(column_names)}. Add the column, or leave privacy_unit_column unset (a unit per row)."
                )
            return cls.from_values(list(dataset[column]), column)
        values = []
        for i in range(len(dataset)):
            item = dataset[i]
            if not hasattr(item, "__getitem__") or column not in item:
                raise ValueError(f"privacy_unit_column={column!r}: dataset item {i} has no key {column!r}")
            values.append(item[column])
        return cls.from_values(values, column)

    @property
    def num_units(self) -> int:
        return len(self._rows)

    @property
    def num_rows(self) -> int:
        return int(self.unit_of_row.size)

    @property
    def trivial(self) -> bool:
        """True when every row is its own unit (no grouping needed)."""
        return self.num_units == self.num_rows

    def rows_of(self, units: Sequence[int]) -> List[int]:
        """The dataset rows of ``units``, unit by unit."""
        if self.trivial and self.column is None:
            return [int(u) for u in units]
        if len(units) == 0:
            return []
        return np.concatenate([self._rows[int(u)] for u in units]).tolist()

    def largest_unit(self) -> int:
        """Rows in the largest unit."""
        return max((len(r) for r in self._rows), default=0)
