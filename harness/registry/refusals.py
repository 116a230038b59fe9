"""Configurations DeepSpeed itself must refuse: a case that triggers one passes only when every rank
it hears from raised exactly that refusal, and fails when DeepSpeed runs it.

Why a case kind of its own: the harness refuses some configurations before any rank starts (``python
-m harness check``, ``harness.cli.check_config``) because DeepSpeed refuses them inside
``deepspeed.initialize``. The gate's ordinary cases then never hand DeepSpeed such a config, so a
DeepSpeed that stopped refusing one (its guard negated or deleted) would run Muon on a path it says
it cannot run, and nothing would notice. These cases hand it the config on purpose.

A refusal is matched as a crash bug is (``harness.judge.raised.raised_in``): exception type, a message
fragment (DeepSpeed's own words) and the frame that raises, read from the rank's traceback. Each entry
names the source lines it was read from; a tree is expected to refuse only where its source still says the
refusal's message (``DsRefusal.said_by``: a probe of the tree, not of its version string).
"""
from __future__ import annotations

from dataclasses import dataclass

from harness.case import dsconfig
from harness.env import tree
from harness.judge.raised import raised_in


@dataclass(frozen=True)
class DsRefusal:
    name: str
    etype: str  # the exception's type as the traceback's last line names it
    fragment: str  # DeepSpeed's message (a fragment of it)
    frame: str  # "file.py:function": where it must be raised
    source: str  # where it was read (DeepSpeed file:line per release)
    applies: object  # (case, cfg) -> bool
    remedy: str  # the change to the config (or model) that DeepSpeed runs instead

    def sentence(self, release: str) -> str:
        """The one line ``check`` prints for a config DeepSpeed refuses: its words, where, and the way out."""
        return (f"DeepSpeed {release} refuses this config: {self.etype}: {self.fragment} ({self.frame}); "
                f"to run it: {self.remedy}")

    @property
    def said_by(self) -> str:
        """The file of the ``deepspeed`` package whose string constants must hold ``fragment``."""
        return tree.package_path(self.frame.partition(":")[0])

    def matches(self, traceback: str) -> bool:
        file, _, func = self.frame.partition(":")
        return raised_in(traceback, self.etype, self.fragment, func, file=file)


def _zero(cfg: dict) -> dsconfig.Zero:
    return dsconfig.resolve(cfg).zero


def _muon(cfg: dict) -> bool:
    return dsconfig.resolve(cfg).optimizer.kind == "muon"


def _no_norm(cfg: dict) -> bool:
    """``compute_grad_norm: false`` at ZeRO-1/2 on the ZeRO optimizer (the BF16_Optimizer route refuses it
    earlier, in the engine), the constructor's first checks then in their order: clipping, then offload."""
    ds = dsconfig.resolve(cfg)
    return ds.zero.compute_grad_norm is False and ds.zero.stage in (1, 2) and not ds.bf16_optimizer_route


def _tp_heads_cut(c, cfg: dict) -> bool:
    """An AutoTP case (``harness.case.tp``) whose every per-head shard cuts a head: the linear-attention
    block, whose config gives AutoTP one head per rank (an even split of the rows), with a head width that
    does not divide a rank's rows."""
    from harness.case import tp as tp_case  # late: keeps this module torch-free at import

    tp = tp_case.autotp_size(c)
    if tp <= 1 or not dsconfig.resolve(cfg).optimizer.per_head_muon:
        return False
    geo = tp_case.geometry(c)
    return geo["attn"] == tp_case.LINEAR_ATTN and (geo["heads"] * geo["head_dim"] // tp) % geo["head_dim"] != 0


def _muon_group_betas(c, cfg: dict) -> set:
    """The momentum of each user param group holding a Muon matrix (its own, else the config's). A release
    that flattens the user's groups (DSM-104, 0.19.2-0.19.6) drops their momentum for the config's: one beta,
    nothing to refuse (measured: both betas-refused cases then crash in the deal as DSM-102 says)."""
    from harness.registry.historical import groups_flattened  # late: keeps this module torch-free at import
    from oracles.layout import deepspeed_uses_muon  # late: keeps this module torch-free at import

    default = dsconfig.resolve(cfg).optimizer.muon.momentum
    if groups_flattened():
        return {default}
    shapes = {p.name: p.shape for p in c.params}
    return {g.momentum if g.momentum is not None else default for g in c.groups
            if any(deepspeed_uses_muon(n, shapes[n]) for n in g.params)}


REFUSALS: tuple[DsRefusal, ...] = (
    # reduce_scatter defaults to true (zero config), so the harness's own ZeRO-3 configs turn it off
    # (harness.case.spec.ds_config) and ``harness check`` refuses it before any rank (check_plan.validate).
    DsRefusal("z3-muon-reduce-scatter", "ValueError", "Muon and reduce scatter cannot be used together",
              "stage3.py:__init__",
              "runtime/zero/stage3.py:360-361 (0.19.8), :352-353 (0.19.7), :337-338 (0.18.9)",
              lambda c, cfg: _muon(cfg) and _zero(cfg).stage == 3
              and _zero(cfg).reduce_scatter is not False,
              'set "zero_optimization": {"reduce_scatter": false} (DeepSpeed\'s default is true)'),
    # zero_quantized_gradients makes the engine build a local all-to-all group (engine.py:2159-2161) that
    # it hands the ZeRO-3 optimizer as all2all_process_group (engine.py:2769).
    DsRefusal("z3-muon-all2all", "ValueError", "Muon and all2all process group cannot be used together",
              "stage3.py:__init__",
              "runtime/zero/stage3.py:362-363 (0.19.8), :354-355 (0.19.7), :339-340 (0.18.9)",
              lambda c, cfg: _muon(cfg) and _zero(cfg).stage == 3
              and bool(_zero(cfg).zero_quantized_gradients),
              'set "zero_optimization": {"zero_quantized_gradients": false}'),
    # Per-head Muon (a parameter's muon_num_heads, original_muon.py:170-177) refuses, at the first step, a
    # head count the parameter cannot hold: not a 2-D matrix, or rows not divisible by the count.
    DsRefusal("per-head-not-2d", "ValueError", "Per-head Muon expects a 2D attention projection",
              "original_muon.py:_per_head_orthogonalize", "runtime/zero/muon/original_muon.py:172-173 (0.19.8)",
              lambda c, cfg: _muon(cfg) and any(p.num_heads and len(p.shape) != 2 for p in c.params),
              'give muon_num_heads only to 2-D attention projections, or drop "per_head_muon"'),
    DsRefusal("per-head-indivisible", "ValueError", "Per-head Muon needs the output dim to split evenly",
              "original_muon.py:_per_head_orthogonalize", "runtime/zero/muon/original_muon.py:176-178 (0.19.8)",
              lambda c, cfg: _muon(cfg) and any(p.num_heads and len(p.shape) == 2 and p.shape[0] % p.num_heads
                                                for p in c.params),
              'give each projection a head count that divides its output rows, or drop "per_head_muon"'),
    # ZeRO-3 runs every Muon matrix with one momentum (one beta for the distributed update) and refuses
    # user groups that set different ones, rather than step some with another group's beta.
    DsRefusal("z3-muon-group-betas", "ValueError", "All Muon parameter groups must have the same momentum",
              "stage3.py:_create_fp16_partitions_with_defragmentation",
              "runtime/zero/stage3.py:927-929 (0.19.8); the same check from 0.18.9",
              lambda c, cfg: _muon(cfg) and _zero(cfg).stage == 3 and len(_muon_group_betas(c, cfg)) > 1,
              'give every parameter group that holds a Muon matrix the same momentum'),
    # The BF16_Optimizer route (bf16 with fp32 gradient accumulation at ZeRO-1, DSConfig.bf16_optimizer_route)
    # orthogonalises whole 2-D matrices only and refuses a Muon parameter of another rank at construction.
    DsRefusal("bf16opt-muon-not-2d", "ValueError", "BF16 Muon currently supports dense two-dimensional matrices only",
              "bf16_optimizer.py:__init__", "runtime/bf16_optimizer.py:62-66 (0.19.8)",
              lambda c, cfg: _muon(cfg) and dsconfig.resolve(cfg).bf16_optimizer_route
              and any(p.uses_muon and len(p.shape) != 2 for p in c.params),
              'keep every Muon parameter a 2-D matrix on this route, or "data_types": {"grad_accum_dtype": "bf16"} '
              "(the ZeRO-1 optimizer, which takes them)"),
    # compute_grad_norm false (ZeRO-1/2 only; DeepSpeed's config refuses it elsewhere) drops the one test an
    # fp32 step has, so the optimizer's constructor refuses what needs the norm, clipping first (its default is
    # 1.0, not off), then offload; the BF16_Optimizer route refuses it in the engine, before any constructor.
    DsRefusal("no-norm-with-clipping", "ValueError", "compute_grad_norm=false requires gradient_clipping=0",
              "stage_1_and_2.py:__init__", "runtime/zero/stage_1_and_2.py:212-213 (0.19.8)",
              lambda c, cfg: _muon(cfg) and _no_norm(cfg) and dsconfig.resolve(cfg).gradient_clipping > 0,
              'set "gradient_clipping": 0 (DeepSpeed\'s default is 1.0), or drop "compute_grad_norm": false'),
    DsRefusal("no-norm-with-offload", "ValueError", "compute_grad_norm=false does not support optimizer offload",
              "stage_1_and_2.py:__init__", "runtime/zero/stage_1_and_2.py:216-218 (0.19.8)",
              lambda c, cfg: _muon(cfg) and _no_norm(cfg) and dsconfig.resolve(cfg).gradient_clipping == 0
              and _zero(cfg).offload_optimizer.device != "none",
              'drop "offload_optimizer", or "compute_grad_norm": false'),
    DsRefusal("no-norm-on-bf16-optimizer", "ValueError",
              "compute_grad_norm=false does not support ZeRO Stage 1 with BF16 parameters and FP32 gradient",
              "engine.py:_do_optimizer_sanity_check", "runtime/engine.py:2306-2309 (0.19.8)",
              lambda c, cfg: _muon(cfg) and dsconfig.resolve(cfg).bf16_optimizer_route
              and _zero(cfg).compute_grad_norm is False,
              'drop "compute_grad_norm": false, or "data_types": {"grad_accum_dtype": "bf16"}'),
    # ZeRO-2 with its reduce-scatter (the default) averages after the reduction and asserts that nothing
    # divided before it; the constructor's norm checks above come first.
    DsRefusal("z2-prescale-with-reduce-scatter", "AssertionError",
              "pre-scale gradients is not yet supported with", "stage_1_and_2.py:__init__",
              "runtime/zero/stage_1_and_2.py:346-351 (0.19.8)",
              lambda c, cfg: _muon(cfg) and _zero(cfg).stage == 2 and _zero(cfg).reduce_scatter
              and dsconfig.resolve(cfg).prescale_gradients
              and not (_no_norm(cfg) and (dsconfig.resolve(cfg).gradient_clipping > 0
                                          or _zero(cfg).offload_optimizer.device != "none")),
              'set "prescale_gradients": false (ZeRO-2 divides after its reduce-scatter), or '
              '"zero_optimization": {"reduce_scatter": false}'),
    # Per-head Muon under AutoTP: every tagged projection's shard cuts a head, so nothing stays per-head
    # after the re-resolution on the shards; DeepSpeed raises rather than train without it.
    DsRefusal("per-head-tp-cut", "ValueError", "every tagged projection is sharded across head boundaries",
              "__init__.py:resolve_per_head_muon_after_sharding", "__init__.py:428-430 (0.19.8)",
              lambda c, cfg: _muon(cfg) and _tp_heads_cut(c, cfg),
              'an autotp_size that keeps whole heads on each rank, or drop "per_head_muon"'),
)


def expected(case) -> list[DsRefusal]:
    """The refusals DeepSpeed (the installed release) must make for this case."""

    cfg = case.config
    t = tree.installed()
    return [r for r in REFUSALS if r.applies(case, cfg) and t.says(r.said_by, r.fragment)]
