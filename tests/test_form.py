"""The run form: what the Prefect UI renders from the flows' parameter schemas.

Every field says what it is (description, unit, bounds), groups have human titles,
closed choices are enums, and the workspace's site, tracking and catalog are block
references (the UI shows a picker of saved blocks for a definition that carries a
`block_type_slug`). The form's words change no key: parameter hashes, node keys and
model keys are those of the bare dataclasses.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
from prefect.utilities.callables import parameter_schema
from pydantic import TypeAdapter, ValidationError

from quantloop.blocks import DataCatalog, MlflowTracking, Site
from quantloop.flows.features import features
from quantloop.flows.research import ResearchParams, research
from quantloop.flows.simulate import simulate
from quantloop.flows.train import model_key, train
from quantloop.tasks.engine import code_fingerprint, sha256_json
from quantloop.tasks.research.features import FeatureParams, feature_set
from quantloop.tasks.research.folds import WalkForward
from quantloop.tasks.research.form import FEATURES, OVERRIDABLE, ProductOverride, TrainForm
from quantloop.tasks.research.planning import feature_kind
from quantloop.tasks.research.stage import StageParams
from quantloop.tasks.research.train_config import TrainConfig

FLOWS = {"research": research, "features": features, "train": train, "simulate": simulate}


def schema_of(flow) -> dict:
    return parameter_schema(flow).model_dump()


@pytest.mark.parametrize("name", sorted(FLOWS))
def test_every_field_of_every_parameter_model_is_described(name):
    schema = schema_of(FLOWS[name])
    undescribed = [
        f"{model}.{field}"
        for model, definition in schema["definitions"].items()
        for field, spec in definition.get("properties", {}).items()
        if len(spec.get("description", "")) < 15
    ]
    undescribed += [p for p, spec in schema["properties"].items() if not spec.get("description")]
    assert undescribed == []


def test_groups_have_human_titles_and_fields_show_their_defaults():
    schema = schema_of(research)
    params = schema["definitions"]["ResearchParams"]["properties"]
    # pydantic leaves out a title equal to its model's name (Workspace's); the UI shows it.
    titles = {name: spec.get("title", name.title()) for name, spec in params.items()}
    assert titles == {
        "workspace": "Workspace",
        "data": "Data",
        "features": "Features",
        "product_features": "Per-product features",
        "train": "Training",
        "sweep": "Sweep of training settings",
        "simulation": "Simulation",
        "validation": "Validation",
        "shard_size": "Shard size (nodes)",
        "verify_hits": "Verify cached outputs",
    }
    # Plain defaults, not default factories: the UI shows a default only when there is one.
    assert all("default" in spec for spec in params.values())
    assert params["train"]["default"]["steps"] == 300
    synthetic = schema["definitions"]["DataSource"]["properties"]["synthetic"]
    assert synthetic["title"] == "Synthetic generator"
    assert synthetic["default"]["events_per_day"] == 20_000
    tick = schema["definitions"]["SyntheticConfig"]["properties"]["tick_size"]
    assert "$0.0001" in tick["description"] and tick["minimum"] == 1


def test_closed_choices_are_enums_and_bounds_are_in_the_schema():
    definitions = schema_of(research)["definitions"]
    train_fields = definitions["TrainConfig"]["properties"]
    assert train_fields["device"]["enum"] == ["auto", "cpu", "cuda"]
    assert train_fields["steps"]["minimum"] == 1
    assert train_fields["lr"]["exclusiveMinimum"] == 0
    sim = definitions["SimConfig"]["properties"]
    assert (sim["trade_quantile"]["minimum"], sim["trade_quantile"]["exclusiveMaximum"]) == (0, 1)
    assert definitions["FeatureParams"]["properties"]["return_lags"]["items"]["minimum"] == 1


def test_site_tracking_and_catalog_are_block_pickers_or_names():
    definitions = schema_of(research)["definitions"]
    workspace = definitions["Workspace"]["properties"]
    for field, block in (("site", Site), ("tracking", MlflowTracking),
                         ("data_catalog", DataCatalog)):  # fmt: skip
        variants = workspace[field]["anyOf"]
        refs = [v["$ref"].rsplit("/", 1)[-1] for v in variants if "$ref" in v]
        assert refs == [block.__name__], field
        assert definitions[refs[0]]["block_type_slug"] == block.get_block_type_slug()
        # no None tab (the form showed 'Property is type "None"' under it): an empty
        # picker is the default, None
        assert {"type": "string", "title": "By name"} in variants and len(variants) == 2
        assert "default" not in workspace[field]  # the form leaves it out: None


def test_the_per_product_override_is_typed_and_offers_what_may_differ():
    definitions = schema_of(research)["definitions"]
    overrides = definitions["ResearchParams"]["properties"]["product_features"]
    assert overrides["additionalProperties"]["$ref"].endswith("/ProductOverride")
    # Each field it offers is a feature parameter, bounded as the run's own field is, and
    # leaves the model's columns as they are; every other feature parameter changes them.
    offered = set(ProductOverride.model_fields)
    assert offered == set(OVERRIDABLE) <= set(FEATURES.names)
    base = FeatureParams()
    for name in FEATURES.names:
        changed = FEATURES.model.model_validate({name: _another(getattr(base, name))})
        same_columns = feature_set(dataclasses.replace(base, **{
            n: getattr(changed, n) for n in FEATURES.names})) == feature_set(base)  # fmt: skip
        assert same_columns == (name in offered), name
    bounds = definitions["ProductOverride"]["properties"]["ofi_window"]
    assert bounds["minimum"] == definitions["FeatureParams"]["properties"]["ofi_window"]["minimum"]


def _another(value):
    return tuple(v + 1 for v in value) if isinstance(value, tuple) else value + 1


def test_form_errors_name_the_field_and_instances_pass_through():
    adapter = TypeAdapter(TrainForm)
    with pytest.raises(ValidationError) as err:
        adapter.validate_python({"steps": 0, "device": "gpu", "stepz": 1})
    assert {e["loc"] for e in err.value.errors()} == {("steps",), ("device",), ("stepz",)}
    config = TrainConfig(steps=10, device="cpu")
    assert adapter.validate_python(config) == config
    assert adapter.validate_python({"steps": "10", "device": "cpu"}) == config
    assert adapter.dump_python(config, mode="json") == {
        k: v for k, v in dataclasses.asdict(config).items()
    }


def test_the_form_changes_no_hash_or_key():
    """The words live in tasks/research/form.py, so what decides a hash is the same with and
    without the form: the run hash is the hash of the plain dataclasses' values, the
    feature kind's code fingerprint is its module's, and node parameters are the
    dataclass's canonical form."""
    values = {"product_features": {"SYNB": {"ofi_window": 20}}, "train": {"steps": 10},
              "data": {"products": ["SYNA", "SYNB"]}}  # fmt: skip
    params = ResearchParams.model_validate(values)
    # an empty sweep is not in the digest: a run keeps the one it had before sweeps
    plain = params.model_dump(mode="json", exclude={"workspace", "sweep"})
    assert plain["train"] == json.loads(json.dumps(dataclasses.asdict(TrainConfig(steps=10))))
    assert plain["features"] == FeatureParams().canonical()
    assert params.hash() == sha256_json(plain)
    assert isinstance(params.train, TrainConfig) and isinstance(params.features, FeatureParams)
    module = sys.modules[FeatureParams.__module__]
    assert feature_kind().code == code_fingerprint(module)
    window = {"train": ["2026-03-02"], "holdout_fraction": None}
    assert model_key(params.train, ["a", "b"], window) == model_key(TrainConfig(steps=10),
                                                                  ["a", "b"], window)  # fmt: skip
    assert params.validation == WalkForward(folds=2, test_dates=1)
    assert plain["validation"] == dataclasses.asdict(params.validation)


def test_validation_is_a_form_section_defaulting_to_two_walk_forward_folds():
    definitions = schema_of(research)["definitions"]
    section = definitions["ResearchParams"]["properties"]["validation"]
    assert section["title"] == "Validation" and section["default"] == {
        "folds": 2, "test_dates": 1, "train_dates": 0, "min_train_dates": 1,
        "embargo_dates": 0, "holdout_fraction": 0.3,
    }  # fmt: skip
    fields = definitions["WalkForward"]["properties"]
    assert {n: f["title"] for n, f in fields.items()} == {
        "folds": "Folds", "test_dates": "Test dates per fold", "train_dates": "Training dates",
        "min_train_dates": "Minimum training dates", "embargo_dates": "Embargo (dates)",
        "holdout_fraction": "Held-out share",
    }  # fmt: skip
    # defaults of the fields are the research run's too: a partial section keeps them
    assert fields["folds"]["default"] == 2 and fields["test_dates"]["default"] == 1
    assert (fields["folds"]["type"], fields["folds"]["minimum"], fields["folds"]["maximum"]) == (
        "integer", 0, 10_000)  # fmt: skip
    assert fields["min_train_dates"]["minimum"] == 1 and fields["embargo_dates"]["minimum"] == 0
    assert (fields["holdout_fraction"]["exclusiveMinimum"],
            fields["holdout_fraction"]["exclusiveMaximum"]) == (0, 1)  # fmt: skip
    partial = ResearchParams.model_validate({"validation": {"embargo_dates": 1}}).validation
    assert partial == WalkForward(folds=2, test_dates=1, embargo_dates=1)
    assert ResearchParams.model_validate({"validation": {"folds": 0}}).validation.folds is None
    with pytest.raises(ValidationError, match=r"validation\.test_dates\n.*greater than or"):
        ResearchParams.model_validate({"validation": {"test_dates": 0}})
    with pytest.raises(ValidationError, match="test_dates=None .* makes one fold, but folds=2"):
        ResearchParams.model_validate({"validation": {"test_dates": None}})


@pytest.mark.parametrize("model", [ResearchParams, StageParams])
def test_an_old_top_level_holdout_fraction_is_the_single_split_it_made(model):
    """resolved_params.json, recipes and params files from before the folds: alone, the
    holdout_fraction is WalkForward's own default split (split_train_test's) with that
    share; beside a validation, that validation's share."""
    old = model.model_validate({"holdout_fraction": 0.25})
    assert old.validation == WalkForward(holdout_fraction=0.25)  # folds=1, test_dates=None
    assert "holdout_fraction" not in old.model_dump()
    both = model.model_validate({"holdout_fraction": 0.4, "validation": {"folds": 3}})
    assert both.validation == WalkForward(folds=3, test_dates=1, holdout_fraction=0.4)
    with pytest.raises(ValidationError, match="disagree"):
        model.model_validate({"holdout_fraction": 0.4, "validation": {"holdout_fraction": 0.2}})
    with pytest.raises(ValidationError, match="holdout_fraction"):
        model.model_validate({"holdout_fraction": 1.5})


@pytest.mark.slow
@pytest.mark.server
def test_a_picked_block_reaches_the_flow_as_that_block(prefect_api, tmp_path):
    """What the UI sends for a picked block, {"$ref": {"block_document_id": ...}}, is
    loaded by Prefect before the flow's parameters are validated; a name still works."""
    site = Site(name="picked", storage_root=str(tmp_path / "store"), n_workers=3)
    block_id = site.save("picked-site", overwrite=True)
    ref = {"$ref": {"block_document_id": str(block_id)}}
    params = research.validate_parameters({"params": {"workspace": {"site": ref}}})["params"]
    resolved = params.workspace.resolve_site()
    assert (resolved.name, resolved.n_workers, resolved.root) == (
        "picked",
        3,
        str(tmp_path / "store"),
    )
    by_name = ResearchParams.model_validate({"workspace": {"site": "picked-site"}})
    assert by_name.workspace.resolve_site().root == str(tmp_path / "store")


def form_properties(schema: dict):
    """(definition, field, spec) of every field the run form renders: a saved block's own
    fields are not (the form offers a picker of saved blocks)."""
    for model, definition in schema["definitions"].items():
        if "block_type_slug" in definition:
            continue
        for name, spec in definition.get("properties", {}).items():
            yield model, name, spec


def test_no_form_field_renders_as_type_none():
    """Prefect's form renders each branch of an `anyOf` as a tab and a `{"type": "null"}`
    branch as the text 'Property is type "None"', selected under every optional field
    whose default is None. An optional field is its one type with a default: left
    empty, the model's default (None) applies; JSON may still give null."""
    schema = schema_of(research)
    with_null = [f"{model}.{name}" for model, name, spec in form_properties(schema)
                 if spec.get("type") == "null"
                 or any(b.get("type") == "null" for b in spec.get("anyOf", []))]  # fmt: skip
    assert with_null == []
    # what the form leaves empty still reads as None, and null from JSON too
    values = {"data": {"lobster_dir": None}, "train": {"window_s": None},
              "workspace": {"site": None, "tracking_uri": None},
              "product_features": {"SYNA": {"ofi_window": None}}}  # fmt: skip
    params = ResearchParams.model_validate(values)
    assert (params.data.lobster_dir, params.train.window_s, params.workspace.site) == (
        None, None, None)  # fmt: skip
    fields = schema["definitions"]["DataSource"]["properties"]
    assert fields["lobster_dir"]["type"] == "string"
    assert fields["lobster_dir"]["title"] == "LOBSTER folder"
    # What Prefect checks when a deployment's run is created (a 409 otherwise): the form's
    # values, None defaults left out, and null given for an optional field of one type.
    from prefect.utilities.schema_tools.validation import validate

    sections = schema["definitions"]["ResearchParams"]["properties"]
    form = {"params": {name: spec["default"] for name, spec in sections.items()}}
    assert "null" not in json.dumps(form)  # no null default for the form to send
    given = {"params": {"data": {"lobster_dir": None}, "train": {"window_s": None},
                        "workspace": {"tracking_uri": None}}}  # fmt: skip
    for values in (form, given, {"params": {}}):
        assert validate(values, schema, raise_on_error=True) == []


def test_form_titles_are_written_not_generated_from_field_names():
    """A title pydantic makes from a field's name ('Tick Size', 'Start Price') is a
    machine's: every field of the form has one written for it."""
    schema = schema_of(research)
    generated = [
        f"{model}.{name}"
        for model, name, spec in form_properties(schema)
        if "_" in name and spec.get("title") == name.replace("_", " ").title()
    ]
    assert generated == []
    synthetic = schema["definitions"]["SyntheticConfig"]["properties"]
    assert synthetic["tick_size"]["title"] == "Tick size ($0.0001 units)"
    assert synthetic["start_price"]["title"] == "Start price ($0.0001 units)"


def test_placement_is_a_choice_of_the_policies():
    """The placement policies of tasks/engine/placement.py, `node` and `single:<site>`, as
    a choice and, for `single`, the site's name; the older text form still reads."""
    from quantloop.tasks.runtime.workspace import Workspace

    fields = schema_of(research)["definitions"]["Workspace"]["properties"]
    assert fields["placement"]["enum"] == ["node", "single"]
    assert fields["placement"]["title"] == "Placement"
    assert fields["single_site"]["type"] == "string"
    assert Workspace().placement == "node"
    assert Workspace(placement="single", single_site="A").placement == "single:A"
    assert Workspace.model_validate({"placement": "single:A"}).single_site == "A"
    with pytest.raises(ValidationError, match="single_site"):
        Workspace(placement="single")
    with pytest.raises(ValidationError, match="placement"):
        Workspace.model_validate({"placement": "everywhere"})


def deployment_schemas():
    """(deployment, its flow's parameter schema, its parameters with what a run gives
    itself) for every deployment of infra/prefect.yaml."""
    from prefect.flows import load_flow_from_entrypoint

    from quantloop.deploy import PREFECT_YAML, REPO_ROOT, read_deployments
    from quantloop.tasks.research.form import form_schema

    for d in read_deployments(PREFECT_YAML):
        flow = load_flow_from_entrypoint(str(REPO_ROOT / d.entrypoint))
        params = dict(d.parameters)
        if flow.name == "simulate":
            params["model_urls"] = ["s3://bucket/models/x.pt"]  # required; given per run
        if flow.name == "promote":
            params["run"] = "0" * 32  # required; given per run
        # what quantloop/deploy.py creates the deployment with
        raw = parameter_schema(flow).model_dump_for_openapi()
        schema = form_schema(raw)
        # a run (run_deployment, the API) may still give null for an optional parameter
        optional = {p: None for p, spec in raw["properties"].items()
                    if any(b.get("type") == "null" for b in spec.get("anyOf", []))}  # fmt: skip
        yield d.full_name, schema, params, optional


def test_no_deployments_form_field_renders_as_type_none():
    """Every deployment's run form, not only research's: no field offers a null branch
    (the 'Property is type "None"' tab), and Prefect's check of a run's parameters (the
    one it makes when a deployment's run is created) passes the deployment's parameters
    and the form's defaults."""
    from prefect.utilities.schema_tools.validation import validate

    with_null, refused = [], []
    for name, schema, params, optional in deployment_schemas():
        top = [("<flow>", p, spec) for p, spec in schema["properties"].items()]
        with_null += [f"{name}: {model}.{field}"
                      for model, field, spec in [*top, *form_properties(schema)]
                      if spec.get("type") == "null"
                      or any(b.get("type") == "null" for b in spec.get("anyOf", []))]  # fmt: skip
        defaults = {p: spec["default"] for p, spec in schema["properties"].items()
                    if "default" in spec}  # fmt: skip
        for values in (params, {**defaults, **params}, {**params, **optional}):
            errors = validate(values, schema, raise_on_error=False)
            refused += [f"{name}: {e}" for e in errors]
            if "null" in json.dumps(defaults):
                refused.append(f"{name}: a null default for the form to send: {defaults}")
    assert with_null == []
    assert refused == []
