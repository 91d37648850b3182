"""The families table names only choices the decoder implements: every `Literal`-typed
field of each `Family` row (and of its `MoeFamily`) holds one of its Literal's values, and
the Literals agree with the dispatch tables that consume them (layers.NORMS,
layers.BLOCKS, explain's NORM_NAMES). A misspelt choice ("rmsnorm") would otherwise fall
through to a default branch somewhere in layers.py and run a different model."""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import pytest

from kvchat.model.decoder import families, layers
from kvchat.model.decoder.families import FAMILIES, Family, MoeFamily
from kvchat.model.explain.anatomy import NORM_NAMES


def allowed(annotation: Any) -> tuple[Any, ...] | None:
    """The values a `Literal[...]` (or `Literal[...] | None`) annotation admits; None when
    the annotation is no Literal."""
    if get_origin(annotation) is Literal:
        return get_args(annotation)
    if get_origin(annotation) in (Union, types.UnionType):
        rest = [a for a in get_args(annotation) if a is not type(None)]
        if len(rest) == 1 and (values := allowed(rest[0])) is not None:
            return (*values, None)
    return None


def choices(cls: type) -> dict[str, tuple[Any, ...]]:
    """Field name -> allowed values, for each Literal-typed field of a dataclass."""
    hints = get_type_hints(cls)
    return {f.name: values for f in dataclasses.fields(cls)
            if (values := allowed(hints[f.name])) is not None}


def misfits(row: Family | MoeFamily, where: str = "") -> list[str]:
    """One line per Literal-typed field of `row` (its mixture's included) whose value is
    not among the allowed ones."""
    out = [f"{where}{name}: {getattr(row, name)!r} is not one of {values}"
           for name, values in choices(type(row)).items() if getattr(row, name) not in values]
    if isinstance(row, Family) and row.moe is not None:
        out += misfits(row.moe, f"{where}moe.")
    return out


def test_the_choices_are_literal_typed() -> None:
    """The check below covers these fields (it would pass vacuously on `str` fields)."""
    assert set(choices(Family)) == {"norm", "mlp", "block", "parallel_block", "positions",
                                    "qk_norm", "nope", "attention", "fused_qkv", "mixer",
                                    "delta_proj", "recurrent_block"}
    assert set(choices(MoeFamily)) == {"score", "group_score", "shared", "fused_experts",
                                       "sparse_layers"}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_row_holds_allowed_values(name: str) -> None:
    assert misfits(FAMILIES[name]) == []


def test_a_wrong_row_is_reported() -> None:
    bad = dataclasses.replace(
        FAMILIES["mixtral"], norm="rmsnorm", qk_norm="per_head",  # type: ignore[arg-type]
        moe=dataclasses.replace(FAMILIES["mixtral"].moe, sparse_layers="every"),  # type: ignore[arg-type]
    )
    found = misfits(bad)
    assert [line.split(":")[0] for line in found] == ["norm", "qk_norm", "moe.sparse_layers"]
    assert "'rmsnorm' is not one of" in found[0] and "'layer_nobias'" in found[0]
    assert misfits(Family(fused_qkv="Conv1D")) != []  # type: ignore[arg-type]
    assert misfits(Family(qk_norm=None, nope=None)) == []  # None stays allowed where typed so


def test_literals_match_the_dispatch_tables() -> None:
    assert set(get_args(families.NormKind)) == set(layers.NORMS) == set(NORM_NAMES)
    assert set(get_args(families.BlockKind)) == set(layers.BLOCKS)
    assert set(get_args(families.MixerKind)) == set(layers.MIXERS)


def test_every_allowed_value_is_used_by_a_row() -> None:
    """No choice is offered that no family makes (tests/test_families.py runs each row
    against transformers, so an unused value would go untested). A Literal shared by two
    fields (block, parallel_block, and the optional recurrent_block) counts the values of
    all of them."""
    rows: list[Family | MoeFamily] = [*FAMILIES.values()]
    rows += [f.moe for f in FAMILIES.values() if f.moe is not None]
    used: dict[tuple[Any, ...], set[Any]] = {}
    for cls in (Family, MoeFamily):
        for name, values in choices(cls).items():
            literal = tuple(v for v in values if v is not None)  # optional or not
            used.setdefault(literal, set()).update(
                getattr(r, name) for r in rows if isinstance(r, cls))
    unused = {values: left for values, seen in used.items()
              if (left := set(values) - {None} - seen)}
    assert not unused, unused
