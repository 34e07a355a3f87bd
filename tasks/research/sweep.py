"""A sweep: the research run's training config at several settings, each trained on every
walk-forward fold, replayed on that fold's test window, and the settings ranked on their
pooled out-of-sample mark-outs.

The form (`Sweep`) is a grid (every combination of the listed learning rates, weight
decays, seeds and model shapes) or a list of settings, each a change to the run's
training config. A setting *is* a TrainConfig: its models are keyed by it as any model
is (flows/train.py, flows/sweep.py), so nothing of this module goes into a key, and its
descriptions sit on its fields (a module whose source keys outputs keeps its words in
tasks/research/form.py instead).

Ranking: by the paired difference of the setting's model and the baseline (the same
held-out days, tasks/research/uncertainty.py) at `rank_horizon`, highest first, the settings
with too few trades to test that difference after the others (`rank`). Every
setting is a trial on the same held-out data: the p-values shown are adjusted over the
horizons (Holm) and then over the trials (Sidak), the sweep's settings counted among them.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from quantloop.tasks.research import uncertainty
from quantloop.tasks.research.form import TRAIN
from quantloop.tasks.research.train_config import TrainConfig

# Most settings one sweep may hold: each is a trial (its id goes in one MLflow tag of
# the research run, 17 characters a setting, under MLflow's 8,000), and a typo in a grid
# (a list of 40 where 4 was meant) should fail here, not queue hours of training.
MAX_SETTINGS = 256
SWEPT = ("lr", "weight_decay", "seed")  # the step's settings (a stack trains them together)
SHAPE = ("d_model", "n_layers", "n_heads", "ff_mult")  # the model's shape (one stack each)
# How a setting's label spells the fields (MLflow run names, the ranking table).
SHORT = {"lr": "lr", "weight_decay": "wd", "seed": "seed", "d_model": "d", "n_layers": "L",
         "n_heads": "H", "ff_mult": "ff"}  # fmt: skip


def _each(name: str) -> Any:
    """TrainConfig's bounds on `name` for one value of a sweep's list of them."""
    annotation, info = TRAIN.field(name)
    bounds = {k: getattr(m, k) for m in info.metadata for k in ("gt", "ge", "lt", "le")
              if getattr(m, k, None) is not None}  # fmt: skip
    return Annotated[annotation, Field(**bounds)]


Lr, WeightDecay, Seed = _each("lr"), _each("weight_decay"), _each("seed")
DModel, Layers, Heads, FfMult = (_each(n) for n in SHAPE)


class Shape(BaseModel):
    """A model shape of the sweep; an empty field keeps the run's training value."""

    model_config = ConfigDict(extra="forbid")

    d_model: DModel | None = Field(
        default=None,
        title="Model width",
        description="Width of the transformer (a multiple of Heads).",
    )
    n_layers: Layers | None = Field(default=None, title="Layers", description="Transformer blocks.")
    n_heads: Heads | None = Field(default=None, title="Heads", description="Attention heads.")
    ff_mult: FfMult | None = Field(
        default=None,
        title="Feed-forward width",
        description="Feed-forward width as a multiple of the width.",
    )


class Setting(Shape):
    """One setting of a sweep's list: the training fields it changes; an empty field keeps
    the run's training value."""

    lr: Lr | None = Field(default=None, title="Learning rate", description="AdamW learning rate.")
    weight_decay: WeightDecay | None = Field(
        default=None, title="Weight decay", description="AdamW weight decay."
    )
    seed: Seed | None = Field(
        default=None, title="Seed", description="Random seed of initialization and batch order."
    )


class Sweep(BaseModel):
    """Several settings of the training config, each trained on every fold: a grid (every
    combination of the lists given) or a list of settings. Empty: one model per fold, at
    the training config above."""

    model_config = ConfigDict(extra="forbid")

    lr: list[Lr] = Field(
        default=[],
        title="Learning rates",
        description="AdamW learning rates to try (each > 0, at most 1). Empty: the training "
        "config's.",
    )
    weight_decay: list[WeightDecay] = Field(
        default=[],
        title="Weight decays",
        description="AdamW weight decays to try (each 0 to 1). Empty: the training config's.",
    )
    seed: list[Seed] = Field(
        default=[],
        title="Seeds",
        description="Seeds to try (each >= 0): initialization and batch order. Empty: the "
        "training config's.",
    )
    shapes: list[Shape] = Field(
        default=[],
        title="Model shapes",
        description="Model shapes to try (width, layers, heads, feed-forward width; an empty "
        "field keeps the training config's). Each shape trains as a group of its own.",
    )
    settings: list[Setting] = Field(
        default=[],
        title="Settings (a list instead of a grid)",
        description="An explicit list of settings, each the training fields it changes "
        '([{"lr": 0.001}, {"lr": 0.0003, "seed": 1}]). Give a list or the grid above, not '
        "both.",
    )
    rank_horizon: str = Field(
        default="5s",
        pattern=r"^[0-9]+(\.[0-9]+)?(s|ev)$",
        title="Rank on horizon",
        description="The mark-out horizon the settings are ranked on: each setting's "
        "out-of-sample mark-out minus the baseline's on the same days (paired), all folds "
        "pooled; a horizon of the simulation ('5s', '100ev'). The best is the registered "
        "model, what promote sees.",
    )
    stacked: bool = Field(
        default=True,
        title="Train each shape's models as one",
        description="Train the models of one shape (every setting and fold) together as one "
        "stacked model (profiling/stacked.py: each model keeps its own seed, data, batch "
        "order, learning rate and weight decay; each equals its solo training within the "
        "ladder's tolerances). Off: one after another, each alone, as a research run trains.",
    )
    stack_size: int = Field(
        default=16,
        ge=1,
        le=1024,
        title="Models per stack",
        description="At most this many models train as one stack (1 to 1,024); more of one "
        "shape train as several stacks, one after another. Each model adds its batch to the "
        "step's (16 models at batch 256: 4,096 windows a step) and its activations to the "
        "memory.",
    )
    check_alone: bool = Field(
        default=True,
        title="Check the chosen model against its solo training",
        description="With stacked training: train the registered model once more alone, as "
        "the train stage trains it (the plain loop on a CPU), and compare its loss curve and "
        "held-out predictions under the ladder's tolerances; the result is on its model "
        "version, and promote's ladder gate needs it. Costs one model's training, once.",
    )

    @model_validator(mode="after")
    def _grid_or_list(self) -> Sweep:
        grid = [n for n in ("lr", "weight_decay", "seed", "shapes") if getattr(self, n)]
        if grid and self.settings:
            raise ValueError(f"give a grid ({', '.join(grid)}) or a list (settings), not both")
        count = (
            len(self.settings)
            if self.settings
            else math.prod(
                max(len(getattr(self, n)), 1) for n in ("lr", "weight_decay", "seed", "shapes")
            )
        )
        if count > MAX_SETTINGS:
            raise ValueError(f"the sweep has {count:,} settings; at most {MAX_SETTINGS}")
        return self

    @property
    def active(self) -> bool:
        """Whether there is a sweep (something to try besides the training config)."""
        return bool(self.lr or self.weight_decay or self.seed or self.shapes or self.settings)

    def expand(self, base: TrainConfig) -> list[TrainConfig]:
        """The settings as training configs, in the form's order (the grid's last list
        varies fastest). ValueError naming the setting that is not a valid config, or the
        settings that are the same config twice."""
        if self.settings:
            changes = [s.model_dump(exclude_none=True) for s in self.settings]
        else:
            axes = [[{name: v} for v in getattr(self, name)] or [{}] for name in SWEPT]
            shapes = [s.model_dump(exclude_none=True) for s in self.shapes] or [{}]
            changes = [{k: v for part in combo for k, v in part.items()}
                       for combo in itertools.product(shapes, *axes)]  # fmt: skip
        configs = []
        for i, change in enumerate(changes):
            try:
                configs.append(dataclasses.replace(base, **change))
            except ValueError as exc:
                raise ValueError(f"sweep setting {i} ({change}): {exc}") from exc
        seen: dict[TrainConfig, int] = {}
        for i, cfg in enumerate(configs):
            if cfg in seen:
                raise ValueError(f"sweep settings {seen[cfg]} and {i} are the same training "
                                 "config: each setting must differ")  # fmt: skip
            seen[cfg] = i
        return configs


def varied(configs: Sequence[TrainConfig]) -> list[str]:
    """The swept fields that differ between the configs, in SHORT's order."""
    return [n for n in SHORT if len({getattr(c, n) for c in configs}) > 1]


def label(cfg: TrainConfig, fields: Sequence[str]) -> str:
    """'lr=0.001 wd=0.0001 seed=1': a setting by the fields that vary in its sweep."""
    return " ".join(f"{SHORT[n]}={getattr(cfg, n):g}" for n in fields) or "base"


def rank(rows: Sequence[dict], horizon: str) -> list[dict]:
    """The settings' rows (each with `paired`: its paired_difference by horizon) best
    first: the highest paired mean at `horizon` among the settings whose difference was
    tested (it has a standard error), then those with a mean but too few trades to test
    it, then those with no trade there. Each row gets its `rank` (1 = best) and the
    `horizon` figures lifted out.

    An untested mean is no evidence: on noise (bench/selection.py) the setting with the
    highest mean was often one with a few dozen trades and no standard error, which would
    have been the registered model and the summary's first line, over settings whose
    difference could be judged."""

    def at(row: dict) -> dict:
        return row["paired"].get(horizon) or {}

    def key(item: tuple[int, dict]) -> tuple:
        mean, se = at(item[1]).get("mean_bps"), at(item[1]).get("se_bps")
        mean = math.nan if mean is None else mean
        untested = se is None or not se > 0  # NaN: insufficient data
        return (math.isnan(mean), untested, -mean if not math.isnan(mean) else 0.0, item[0])

    ranked = []
    for place, (_, row) in enumerate(sorted(enumerate(rows), key=key), 1):
        d = at(row)
        ranked.append({**row, "rank": place, "horizon": horizon,
                       "diff_bps": d.get("mean_bps"), "diff_se_bps": d.get("se_bps"),
                       "p_adjusted": d.get("p_adjusted"),
                       "significant": bool(d.get("significant", False))})  # fmt: skip
    return ranked


def held_out(
    earlier: Sequence[dict],
    last: Sequence[dict],
    labels: Sequence[str],
    horizon: str,
    trials: int,
    settings: int,
    alpha: float = 0.05,
    pooled_best: int | None = None,
) -> dict | None:
    """The sweep's pick tested on data the pick did not see: the best setting by `rank` on
    the folds before the last (`earlier[s]`: setting s's paired_difference there, by
    horizon), and that one setting's paired difference on the last fold (`last[s]`).

    The pooled ranking chooses and reports on the same days, so its best is the largest of
    K draws (bench/results/selection.md); this test of one pre-chosen setting is not. Its
    p-value counts the other configurations tried on these data (`trials` less the sweep's
    `settings`, plus this pick: Sidak after Holm over the horizons), not the K settings,
    which were chosen among on other days. None when a setting has no such split (a
    single fold); `setting` None, with `why`, when no setting had trades enough on the
    earlier folds to be judged there (a pick by the sweep's order would be no choice).
    `same_as_best`: whether the pick is `pooled_best`, the setting the pooled ranking chose."""
    if not earlier or any(not e for e in earlier) or any(not x for x in last):
        return None
    rows = [{"setting": s, "paired": e} for s, e in enumerate(earlier)]
    pick = rank(rows, horizon)[0]
    if not (pick["diff_se_bps"] or 0.0) > 0:  # no setting could be judged there: no choice
        return {"setting": None, "label": None, "horizon": horizon,
                "why": "no setting had trades enough on the folds before the last for a "
                f"standard error at {horizon}"}  # fmt: skip
    s = pick["setting"]
    at = last[s].get(horizon) or {}
    tries = max(trials - settings + 1, 1)
    p = uncertainty.trials_adjusted(at.get("p_holm", math.nan), tries)
    return {"setting": s, "label": labels[s], "horizon": horizon,
            "earlier_diff_bps": pick["diff_bps"], "earlier_diff_se_bps": pick["diff_se_bps"],
            "diff_bps": at.get("mean_bps"), "diff_se_bps": at.get("se_bps"),
            "p_adjusted": p, "trials": tries, "significant": bool(p < alpha),
            "same_as_best": s == pooled_best}  # fmt: skip
