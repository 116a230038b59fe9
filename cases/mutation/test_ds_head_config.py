"""The model config the per_head_muon cases hand DeepSpeed describes exactly the case's heads."""
from __future__ import annotations

import pytest

from harness.catalog import matrix
from harness.case.spec import ParamShape
from harness.rank.ds_run import head_config


def test_head_config_matches_the_cases_heads():
    case = matrix.ds_tagged_head_cases()[0]
    cfg = head_config(case)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (2, 1, 4)


def test_head_config_refuses_heads_a_config_cannot_describe():
    case = matrix.ds_tagged_head_cases()[0]
    fused = case.replace(params=tuple(matrix.TINY_PARAMS) + (matrix.HEAD_PARAM,))  # a fused qkv leaf
    with pytest.raises(ValueError, match="q_proj"):
        head_config(fused)
    widths = case.replace(params=tuple(matrix.TINY_PARAMS) + (ParamShape("attn.q_proj.weight", (8, 6), 2),
                                                               ParamShape("attn.k_proj.weight", (6, 6), 1)))
    with pytest.raises(ValueError, match="width"):
        head_config(widths)
