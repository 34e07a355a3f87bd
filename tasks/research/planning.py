"""Planning: turn catalog entries and parameters into nodes, and nodes into shards."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence

import pyarrow as pa
from pydantic import TypeAdapter, ValidationError

from quantloop.tasks.engine import NodeKind, code_fingerprint, plan_nodes, sha256_json
from quantloop.tasks.research.features import (
    FeatureParams,
    compute_features,
    compute_features_many,
    feature_set,
)

_FEATURES = TypeAdapter(FeatureParams)


def normalized_overrides(base: FeatureParams, overrides: Mapping[str, Mapping]) -> dict[str, dict]:
    """Per-product overrides with each value in its canonical form (an override written
    50.0 or "50" is the override 50: the same node keys, the same run hash)."""
    out = {}
    for product, values in overrides.items():
        full = product_params(base, {product: values}, [product])[product].canonical()
        out[product] = {k: full[k] for k in values}
    return out


def feature_kind() -> NodeKind:
    """The feature node kind; its code fingerprint is the whole features module."""
    return NodeKind(
        name="features",
        compute=compute_features,
        code=code_fingerprint(sys.modules[compute_features.__module__]),
        prepare=FeatureParams.from_dict,
        compute_many=compute_features_many,
    )


def product_params(
    base: FeatureParams, overrides: Mapping[str, Mapping], products: Sequence[str]
) -> dict[str, FeatureParams]:
    """Feature parameters per product: the base with that product's overrides.

    Overrides may tune a product's windows but not change the feature layout,
    since one model reads every product.
    """
    unknown = set(overrides) - set(products)
    if unknown:
        raise ValueError(f"product_features names products not in this run: {sorted(unknown)}")
    out = {}
    layout = feature_set(base)
    for product in products:
        params = base
        if product in overrides:
            unknown = set(overrides[product]) - set(FeatureParams.__dataclass_fields__)
            if unknown:
                raise ValueError(
                    f"product_features[{product!r}]: unknown feature parameter(s) "
                    f"{sorted(unknown)}; known: {sorted(FeatureParams.__dataclass_fields__)}"
                )
            try:  # validated as the form's own fields are: 50, 50.0 and "50" are one value
                params = _FEATURES.validate_python({**base.canonical(), **overrides[product]})
            except ValidationError as exc:
                problems = "; ".join(
                    f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()
                )
                raise ValueError(f"product_features[{product!r}]: {problems}") from exc
            if feature_set(params) != layout:
                raise ValueError(
                    f"product_features[{product!r}] changes the feature columns; "
                    "only window lengths may differ between products"
                )
        out[product] = params
    return out


def param_digests(params: Mapping[str, FeatureParams]) -> tuple[dict[str, str], dict[str, dict]]:
    """(params digest by product, canonical params by digest): what node keys and
    the saved parameter records are made from."""
    by_digest: dict[str, dict] = {}
    digest_of: dict[str, str] = {}
    for product, p in params.items():
        canonical = p.canonical()
        digest_of[product] = sha256_json(canonical)
        by_digest[digest_of[product]] = canonical
    return digest_of, by_digest


def plan_feature_table(
    entries: pa.Table, params: Mapping[str, FeatureParams], kind: NodeKind
) -> tuple[pa.Table, dict[str, dict]]:
    """One feature node per row of a catalog table (`Catalog.table`), as a plan table
    (NODES_SCHEMA); returns it and the params by digest."""
    digest_of, by_digest = param_digests(params)
    return plan_nodes(kind, entries, digest_of), by_digest


def shards(table: pa.Table, max_nodes: int) -> list[pa.Table]:
    """Cut a catalog or plan table into shards of at most `max_nodes` rows: the Prefect
    task unit."""
    return [table.slice(i, max_nodes) for i in range(0, table.num_rows, max_nodes)]
