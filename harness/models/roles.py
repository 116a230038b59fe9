"""Which matrices of a module Muon's definition keeps on Adam, found by what the module does with them.

Why by module type and not by name: Muon as its authors and ``torch.optim.Muon`` define it orthogonalises
the hidden weight matrices only; the input embedding, the output projection and every vector go to a
second optimizer. DeepSpeed 0.19.8 decides by name instead (``oracles.layout.deepspeed_uses_muon``: two or
more dims and neither "embed" nor "lm_head" in the name), so GPT-2's ``wte``/``wpe``, a tied output head and
a classifier named ``fc`` or ``classifier`` reach Muon. Comparing the two rules needs the roles read from
the module itself:

* an ``nn.Embedding`` / ``nn.EmbeddingBag`` weight is an input embedding;
* a parameter that is an embedding's weight and also another module's (``named_parameters`` with
  duplicates) is tied, and where that other module is the output projection the head rides on the
  embedding's name;
* the output projection is the last leaf module owning a matrix that a forward pass calls (a batch
  given), else Hugging Face's ``get_output_embeddings()``, else the last such module in registration
  order. A matrix held directly by a module with children is never taken for it.

Pure inspection: nothing here imports DeepSpeed. A forward pass runs only on a module this module built
itself (``model_misrouted``), so a caller's module never has its buffers (BatchNorm statistics) moved.
"""
from __future__ import annotations

import functools
from collections import defaultdict

import torch
from torch import nn

from harness.models import build_spec
from oracles.layout import deepspeed_uses_muon

EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)


def _dims(p: torch.Tensor) -> int:
    """A parameter's dims as the model declares it (under ``zero.Init`` the tensor is a 1-D placeholder)."""
    return len(getattr(p, "ds_shape", p.shape))


def _owns_matrix(m: nn.Module) -> bool:
    """A leaf module holding a matrix of its own: a matrix a module with children holds may be used before
    or after them, so the order of the forward says nothing about it."""
    return next(m.children(), None) is None and any(_dims(p) >= 2 for p in m.parameters(recurse=False))


def output_projection(module: nn.Module, batch: dict | None = None) -> tuple[str, str] | None:
    """(qualified name, how it was found) of the module that produces the output (module docstring), or
    None when no leaf module owns a matrix. With ``batch`` the module's forward runs once, without
    gradients, to see which matrix-owning module is called last."""
    names = {id(m): n for n, m in module.named_modules()}
    if batch is not None:
        order: list[str] = []
        hooks = [m.register_forward_hook(lambda mod, _i, _o: order.append(names[id(mod)]))
                 for m in module.modules() if _owns_matrix(m)]
        try:
            with torch.no_grad():
                module(**batch)
        finally:
            for h in hooks:
                h.remove()
        if order:
            return order[-1], "the last matrix the forward applies"
    get_out = getattr(module, "get_output_embeddings", None)
    head = get_out() if callable(get_out) else None
    if isinstance(head, nn.Module) and id(head) in names:
        return names[id(head)], "the module's get_output_embeddings()"
    owners = [n for n, m in module.named_modules() if _owns_matrix(m)]
    return (owners[-1], "the last matrix-owning module registered (no batch to trace)") if owners else None


def adam_by_definition(module: nn.Module, batch: dict | None = None) -> dict[str, list[str]]:
    """Every matrix (two or more dims) Muon's definition puts on Adam, by its ``named_parameters()`` name
    (the one DeepSpeed's name rule reads), with each reason found."""
    canonical = {id(p): n for n, p in module.named_parameters()}
    every: dict[int, list[str]] = defaultdict(list)
    for n, p in module.named_parameters(remove_duplicate=False):
        every[id(p)].append(n)
    why: dict[int, list[str]] = defaultdict(list)
    for mname, m in module.named_modules():
        if isinstance(m, EMBEDDINGS):
            why[id(m.weight)].append(f"the weight of {type(m).__name__} {mname}")
    for pid in list(why):
        others = [n for n in every[pid] if n != canonical[pid]]
        if others:
            why[pid].append(f"tied to {', '.join(others)}")
    found = output_projection(module, batch)
    if found is not None:
        head, how = found
        for pname, p in module.get_submodule(head).named_parameters(recurse=False):
            if _dims(p) >= 2:
                why[id(p)].append(f"the output projection {head}.{pname} ({how})")
    params = {id(p): p for p in module.parameters()}
    return {canonical[pid]: reasons for pid, reasons in why.items() if _dims(params[pid]) >= 2}


def misrouted(module: nn.Module, batch: dict | None = None) -> dict[str, list[str]]:
    """The matrices of ``adam_by_definition`` that DeepSpeed's name rule puts on Muon."""
    shapes = {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in module.named_parameters()}
    return {n: why for n, why in adam_by_definition(module, batch).items() if deepspeed_uses_muon(n, shapes[n])}


@functools.lru_cache(maxsize=8)
def model_misrouted(model: str, seed: int) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``misrouted`` of a ``Case.model`` (built-in or factory path), built here and traced on its first
    batch; cached per model and seed (a built-in language model is a transformers model to build)."""
    spec = build_spec(model, seed)
    found = misrouted(spec.module, spec.batch(0, 1, 0))
    return tuple((n, tuple(why)) for n, why in found.items())
