"""Property-based tests (hypothesis): LOBSTER validation and canonical parameter hashing.

Validation: any valid book written as LOBSTER files reads back as itself, and one bad
cell anywhere is refused naming its file, row and column. Hashing: parameters that are
equal however they are written (key order, lists or tuples, 50 or 50.0 or "50") hash
the same, and parameters that differ never do.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter

from quantloop.flows.research import ResearchParams
from quantloop.tasks.data.ingest import DataValidationError, read_lobster
from quantloop.tasks.data.schema import DUMMY_ASK, DUMMY_BID, MESSAGE_FIELDS, levels_of
from quantloop.tasks.data.synthetic import SyntheticConfig, generate_day
from quantloop.tasks.engine import sha256_json
from quantloop.tasks.research.features import FeatureParams

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip

# ---------------------------------------------------------------- LOBSTER files


def lobster_lines(table: pa.Table) -> tuple[list[str], list[str]]:
    """A book table as LOBSTER's two CSVs: message rows, orderbook rows (empty levels as
    the +-9999999999 dummies with size 0)."""
    cols = {name: table.column(name).to_pylist() for name in table.column_names}
    msg = [
        ",".join(repr(v) if f.name == "time" else str(v) for f, v in
                 zip(MESSAGE_FIELDS, (cols[f.name][i] for f in MESSAGE_FIELDS), strict=True))
        for i in range(table.num_rows)
    ]  # fmt: skip
    book = []
    for i in range(table.num_rows):
        cells = []
        for k in range(1, levels_of(table.schema) + 1):
            for side, dummy in (("ask", DUMMY_ASK), ("bid", DUMMY_BID)):
                price = cols[f"{side}_price_{k}"][i]
                cells += [str(dummy if price is None else price), str(cols[f"{side}_size_{k}"][i])]
        book.append(",".join(cells))
    return msg, book


def write_lobster(folder: Path, table: pa.Table, msg: list[str], book: list[str]) -> Path:
    stem = f"PROP_2024-01-02_34200000_57600000_{{}}_{levels_of(table.schema)}.csv"
    path = folder / stem.format("message")
    path.write_text("\n".join(msg) + "\n")
    (folder / stem.format("orderbook")).write_text("\n".join(book) + "\n")
    return path


books = st.builds(
    lambda seed, levels, events: generate_day(
        "PROP",
        dt.date(2024, 1, 2),
        SyntheticConfig(seed=seed, levels=levels, events_per_day=events),
    ),  # fmt: skip
    seed=st.integers(0, 10_000),
    levels=st.integers(1, 4),
    events=st.integers(20, 300),
)


@SETTINGS
@given(table=books)
def test_a_valid_book_written_as_lobster_reads_back_as_itself(tmp_path_factory, table):
    folder = tmp_path_factory.mktemp("lobster")
    [day] = read_lobster(write_lobster(folder, table, *lobster_lines(table)))
    assert day.table.equals(table)


@SETTINGS
@given(table=books, data=st.data())
def test_one_bad_cell_is_refused_naming_its_row_and_column(tmp_path_factory, table, data):
    msg, book = lobster_lines(table)
    in_book = data.draw(st.booleans(), label="in the orderbook file")
    lines = book if in_book else msg
    row = data.draw(st.integers(0, len(lines) - 1), label="row")
    cells = lines[row].split(",")
    column = data.draw(st.integers(0, len(cells) - 1), label="column")
    cells[column] = data.draw(st.sampled_from(["x", "1.5.2", "--3", "", "NaN?"]), label="bad")
    lines[row] = ",".join(cells)
    folder = tmp_path_factory.mktemp("lobster")
    path = write_lobster(folder, table, msg, book)
    with pytest.raises(DataValidationError) as err:
        read_lobster(path)
    kind = "orderbook" if in_book else "message"
    assert f"_{kind}_{levels_of(table.schema)}.csv: row {row + 1}, column {column + 1}" in str(
        err.value
    )


@SETTINGS
@given(table=books, data=st.data())
def test_time_going_backwards_is_refused_at_that_row(tmp_path_factory, table, data):
    msg, book = lobster_lines(table)
    row = data.draw(st.integers(1, len(msg) - 1), label="row")
    cells = msg[row].split(",")
    previous = float(msg[row - 1].split(",")[0])
    cells[0] = repr(previous - data.draw(st.floats(0.001, 100), label="back by"))
    msg[row] = ",".join(cells)
    path = write_lobster(tmp_path_factory.mktemp("lobster"), table, msg, book)
    with pytest.raises(DataValidationError, match=rf"message_\d+\.csv: row {row + 1}\b"):
        read_lobster(path)


# ---------------------------------------------------------------- canonical hashing

windows = st.lists(st.integers(1, 2_000), min_size=1, max_size=4)
feature_values = st.fixed_dictionaries({
    "imbalance_levels": st.integers(1, 10),
    "return_lags": windows,
    "vol_windows": windows,
    "ofi_window": st.integers(1, 2_000),
    "label_horizons": windows,
})  # fmt: skip


def written_differently(values: dict, draw) -> dict:
    """The same parameters as a user might write them: another key order, tuples or
    lists, integers as 50, 50.0 or "50"."""

    def number(n: int):
        return draw(st.sampled_from([n, float(n), str(n)]))

    out = {}
    for key in draw(st.permutations(list(values))):
        v = values[key]
        if isinstance(v, list):
            seq = [number(x) for x in v]
            out[key] = tuple(seq) if draw(st.booleans()) else seq
        else:
            out[key] = number(v)
    return out


def params_hash(values: dict) -> str:
    """The digest that enters a feature node's key, from parameters as the flows get them
    (validated by pydantic, as the Prefect form and `--params` are)."""
    return sha256_json(TypeAdapter(FeatureParams).validate_python(values).canonical())


@SETTINGS
@given(values=feature_values, data=st.data())
def test_equal_parameters_written_differently_hash_the_same(values, data):
    assert params_hash(written_differently(values, data.draw)) == params_hash(values)


@SETTINGS
@given(a=feature_values, b=feature_values)
def test_different_parameters_never_hash_the_same(a, b):
    same = TypeAdapter(FeatureParams).validate_python(a) == TypeAdapter(
        FeatureParams
    ).validate_python(b)
    assert (params_hash(a) == params_hash(b)) == same


@SETTINGS
@given(values=feature_values, data=st.data())
def test_a_research_run_hashes_its_parameters_the_same_however_written(values, data):
    products = ["SYNA", "SYNB"]
    override = {"ofi_window": values["ofi_window"]}
    one = {"features": values, "data": {"products": products},
           "product_features": {"SYNB": override}}  # fmt: skip
    two = json.loads(json.dumps({
        "product_features": {"SYNB": written_differently(override, data.draw)},
        "data": {"products": products},
        "features": written_differently(values, data.draw),
    }))  # fmt: skip
    assert ResearchParams.model_validate(one).hash() == ResearchParams.model_validate(two).hash()
    changed = {**one, "product_features": {"SYNB": {"ofi_window": values["ofi_window"] + 1}}}
    assert (
        ResearchParams.model_validate(changed).hash() != ResearchParams.model_validate(one).hash()
    )


def test_sha256_json_ignores_key_order_and_nothing_else():
    assert sha256_json({"a": 1, "b": [1, 2]}) == sha256_json({"b": [1, 2], "a": 1})
    assert sha256_json({"a": 1}) != sha256_json({"a": "1"})
    assert sha256_json({"a": [1, 2]}) != sha256_json({"a": [2, 1]})
