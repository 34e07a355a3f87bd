"""Which of the ladder's optimizations a training run may apply, and on what evidence.

A ladder result (run_ladder's JSON) proves, for one kind of device, that its rungs keep
the answer: rung k trains with the switches of rungs 1..k and is judged against the
baseline under its precision's tolerance. The proven combination is the switch set of the
highest rung such that it and every rung below it that ran were equivalent (a failed or
skipped rung's switch is not in the later rungs' sets, so it is not proven either).

`auto` applies that combination, less what this machine cannot run, from the latest
recorded result for this device class: the results committed with the code
(proven.json, written from bench/results by `python -m quantloop.profiling.proof`) and any
ladder run of the workspace (`quantloop ladder` writes <home>/ladder/ladder.json). With no
result for this device class (a CPU, here), `auto` applies nothing: the plain loop.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from quantloop.profiling.packing import MIN_HEAD_DIM
from quantloop.profiling.rungs import BY_SWITCH, missing_requirements, runnable, skip_reason
from quantloop.tasks.research.train_config import OPTIMIZATIONS

PROVEN_PATH = Path(__file__).with_name("proven.json")  # the committed results, condensed


def device_class(device: torch.device) -> str:
    """ "cpu", or "cuda/<GPU name>": what a ladder result speaks for."""
    if device.type != "cuda":
        return device.type
    return f"cuda/{torch.cuda.get_device_name(device)}"


@dataclass(kw_only=True, slots=True, frozen=True)
class Proof:
    """What one ladder result proved, and where it came from."""

    device_class: str
    source: str  # the result's file
    commit: str  # the code the ladder ran (the result's own "commit")
    date: str  # when it ran (ISO 8601)
    torch: str
    proven: tuple[str, ...]  # the switches of the proven combination, in rung order
    top_rung: str  # the rung whose switch set that is
    top_samples_per_s: float | None  # its throughput on the ladder's workload
    compile_backend: str

    def to_dict(self) -> dict:
        return {**asdict(self), "proven": list(self.proven)}


def proof_from_result(result: dict, source: str) -> Proof:
    """The proven combination of a ladder result (see the module's docstring)."""
    cls = result.get("device_class") or (
        "cpu" if result["device"] == "cpu" else f"cuda/{result['gpu']}"
    )
    top = None
    for row in sorted(result["rungs"], key=lambda r: r["number"]):
        if row.get("skipped"):
            continue
        if not row.get("equivalent"):
            break
        top = row
    proven = () if top is None else tuple(n for n, on in top["switches"].items() if on)
    return Proof(
        device_class=cls,
        source=source,
        commit=str(result.get("commit", "")),
        date=str(result.get("date", "")),
        torch=str(result.get("torch", "")),
        proven=tuple(n for n in OPTIMIZATIONS if n in proven),
        top_rung=f"{top['number']}. {top['name']}" if top else "",
        top_samples_per_s=top.get("samples_per_s") if top else None,
        compile_backend=result.get("config", {}).get("compile_backend", "inductor"),
    )


def recorded_proofs(extra: Sequence[str | os.PathLike] = ()) -> list[Proof]:
    """The committed proofs, and those of the ladder results at `extra` that exist."""
    proofs = [Proof(**{**p, "proven": tuple(p["proven"])}) for p in _read(PROVEN_PATH)]
    for path in extra:
        if os.path.exists(path):
            with open(path) as f:
                proofs.append(proof_from_result(json.load(f), os.fspath(path)))
    return proofs


def _read(path: Path) -> list[dict]:
    return json.loads(path.read_text()) if path.exists() else []


@dataclass(kw_only=True, slots=True, frozen=True)
class Plan:
    """The optimizations one training run applies, and why."""

    requested: str | tuple[str, ...]  # TrainConfig.optimizations as given
    rungs: tuple[str, ...]  # what it applies, in rung order
    proof: Proof | None  # the result `auto` relied on (or that covers an explicit list)
    dropped: dict[str, str] = field(default_factory=dict)  # requested but not applied: why
    unproven: tuple[str, ...] = ()  # explicitly requested, not in the proof's combination

    @property
    def compile_backend(self) -> str:
        """Inductor, unless `auto` relied on a result compiled with another backend (the CPU
        preset's aot_eager): apply what was proven."""
        if self.proof is not None and self.requested == "auto":
            return self.proof.compile_backend
        return "inductor"

    def record(self) -> dict:
        """What MLflow keeps about the plan (params of the train run)."""
        out = {
            "rungs": ",".join(self.rungs) or "none",
            "optimizations": self.requested
            if isinstance(self.requested, str)
            else ",".join(self.requested),
        }
        if self.dropped:
            out["rungs_dropped"] = "; ".join(f"{k}: {v}" for k, v in self.dropped.items())
        if self.unproven:
            out["rungs_unproven"] = ",".join(self.unproven)
        return out


def latest_proof(cls: str, extra: Sequence[str | os.PathLike] = ()) -> Proof | None:
    """The most recent recorded proof for device class `cls`."""
    mine = [p for p in recorded_proofs(extra) if p.device_class == cls]
    return max(mine, key=lambda p: p.date) if mine else None


def check_requirements(wanted: tuple[str, ...]) -> None:
    """ValueError if an explicitly requested optimization lacks a switch it requires:
    the only way a list of known names can be wrong, whatever the machine."""
    missing = missing_requirements(wanted)
    if missing:
        raise ValueError(
            "train.optimizations: "
            + "; ".join(f"{k} needs {', '.join(v)}" for k, v in missing.items())
        )


def plan_rungs(
    requested: str | tuple[str, ...],
    device: torch.device,
    extra: Sequence[str | os.PathLike] = (),
    *,
    head_dim: int | None = None,
) -> Plan:
    """Resolve TrainConfig.optimizations for `device`.

    "none": nothing. "auto": the latest proof's combination that runs here (requirements
    kept: a switch whose requirement cannot run is dropped with it), less the rungs whose
    `not_auto` says why a research run should not pay for them. A list: those names;
    ValueError if one lacks a switch it requires; those this machine cannot run are
    dropped with the reason, and names outside the proof's combination are reported as
    unproven (applied: the list is the user's choice). head_dim (the model's d_model /
    n_heads): below MIN_HEAD_DIM, FlexAttention and the rungs that need it are dropped too.
    """
    proof = latest_proof(device_class(device), extra)
    if requested == "none":
        return Plan(requested=requested, rungs=(), proof=None)
    here = runnable(device)
    if requested == "auto":
        wanted = proof.proven if proof is not None else ()
    else:
        wanted = tuple(requested)
        check_requirements(wanted)
    dropped = {
        n: (skip_reason(BY_SWITCH[n], device, here) or "").removeprefix("skipped: ")
        for n in wanted
        if n not in here
    }
    if head_dim is not None and head_dim < MIN_HEAD_DIM and "flex_attention" in wanted:
        # the model's shape, not the machine: the rungs that need it go with it below
        dropped.setdefault(
            "flex_attention",
            f"head dimension {head_dim} (d_model / n_heads) is below FlexAttention's "
            f"{MIN_HEAD_DIM}",
        )
    if requested == "auto":  # proven, but not worth it for a research run: only by name
        dropped |= {n: BY_SWITCH[n].not_auto for n in wanted if BY_SWITCH[n].not_auto
                    and n not in dropped}  # fmt: skip
    keep = [n for n in wanted if n not in dropped]
    while lacking := missing_requirements(keep):  # a requirement dropped drops its users
        for n, needs in lacking.items():
            dropped[n] = f"needs {', '.join(needs)}, which is dropped"
            keep.remove(n)
    unproven = ()
    if requested != "auto":
        unproven = tuple(n for n in keep if proof is None or n not in proof.proven)
    return Plan(
        requested=requested,
        rungs=tuple(n for n in OPTIMIZATIONS if n in keep),
        proof=proof if (requested == "auto" or keep) else None,
        dropped=dropped,
        unproven=unproven,
    )


def write_proven(results: Sequence[str], path: Path = PROVEN_PATH) -> list[dict]:
    """proven.json from ladder result files (paths as given are the proofs' sources)."""
    proofs = []
    for source in results:
        with open(source) as f:
            proofs.append(proof_from_result(json.load(f), source).to_dict())
    path.write_text(json.dumps(proofs, indent=1) + "\n")
    return proofs


if __name__ == "__main__":  # python -m quantloop.profiling.proof bench/results/ladder-h200.json
    print(json.dumps(write_proven(sys.argv[1:]), indent=1))
