"""The drafter-family records (``dflash.drafter.families``) against the config and the models they
build: every ``drafter.family`` choice has a record, and what each family adds to DFlash-1's
parameters is the same in the planner and in the built model (a family whose cost parts are missing
or wrong fails here; the planner counts matrices, not norms, so the test compares the additions)."""

from __future__ import annotations

import pytest
from tiny_drafter import tiny_arch

from dflash.config.schema import DrafterFamilyName
from dflash.drafter.families import FAMILIES, build_drafter
from dflash.drafter.model import num_parameters
from dflash.sizing.memory import drafter_num_params


def test_every_config_choice_has_a_record():
    assert sorted(FAMILIES) == sorted(f.value for f in DrafterFamilyName)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_planner_counts_the_parameters_the_family_adds(name):
    base, arch = tiny_arch(), tiny_arch(family=name)
    model = build_drafter(arch)
    assert type(model).__name__ == FAMILIES[name].architecture
    added = num_parameters(model) - num_parameters(build_drafter(base))
    assert drafter_num_params(arch) - drafter_num_params(base) == added
