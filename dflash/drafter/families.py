"""Drafter families: the one record of what differs between DFlash-1 and DFlash2.

A family (:class:`DrafterFamily`) names its model class (the build, the decode hook
``propose``), the ``architectures`` entry and the ``dflash_config`` keys of its served export
(:mod:`dflash.drafter.export` reads and writes them from here), and its parts for the planner and
the rehearsal beyond the shared DFlash-1 stack (:mod:`dflash.drafter.family_costs`, pure Python so
the planner needs no torch). ``drafter.family`` selects one.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash.drafter.arch import FAMILY_FIELDS, DrafterArch
from dflash.drafter.dflash2 import DFlash2DraftModel
from dflash.drafter.family_costs import FAMILY_COSTS, FamilyCosts
from dflash.drafter.model import DFlashDraftModel


@dataclass(frozen=True)
class DrafterFamily:
    """Everything that differs between drafter families."""

    name: str
    architecture: str
    """``architectures`` of the served ``config.json``."""
    model: type[DFlashDraftModel]
    """The module (build; ``propose`` is its decode hook)."""
    summary: str
    costs: FamilyCosts
    """Its parameters, FLOPs and activation bytes beyond DFlash-1's."""

    @property
    def fields(self) -> tuple[str, ...]:
        """Its ``DrafterArch`` fields beyond the shared ones (``dflash_config`` keys of the export)."""
        return FAMILY_FIELDS[self.name]


FAMILIES: dict[str, DrafterFamily] = {
    f.name: f
    for f in (
        DrafterFamily(
            name="dflash",
            architecture="DFlashDraftModel",
            model=DFlashDraftModel,
            summary="DFlash-1: block diffusion with KV injection, argmax per slot",
            costs=FAMILY_COSTS["dflash"],
        ),
        DrafterFamily(
            name="dflash2",
            architecture="DFlash2DraftModel",
            model=DFlash2DraftModel,
            summary="DFlash2: block-local dynamic convolutions, candidate selector walked as a chain",
            costs=FAMILY_COSTS["dflash2"],
        ),
    )
}


def family_of(arch: DrafterArch) -> DrafterFamily:
    return FAMILIES[arch.family]


def build_drafter(arch: DrafterArch) -> DFlashDraftModel:
    """A freshly initialised drafter of ``arch``'s family."""
    return family_of(arch).model(arch)


def family_of_architectures(architectures: list[str]) -> DrafterFamily:
    """The family an exported ``config.json`` names (ValueError naming the field)."""
    found = [f for f in FAMILIES.values() if f.architecture in architectures]
    if len(found) != 1:
        known = [f.architecture for f in FAMILIES.values()]
        raise ValueError(f"config.json architectures={architectures} names none of {known}")
    return found[0]
