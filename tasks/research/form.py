"""The research form's words for the configs that live in code-fingerprinted modules.

FeatureParams (tasks/research/features.py), TrainConfig (tasks/research/training.py),
SimConfig (tasks/research/simulation.py) and WalkForward (tasks/research/folds.py) sit in
modules whose whole source goes into the keys of the outputs they decide
(`code_fingerprint`): a description written there would re-key every stored feature
node, model and simulation. Their titles, descriptions, units, bounds and choices are
written here instead, field by field, and `Form` makes pydantic, and so the Prefect UI,
see them:

    TrainForm = Annotated[TrainConfig, Form(TrainConfig, description=..., fields={...})]

A value is validated by a pydantic model of the dataclass's own fields and defaults
with these words on them (an error names the field: `train.steps: Input should be
greater than or equal to 1`), then built as the dataclass, whose `__post_init__` still
runs; it serializes exactly as the dataclass did, so parameter hashes do not move.
Every field must have its words: a field added to a config without them fails here, at
import.

SyntheticConfig's module is not fingerprinted (landed data is keyed by its content),
so its words sit on its fields (tasks/data/synthetic.py), as they do on the pydantic models.
"""

from __future__ import annotations

import copy
import dataclasses
import typing
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    create_model,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import core_schema

from quantloop.tasks.research.features import FeatureParams
from quantloop.tasks.research.folds import WalkForward
from quantloop.tasks.research.simulation import SimConfig
from quantloop.tasks.research.train_config import TrainConfig

Events = Annotated[int, Field(ge=1)]


def without_null_branches(schema: dict[str, Any], handler: Any) -> dict[str, Any]:
    """The JSON schema of a form's model, and of every model it refers to, with each
    optional field as its one type rather than `anyOf: [<type>, {"type": "null"}]`.

    Prefect's run form renders every branch of an `anyOf` as a tab, a null branch as the
    text 'Property is type "None"', and picks that tab for a field whose value is None:
    the note stood under every optional field. Without the branch, the field is its
    type's input, empty while the value is None; left empty, the model's default (None)
    applies, and JSON may still give null (the models are unchanged, only their schema;
    a field of several types, a block picker, takes no null through a deployment: leave it
    out instead).
    A saved block's own fields are left as they are: the form offers a picker of saved
    blocks, not their fields. Use as a model's `__get_pydantic_json_schema__`."""
    seen: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                visit(item)
            return
        if not isinstance(node, dict):
            return
        if "$ref" in node:
            ref = node["$ref"]
            if ref not in seen:
                seen.add(ref)
                definition = handler.resolve_ref_schema({"$ref": ref})
                if "block_type_slug" not in definition:
                    visit(definition)
        branches = node.get("anyOf")
        if isinstance(branches, list) and {"type": "null"} in branches:
            kept = [b for b in branches if b != {"type": "null"}]
            if len(kept) == 1 and "$ref" not in kept[0]:
                del node["anyOf"]
                # the field's own title and description win over its type's
                node.update({k: v for k, v in kept[0].items() if k not in node})
            else:
                node["anyOf"] = kept
            # No default: the form leaves the field out rather than sending null, and
            # Prefect's check of a run's parameters (jsonschema, when a deployment's run is
            # created) still takes null for a typed field that is optional and has none.
            if node.get("default", 0) is None:
                del node["default"]
        if isinstance(node.get("default"), dict):
            node["default"] = _without_none(node["default"])
        for key, value in node.items():
            if key != "$ref":
                visit(value)

    visit(schema)
    return schema


class _Definitions:
    """What `without_null_branches` asks of pydantic's handler, over a finished schema's
    definitions."""

    def __init__(self, definitions: dict[str, Any]):
        self.definitions = definitions

    def resolve_ref_schema(self, ref: dict[str, str]) -> dict[str, Any]:
        return self.definitions[ref["$ref"].rsplit("/", 1)[-1]]


def form_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A flow's whole parameter schema (Prefect's `parameter_schema(flow)`, as a dict)
    without null branches, as `without_null_branches` makes a model's: a flow's own
    keyword parameters (`parent_run_id: str | None`) and every model they refer to,
    whether or not the model has the hook. What a deployment is created with
    (quantloop/deploy.py), so every deployment's run form is free of them."""
    out = copy.deepcopy(schema)
    key = "definitions" if "definitions" in out else "$defs"
    definitions = out.pop(key, {})
    without_null_branches(out, _Definitions(definitions))  # follows $refs into them
    if definitions:
        out[key] = definitions
    return out


def _without_none(value: Any) -> Any:
    """A default object without its None fields (left out, they are the same default)."""
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    return value


class Form:
    """Pydantic metadata that validates a config dataclass through a described model.

    fields: name -> `Field(...)` (descriptions, bounds), or (annotation, `Field(...)`)
    where the form narrows the type (a Literal of the choices). Defaults are the
    dataclass's own, so they are written once; `preset` (an instance of the config)
    gives the form other defaults than the dataclass's.
    """

    def __init__(
        self,
        config: type,
        *,
        description: str,
        fields: Mapping[str, Any],
        preset: Any = None,
    ) -> None:
        names = [f.name for f in dataclasses.fields(config)]
        if set(fields) != set(names):
            raise TypeError(
                f"{config.__name__}'s form must describe exactly its fields; "
                f"missing {sorted(set(names) - set(fields))}, unknown "
                f"{sorted(set(fields) - set(names))}"
            )
        hints = typing.get_type_hints(config)
        defaults = {f.name: f.default for f in dataclasses.fields(config)}
        if preset is not None:
            defaults = {name: getattr(preset, name) for name in defaults}
        specs = {}
        for name in names:
            annotation, info = fields[name] if isinstance(fields[name], tuple) else (
                hints[name], fields[name]
            )  # fmt: skip
            if not isinstance(info, FieldInfo):
                raise TypeError(f"{config.__name__}.{name}: expected Field(...), got {info!r}")
            info = FieldInfo.merge_field_infos(info, default=defaults[name])
            specs[name] = (annotation, info)
        self.config = config
        self.names = names
        self.model: type[BaseModel] = create_model(
            config.__name__,
            __config__=ConfigDict(extra="forbid"),
            __doc__=description,
            **specs,
        )

    def field(self, name: str) -> tuple[Any, FieldInfo]:
        """A field's annotation and words, for a model that reuses them."""
        info = self.model.model_fields[name]
        return info.annotation, info

    def __get_pydantic_core_schema__(self, source: type, handler) -> core_schema.CoreSchema:
        as_config = handler(source)  # the dataclass's own schema: how values serialize

        def from_instance(value: Any) -> Any:
            if isinstance(value, self.config):
                return {n: getattr(value, n) for n in self.names}
            return value

        def build(form: BaseModel) -> Any:
            return self.config(**{n: getattr(form, n) for n in self.names})

        return core_schema.no_info_before_validator_function(
            from_instance,
            core_schema.no_info_after_validator_function(
                build, handler.generate_schema(self.model)
            ),
            serialization=core_schema.plain_serializer_function_ser_schema(
                lambda value: value, return_schema=as_config
            ),
        )


FEATURES = Form(
    FeatureParams,
    description="The feature node's parameters. Windows and horizons count order-book "
    "events (each message is one event), not seconds.",
    fields={
        "imbalance_levels": Field(
            ge=1,
            le=50,
            title="Imbalance levels",
            description="Depth imbalance is computed over the first 1..k book levels, for k up "
            "to this (1 to 50; a book with fewer levels uses all it has).",
        ),
        "return_lags": (
            tuple[Events, ...],
            Field(
                min_length=1,
                title="Return lags (events)",
                description="Past mid returns in bps over these many events (integers >= 1).",
            ),
        ),
        "vol_windows": (
            tuple[Events, ...],
            Field(
                min_length=1,
                title="Volatility windows (events)",
                description="Realized volatility of the mid over these many events "
                "(integers >= 1).",
            ),
        ),
        "ofi_window": Field(
            ge=1,
            title="OFI window (events)",
            description="Order-flow imbalance at the touch, summed over this many events "
            "(>= 1). The one parameter a product may override.",
        ),
        "label_horizons": (
            tuple[Events, ...],
            Field(
                min_length=1,
                title="Label horizons (events)",
                description="What the model predicts: the mid move in bps this many events "
                "ahead (integers >= 1; the longest must be shorter than a day's events).",
            ),
        ),
    },
)

TRAIN = Form(
    TrainConfig,
    description="How the order-book model is trained: windows of events, batches, steps, "
    "optimizer and device. Same seed and data, same weights on CPU.",
    fields={
        "seed": Field(
            ge=0, title="Seed", description="Random seed of initialization and batch order (>= 0)."
        ),
        "window": Field(
            ge=1,
            le=4096,
            title="Window (events)",
            description="Events the model sees per prediction, the current one included "
            "(1 to 4,096).",
        ),
        "stride": Field(
            ge=1,
            title="Stride (events)",
            description="One training window every this many events (>= 1; 1 = every event).",
        ),
        "batch_size": Field(
            ge=1, le=65_536, title="Batch size", description="Windows per step (1 to 65,536)."
        ),
        "steps": Field(
            ge=1,
            le=10_000_000,
            title="Steps",
            description="Optimizer steps (1 to 10,000,000). A few hundred on CPU take a minute.",
        ),
        "lr": Field(
            gt=0, le=1, title="Learning rate", description="AdamW learning rate (> 0, at most 1)."
        ),
        "weight_decay": Field(
            ge=0, le=1, title="Weight decay", description="AdamW weight decay (0 to 1)."
        ),
        "device": (
            Literal["auto", "cpu", "cuda"],
            Field(
                title="Device",
                description="Where to train: auto = the GPU when the worker has one, else CPU.",
            ),
        ),
        "log_every": Field(
            ge=1,
            title="Log every (steps)",
            description="One loss-curve point (the mean loss) per this many steps (>= 1).",
        ),
        "num_threads": Field(
            ge=0,
            le=256,
            title="CPU threads",
            description="torch CPU threads while training (0 = torch's default). 1 is fastest "
            "for this small model on shared cores.",
        ),
        "window_s": Field(
            gt=0,
            title="Window (seconds)",
            description="Clock-time windows: the events of the last this many seconds, at most "
            "Window of them (so windows vary in length). Empty: always the last Window events.",
        ),
        "d_model": Field(
            ge=1,
            le=4096,
            title="Model width",
            description="Width of the transformer (1 to 4,096; a multiple of Heads).",
        ),
        "n_layers": Field(ge=1, le=64, title="Layers", description="Transformer blocks (1 to 64)."),
        "n_heads": Field(ge=1, le=64, title="Heads", description="Attention heads (1 to 64)."),
        "ff_mult": Field(
            ge=1,
            le=16,
            title="Feed-forward width",
            description="Feed-forward width as a multiple of the model width (1 to 16).",
        ),
        "optimizations": (
            str | tuple[str, ...],
            Field(
                title="GPU optimizations",
                description="The optimization ladder's rungs to train with: auto = those the "
                "latest recorded ladder result proved equivalent on this kind of device and that "
                "run here; none = plain eager float32; or a list of rung names (compile, bf16, "
                "device_metrics, fused_kernel, streams, cudagraph, packing, ...).",
            ),
        ),
    },
)

SIMULATION = Form(
    SimConfig,
    description="Replay of the held-out data: when the model's signal trades, the fill "
    "(at the touch, after a decision latency, paying a fee per fill), the horizons of the "
    "mark-out D * (M[t+h] - P) / P in bps from the fill, and the daily P&L's horizon.",
    fields={
        "signal_horizon": Field(
            ge=0,
            title="Signal horizon (label index)",
            description="Which prediction is the trading signal: 0 = the first of the label "
            "horizons, 1 = the second, ...",
        ),
        "trade_quantile": Field(
            ge=0,
            lt=1,
            title="Trade quantile",
            description="Trade when |signal| exceeds this quantile of its training values "
            "(0 to <1; 0.95 = the top 5%). The baseline trades at the same rate.",
        ),
        "markout_horizons_s": (
            tuple[Annotated[float, Field(gt=0)], ...],
            Field(
                min_length=1,
                title="Mark-out horizons (seconds)",
                description="Clock-time mark-out horizons in seconds (> 0).",
            ),
        ),
        "markout_horizons_events": (
            tuple[Events, ...],
            Field(
                min_length=1,
                title="Mark-out horizons (events)",
                description="Event-time mark-out horizons in events (integers >= 1).",
            ),
        ),
        "min_gap_events": Field(
            ge=1,
            title="Minimum gap (events)",
            description="A new trade needs at least this many events since the last one (>= 1).",
        ),
        "latency_s": Field(
            ge=0,
            title="Latency (seconds)",
            description="Decision-to-fill delay in seconds (>= 0): the order fills at the "
            "touch of the book in force this long after the signal. 0 = at once.",
        ),
        "latency_events": Field(
            ge=0,
            title="Latency (events)",
            description="Decision-to-fill delay in order-book events (integer >= 0): the fill "
            "is at least this many events after the signal. With a latency in seconds too, "
            "the later of the two wins.",
        ),
        "fee_bps": Field(
            ge=-10,
            le=100,
            title="Fee (bps)",
            description="Fee per fill in basis points of the fill price (-10 to 100); "
            "negative = a rebate. Net mark-outs and the daily P&L subtract it.",
        ),
        "pnl_horizon": Field(
            title="P&L horizon",
            description="Mark-out horizon whose net mark-outs sum to the daily P&L, spelled "
            "as a key of the horizons above ('60s' for 60 seconds, '100ev' for 100 events); "
            "empty = the last clock horizon.",
        ),
    },
)

FeatureForm = Annotated[FeatureParams, FEATURES]
TrainForm = Annotated[TrainConfig, TRAIN]
SimForm = Annotated[SimConfig, SIMULATION]


# The per-product override: only the fields that keep the feature columns (one model
# reads every product, so its inputs and labels must be the same everywhere).
OVERRIDABLE = ("ofi_window",)


class ProductOverride(BaseModel):
    """Feature parameters of one product that differ from the run's. Empty fields keep
    the run's value."""

    model_config = ConfigDict(extra="forbid")

    ofi_window: Annotated[
        int | None,
        Field(
            default=None,
            ge=1,
            title=FEATURES.field("ofi_window")[1].title,
            description="This product's OFI window in events (>= 1); empty: the run's.",
        ),
    ]

    @model_validator(mode="before")
    @classmethod
    def _fixed(cls, values: Any) -> Any:
        if isinstance(values, Mapping):
            fixed = sorted(set(values) & (set(FEATURES.names) - set(OVERRIDABLE)))
            if fixed:
                raise ValueError(
                    f"{', '.join(fixed)} cannot differ per product: it changes the feature "
                    f"columns, and one model reads every product; a product may override "
                    f"{', '.join(OVERRIDABLE)}"
                )
        return values


def _given(override: ProductOverride) -> dict[str, Any]:
    return override.model_dump(exclude_none=True)


# At run time an override is the plain dict of the fields it sets ({"ofi_window": 20}):
# what the planner merges into the run's parameters, and what parameter hashes are of.
FeatureOverride = Annotated[
    ProductOverride,
    AfterValidator(_given),
    PlainSerializer(lambda given: given, return_type=dict[str, int]),
]

ProductFeatures = Annotated[
    dict[str, FeatureOverride],
    Field(
        title="Per-product features",
        description="Feature parameters that differ for some products, by product: "
        '{"SYNA": {"ofi_window": 20}}. Only the OFI window may differ (the other fields '
        "change the model's columns). Empty: every product uses the run's features.",
    ),
]
# The research run's validation unless told otherwise: walk-forward, an expanding window,
# one test date a fold, the last two folds. A default 4-day run tests the last 2 dates, as
# the single 0.3 held-out share did, each on a model trained on every date before it.
# (WalkForward's own defaults are that single split: what an older run's holdout_fraction
# meant, see holdout_into_validation.)
WALK_FORWARD = WalkForward(folds=2, test_dates=1)
MAX_DATES = 10_000  # the most trading days a synthetic run may have (data.n_dates)

VALIDATION = Form(
    WalkForward,
    description="Walk-forward validation: the dates are split into folds, each a test "
    "window of whole dates and the dates before it to train on. One model is trained per "
    "fold and replays only its own test window; the mark-outs of all test windows (which "
    "never overlap) are pooled. Counts are of trading days in the data. One date of data: "
    "one fold, the end of the day held out (the held-out share).",
    preset=WALK_FORWARD,
    fields={
        "folds": (
            Annotated[int, Field(ge=0, le=MAX_DATES)] | None,
            Field(
                title="Folds",
                description="Test windows, the most recent that fit (0 to 10,000); a run "
                "whose dates fit fewer is refused before it starts. 0 or empty: every window "
                "that fits, so a new date adds a fold. One date of data always makes one fold.",
            ),
        ),
        "test_dates": (
            Annotated[int, Field(ge=1, le=MAX_DATES)] | None,
            Field(
                title="Test dates per fold",
                description="Trading days in each fold's test window, also the step from one "
                "fold to the next (1 to 10,000). Empty: one fold holding out the last "
                "held-out share of the dates (the single split; Folds must be 1).",
            ),
        ),
        "train_dates": Field(
            ge=0,
            le=MAX_DATES,
            title="Training dates",
            description="0: an expanding window, each fold trains on every date before its "
            "test window (and embargo); n > 0: a sliding window of the n dates before it "
            "(0 to 10,000).",
        ),
        "min_train_dates": Field(
            ge=1,
            le=MAX_DATES,
            title="Minimum training dates",
            description="Trading days the first fold trains on (1 to 10,000): the first test "
            "date is this (or Training dates, if larger) plus the embargo after the first date.",
        ),
        "embargo_dates": Field(
            ge=0,
            le=MAX_DATES,
            title="Embargo (dates)",
            description="Trading days between a fold's training dates and its test window "
            "that its model does not train on (0 to 10,000): against features and labels "
            "whose dependence lasts days. Earlier folds still test them.",
        ),
        "holdout_fraction": Field(
            gt=0,
            lt=1,
            title="Held-out share",
            description="Share held out (0 to 1, exclusive). One date of data: the end of "
            "each day from row (1 - share) x rows on is the test part, the rows before it "
            "train (labels reaching the cut purged). Several dates with Test dates empty: "
            "the last share of the dates.",
        ),
    },
)

ValidationForm = Annotated[WalkForward, VALIDATION]


def holdout_into_validation(values: Any) -> Any:
    """A form from before walk-forward folds, with a top-level `holdout_fraction`, as the
    form it means now (a before-validator of the models that carry `validation`).

    Alone, it is the single split it always made: WalkForward's own defaults with that
    share (folds=1, test_dates=None), so an old resolved_params.json or recipe says how
    its model was trained. Beside a `validation`, it is that validation's held-out share
    (the two must agree when both name one)."""
    if not isinstance(values, Mapping) or "holdout_fraction" not in values:
        return values
    values = dict(values)
    share = values.pop("holdout_fraction")
    given = values.get("validation")
    if given is None:
        values["validation"] = {**dataclasses.asdict(WalkForward()), "holdout_fraction": share}
        return values
    if isinstance(given, WalkForward):
        given = dataclasses.asdict(given)
    if isinstance(given, Mapping):
        if "holdout_fraction" in given and given["holdout_fraction"] != share:
            raise ValueError(
                f"holdout_fraction={share!r} and validation.holdout_fraction="
                f"{given['holdout_fraction']!r} disagree: give validation.holdout_fraction only"
            )
        values["validation"] = {**given, "holdout_fraction": share}
    return values
