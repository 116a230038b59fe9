"""The three model-specific mutants (``harness.registry.module_mutants``) are killed by the model kill case and
by none of the synthetic kill cases: the synthetic model is never built under ``zero.Init``, has no
"embed"/"lm_head" parameter and passes no parameter groups, which is why these bugs went unseen.

The kill cases run with ``ns_method="standard"`` (see ``harness.catalog.models.NS_METHOD``), so the
unmutated baseline is clean on a CPU whose fp16 support DeepSpeed does not detect. Cost: 7 cases
unmutated + 3 x 7 mutated, ~30 s on two busy cores.
"""
from __future__ import annotations

import json

import pytest

from harness.case.spec import canonical_json
from harness.selfcheck.kill_matrix import default_kill_cases, kill_matrix
from harness.registry.mutants import MUTANTS
from harness.catalog.models import kill_cases as model_kill_cases
from harness.registry.module_mutants import INSTALL

pytestmark = pytest.mark.pipeline


def _standard(c):
    cfg = json.loads(c.ds_config)
    cfg["optimizer"]["params"]["ns_method"] = "standard"
    return c.replace(ds_config=canonical_json(cfg))


def test_model_mutants_killed_only_by_model_cases(pool_manager):
    cases = [_standard(c) for c in default_kill_cases()]
    model_names = {c.name for c in cases if c.model}  # the model kill case, and the departure family's GPT-2
    assert {c.name for c in model_kill_cases()} <= model_names, "the model kill case is part of the default kill set"
    km = kill_matrix(cases, list(INSTALL) + ["param-groups-flattened"], manager=pool_manager)
    print(km.table())
    assert all(km.baseline[n] for n in model_names), km.baseline
    # A synthetic case whose unmutated baseline fails says nothing either way (on a CPU without fp16
    # support in DeepSpeed's eyes the fp16 ones do); every one that runs clean must not kill.
    assert sum(km.baseline.values()) >= len(model_names) + 2, km.baseline
    for m in INSTALL:
        killers = set(km.killed_by(m))
        assert killers, f"{m} survived every kill case"
        assert killers <= model_names, f"{m} killed by synthetic cases {sorted(killers - model_names)}"
        assert all(MUTANTS[m].expected(c) == (c.name in killers) for c in cases if km.baseline[c.name]), km.surprises()
    # Group overrides dropped is one mutant for user groups and a model's own groups (issue 13's
    # param-groups-flattened): the model kill case must kill it as well as the synthetic groups case.
    assert model_names & set(km.killed_by("param-groups-flattened")), km.table()
    assert not km.surprises(), km.table()
