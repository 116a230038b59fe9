"""Three historical DeepSpeed bugs in how Muon meets a real model, re-introduced at run time for the
mutation self-check (registered in ``harness.registry.mutants.MUTANTS``). None of them can show on the
synthetic model: it is never built under ``zero.Init``, forbids "embed"/"lm_head" names and passes
no parameter groups. Each installer wraps what is installed (stock or patched) and returns the undo.
"""
from __future__ import annotations

from typing import Callable


def _retag(rule: Callable) -> Callable[[], None]:
    """Wrap ``deepspeed.set_optimizer_flags`` so that, after it ran, ``use_muon`` is ``rule(name, p)``."""
    import deepspeed  # late: DeepSpeed, rank side

    orig = deepspeed.set_optimizer_flags

    def set_optimizer_flags(config_class, model):
        orig(config_class, model)
        for name, p in model.named_parameters():
            use = bool(rule(name, p))
            if use != bool(getattr(p, "use_muon", False)):
                p.use_muon = use
                p.muon_num_heads = None
                p.muon_head_dim = None

    deepspeed.set_optimizer_flags = set_optimizer_flags  # engine.py imports it from the package at call time

    def undo():
        deepspeed.set_optimizer_flags = orig

    return undo


def _not_excluded(name: str) -> bool:
    low = name.lower()
    return "embed" not in low and "lm_head" not in low


def install_tag_from_placeholder() -> Callable[[], None]:
    """Muon decided from ``param.dim()`` as the parameter reports it: under ``zero.Init`` a partitioned
    parameter is a 1-D placeholder, so every matrix silently goes to Adam (what DeepSpeed did before
    it read the layer shape, ``deepspeed/__init__.py`` ``_layer_shape``)."""
    return _retag(lambda name, p: p.dim() >= 2 and _not_excluded(name))


def install_tag_ignores_names() -> Callable[[], None]:
    """Muon for every matrix, embeddings and ``lm_head`` included (the name rule dropped)."""
    def shape(p):
        return tuple(getattr(p, "ds_shape", p.shape))

    return _retag(lambda name, p: len(shape(p)) >= 2)


def install_embeddings_by_type() -> Callable[[], None]:
    """Muon's definition instead of DeepSpeed's name rule for embeddings: every ``nn.Embedding`` weight (a head
    tied to one with it) goes to Adam whatever its name. It hides the departure MUON-BY-NAME, which the
    gate's ``-departs-by-name`` case claims, so that case must fail."""
    import deepspeed  # late: DeepSpeed, rank side
    from torch import nn

    orig = deepspeed.set_optimizer_flags

    def set_optimizer_flags(config_class, model):
        orig(config_class, model)
        for m in model.modules():
            if isinstance(m, nn.Embedding) and getattr(m.weight, "use_muon", False):
                m.weight.use_muon = False
                m.weight.muon_num_heads = None
                m.weight.muon_head_dim = None

    deepspeed.set_optimizer_flags = set_optimizer_flags

    def undo():
        deepspeed.set_optimizer_flags = orig

    return undo


INSTALL = {
    "muon-tag-from-placeholder": install_tag_from_placeholder,
    "muon-on-embeddings": install_tag_ignores_names,
    "embeddings-to-adam-by-type": install_embeddings_by_type,
}


# -- which cases each must fail (the ``catches`` predicates) ---------------------------------------


def _tagged(case):
    from oracles import ParamSpec  # late: keeps this module torch-free at import

    return [ParamSpec.deepspeed_tagged(p.name, p.shape) for p in case.params]


def catches_placeholder(case) -> bool:
    return bool(case.zero_init) and any(s.use_muon for s in _tagged(case))


def catches_embeddings(case) -> bool:
    return any(len(p.shape) >= 2 and not _not_excluded(p.name) for p in case.params)


def catches_embeddings_by_type(case) -> bool:
    """A model case with an embedding (or a weight tied to one) whose name DeepSpeed's rule puts on Muon."""
    if not case.model:
        return False
    from harness.models import roles  # late: keeps this module torch-free at import

    return any(any("Embedding" in why for why in whys) for _, whys in roles.model_misrouted(case.model, case.seed))


def catches_groups(case) -> bool:
    if not case.model:
        return False
    from harness import models  # late: keeps this module torch-free at import

    return any(g.settings for g in models.build_spec(case.model, case.seed).param_groups)
