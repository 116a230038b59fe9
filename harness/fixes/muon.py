"""``muon-conv-kernels`` (DSM-012): 4-D (conv) parameters crash ``muon_update``.

``original_muon.muon_update`` reshapes a 4-D update to ``(out, in*kh*kw)`` for Newton-Schulz, but its
last line ``torch.where(grad_is_finite, update, grad)`` broadcasts that 2-D result against the 4-D
gradient: ``RuntimeError: The size of tensor a (18) must match the size of tensor b (3)``. DeepSpeed
tags every >=2-D parameter ``use_muon`` (``set_optimizer_flags``), so any model with a ``Conv2d`` dies
at its first step, on every ZeRO path. The aspect scale is also taken from ``(kh, kw)`` instead of
the orthogonalised matrix's shape.

The fix hands ``muon_update`` 2-D views ``(out, in*kh*kw)`` of the gradient and the momentum (the
same memory, so the in-place momentum update and Nesterov blend land where DeepSpeed expects) and
returns the update viewed back as 4-D. Newton-Schulz, the finite guard and the aspect scale
``sqrt(max(1, out/(in*kh*kw)))`` are then those of the orthogonalised matrix.

The ZeRO call sites import ``muon_update`` from ``original_muon`` at call time, so replacing that
module attribute reaches them; stage 0's ``muon_optimizer.py`` binds it once, at its own import. A
rank that imported it before the fix (a stock case first) kept the unfixed function there, and the
patched stage-0 conv case crashed only in that order. The binding is a second target, installed
first, while ``original_muon`` is still the original.

Stage 0's binding also carries the lookup of the ``z0-per-head`` fix (DSM-020, registered in ``z0``):
see ``_heads_of``; ``original_muon``'s that of ``bf16-optimizer-per-head`` (DSM-030, registered in
``bf16opt``): see ``_next_bf16_heads``.
"""
from __future__ import annotations

from harness.fixes._registry import MUON_INPUT_SCALE, Fix, Target, active
from harness.fixes.units import UNITS

CONV = "muon-conv-kernels"
Z0_HEADS = "z0-per-head"

# The MuonWithAuxAdam whose stage-0 step is running (None outside it); read by stage 0's muon_update.
_Z0_STEP: list = [None]
# While BF16_Optimizer's ``_prepare_muon_updates`` runs (None outside it): an iterator over (shape, head count)
# of the matrices it orthogonalises, in the order it calls ``muon_update`` (set by ``bf16opt``).
BF16_HEADS: list = [None]
# On a MuonWithAuxAdam whose engine skips this model step (``z0-fp32-skip-nonfinite``): its step does nothing.
# An instance flag, not a replaced ``step``: wrappers set on the instance (a capture's) still run first.
Z0_SKIP_STEP = "_dsm_skip_step"
# On an fp32 master made by FP16_UnfusedOptimizer (a clone, without the model parameter's attributes):
# the model parameter it stands for (set by ``z0``'s patched ``initialize_optimizer_states``).
MODEL_PARAM_ATTR = "_dsm_model_param"


def _heads_of(momentum) -> int | None:
    """The head count of the parameter whose momentum buffer stage 0's step hands ``muon_update``.
    Read when the step calls, not when the engine is built: a user may tag ``muon_num_heads`` after
    ``deepspeed.initialize`` (ZeRO's call sites read it then too); under fp16/bf16 the tag lives on
    the model parameter, not on the fp32 master the inner optimizer steps."""
    opt = _Z0_STEP[0]
    if opt is None:
        return None
    for group in opt.param_groups:
        if not group.get("use_muon"):
            continue
        for p in group["params"]:
            if opt.state.get(p, {}).get("momentum_buffer") is momentum:
                heads = getattr(p, "muon_num_heads", None)
                return heads if heads is not None else getattr(getattr(p, MODEL_PARAM_ATTR, None),
                                                               "muon_num_heads", None)
    return None


def _next_bf16_heads(grad) -> int | None:
    """The head count of the matrix BF16_Optimizer's ``_prepare_muon_updates`` hands ``muon_update`` now:
    the next of its matrices in call order, which must have ``grad``'s shape (else the loop is not the one
    the order was read from, and guessing a head count would be worse than stopping)."""
    shape, heads = next(BF16_HEADS[0], (None, None))
    if shape != tuple(grad.shape):
        raise RuntimeError(f"bf16-optimizer-per-head: muon_update received a {tuple(grad.shape)} matrix where "
                           f"_prepare_muon_updates' layout lists {shape}; the fix cannot tell its head count")
    return heads


def make_muon_update(orig, z0_binding=False):

    def muon_update(grad, momentum, beta=0.95, ns_steps=5, nesterov=True, ns_method="gram",
                    is_expert_group=False, num_heads=None):
        if z0_binding and num_heads is None and active(Z0_HEADS):
            num_heads = _heads_of(momentum)
        if not z0_binding and num_heads is None and BF16_HEADS[0] is not None:
            num_heads = _next_bf16_heads(grad)
        scale = MUON_INPUT_SCALE[0] if active(UNITS) else None
        if scale is not None and scale != 1.0:
            # The caller keeps gradient and momentum in units of the loss scale S (as stock does, and as
            # the checkpoint and harness.rank.capture expect); Muon itself runs in true units, so that its
            # Newton-Schulz input (normalised by ||X|| + 1e-7) is U, not S*U. Division and multiplication
            # by a power of two are exact, so the stored momentum is S times the true-unit momentum.
            momentum.div_(scale)
            try:
                return _call(grad / scale, momentum, beta, ns_steps, nesterov, ns_method, is_expert_group,
                             num_heads)
            finally:
                momentum.mul_(scale)
        return _call(grad, momentum, beta, ns_steps, nesterov, ns_method, is_expert_group, num_heads)

    def _call(grad, momentum, beta, ns_steps, nesterov, ns_method, is_expert_group, num_heads):
        if active(CONV) and grad.ndim == 4 and not is_expert_group and num_heads is None:
            g2 = grad.view(grad.shape[0], -1)
            m2 = momentum.view(momentum.shape[0], -1)
            out = orig(g2, m2, beta, ns_steps, nesterov, ns_method, is_expert_group, num_heads)
            return out.view(grad.shape)
        return orig(grad, momentum, beta, ns_steps, nesterov, ns_method, is_expert_group, num_heads)

    return muon_update


T_MUON_UPDATE = Target("deepspeed.runtime.zero.muon.original_muon", "muon_update", "a77932ec952c6824", make_muon_update)
# The same function, as stage 0's module bound it (``from .original_muon import muon_update``).
T_MUON_UPDATE_Z0 = Target("deepspeed.runtime.zero.muon.muon_optimizer", "muon_update", "a77932ec952c6824",
                          lambda orig: make_muon_update(orig, z0_binding=True))


def make_z0_step(orig):
    def step(self, closure=None, step_id=None):
        if self.__dict__.get(Z0_SKIP_STEP):  # set only while the engine's model step skips (``z0``)
            return None
        if not active(Z0_HEADS):
            return orig(self, closure=closure, step_id=step_id)
        outer, _Z0_STEP[0] = _Z0_STEP[0], self
        try:
            return orig(self, closure=closure, step_id=step_id)
        finally:
            _Z0_STEP[0] = outer

    return step


T_Z0_STEP = Target("deepspeed.runtime.zero.muon.muon_optimizer", "MuonWithAuxAdam.step", "e140cabbfecd5c90",
                   make_z0_step)

FIXES = (
    Fix(name=CONV, bugs=("DSM-012",),
        summary="4-D (conv) parameters go through `muon_update` without crashing",
        targets=(T_MUON_UPDATE_Z0, T_MUON_UPDATE)),
)
